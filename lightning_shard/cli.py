"""The `lightning-shard` console script: argparse subcommands, each implemented in its own module.

To add a subcommand, add `name: "package.module"` to SUBCOMMANDS and its one-line help to SUMMARIES; the
module defines `register(subparsers)`, which adds its parser and sets `func=run` with `run(args) -> int`.
Only the module of the subcommand being run is imported (`lightning-shard --help` imports none). The package
itself is imported first, as for any `lightning_shard.X`: it imports torch and Lightning, to register the strategy
names (lightning_shard/__init__.py), so every command, `--help` included, starts with that import.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Iterable, Sequence

SUBCOMMANDS = {
    "topo": "lightning_shard.topology.cli_topo",
    "plan": "lightning_shard.planner.cli_plan",
    "consolidate": "lightning_shard.checkpoint.cli",
    "train": "lightning_shard.app.cli_train",
}
# what `lightning-shard --help` lists, without importing the modules (a test checks they match)
SUMMARIES = {
    "topo": "show GPU topology: islands, link classes, bandwidths, best device subset",
    "plan": "predict memory, bytes per link class and step time per strategy; recommend one",
    "consolidate": "turn a sharded checkpoint directory into one plain file",
    "train": "train with the Hydra config (conf/train.yaml); args are Hydra overrides",
}


def build_parser(load: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser; `load`: the subcommands whose modules are imported (default: all), the others are listed only."""
    wanted = set(SUBCOMMANDS) if load is None else set(load)
    parser = argparse.ArgumentParser(prog="lightning-shard",
                                     description="ZeRO / FSDP-style sharding for Lightning: tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        if name in wanted:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=SUMMARIES.get(name), add_help=False)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line (the first argument that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command(argv)
    args = build_parser(load=[command] if command in SUBCOMMANDS else []).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly (Python docs, "Note on SIGPIPE")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (ValueError, OSError) as err:  # user errors (bad capture, missing file ...): one clear line, no traceback
        print(f"lightning-shard {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror and err.filename is not None:
        return f"{err.filename}: {err.strerror}"
    return str(err)


if __name__ == "__main__":
    sys.exit(main())
