"""The `lightning-shard` console script: argparse subcommands, each implemented in its own module.

To add a subcommand, add `name: "package.module"` to SUBCOMMANDS; the module defines
`register(subparsers)`, which adds its parser and sets `func=run` with `run(args) -> int`. Keep heavy
imports (torch, lightning) inside `run` so that `lightning-shard --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

SUBCOMMANDS = {
    "topo": "lightning_shard.topology.cli_topo",
    "plan": "lightning_shard.planner.cli_plan",
    "consolidate": "lightning_shard.cli_consolidate",
    "train": "lightning_shard.app.cli_train",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-shard", description="ZeRO / FSDP-style sharding for Lightning: tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as err:  # user errors (bad capture, unknown preset ...): one clear line, no traceback
        print(f"lightning-shard {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
