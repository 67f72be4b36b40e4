"""``lightning-shard train [overrides]``: the same as ``python -m lightning_shard.train [overrides]``.

The process is replaced by ``python -m lightning_shard.train`` (``os.execv``), so that Lightning's subprocess
launcher, which re-runs ``python -m <module> <argv>`` for every other rank, sees exactly that command.
"""

from __future__ import annotations

import argparse
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train with the Hydra config (conf/train.yaml); args are Hydra overrides",
                              add_help=False, prefix_chars="\0")  # every argument, -m and --help included, is Hydra's
    p.add_argument("overrides", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "lightning_shard.train", *args.overrides]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)
    return 0  # not reached
