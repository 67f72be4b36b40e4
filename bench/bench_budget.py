"""The largest model that trains within a per-rank memory budget: for a fixed width, the largest GPT depth (number
of transformer blocks) whose measured whole-process peak (VmHWM, max over ranks) stays within ``--budget-mib``, for
Lightning DDP, torch FSDP2 and lightning_shard's strategies with and without offload / activation checkpointing.

The model is the peak suite's (``bench_peak.py``): Hugging Face GPT-2, width 384, 6 heads, vocab 16384, seq 128,
micro-batch 4 per rank, AdamW fp32, 2 warmup + 3 timed steps, 2 CPU ranks, each rank under the peak suite's malloc
environment; each measurement is one peak-suite run (``driver.run_one``) at a chosen depth, the search and the table
are ``bench/budget.py``. Writes ``bench/results/budget_<hardware>_<date>.{json,md}`` (``naming.py``)::

    .venv/bin/python bench/bench_budget.py                         # 13 variants, 1024 MiB/rank
    .venv/bin/python bench/bench_budget.py --budget-mib 900 --variants ddp zero3 zero3_ac
    .venv/bin/python bench/bench_budget.py --quick                 # smoke run (width 192, 2 variants)

No thresholds: this script reports, it does not judge.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from budget import run_budget  # noqa: E402
from driver import RESULTS, parse_args  # noqa: E402
from variants import VARIANTS  # noqa: E402

DEFAULT_VARIANTS = ("ddp", "fsdp2", "zero1", "zero2", "zero3", "fsdp_shard", "zero2_ac", "zero3_ac", "fsdp_shard_ac",
                    "zero2_offload", "zero3_offload", "zero3_offload_all", "zero3_bf16")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--budget-mib", type=float, default=None,
                   help="per-rank budget of the measured whole-process peak, MiB (default 1024: DDP fits 6 blocks "
                        "here; --quick 800)")
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                   help=f"default: {' '.join(DEFAULT_VARIANTS)} (--quick: ddp zero3)")
    p.add_argument("--fit-depths", nargs=2, type=int, default=None, metavar=("D1", "D2"),
                   help="the two depths every variant is measured at first (default 2 6; --quick 1 2)")
    p.add_argument("--time-depth", type=int, default=None,
                   help="the depth whose step times the table reports (default the second fit depth: measured for "
                        "every variant)")
    p.add_argument("--max-depth", type=int, default=64, help="largest depth the search tries")
    p.add_argument("--max-runs", type=int, default=7, help="runs per variant at most")
    p.add_argument("--n-embd", type=int, default=None, help="width (default 384; --quick 192)")
    p.add_argument("--n-head", type=int, default=None, help="default width/64")
    p.add_argument("--vocab", type=int, default=None, help="default 16384")
    p.add_argument("--batch-size", type=int, default=None, help="micro-batch per rank (default 4)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 3; --quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps per run (default 2; --quick 1)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before giving up")
    p.add_argument("--quick", action="store_true", help="smoke run: width 192, depths 1 and 2, ddp and zero3")
    p.add_argument("--out-dir", default=str(RESULTS),
                   help="where budget_<hardware>_<date>.json / .md go (naming.py; default bench/results)")
    p.add_argument("--reuse", default=None, metavar="BUDGET_JSON",
                   help="take the good runs of an earlier budget_*.json of the same job (any budget) instead of "
                        "measuring them again; only the missing or failed ones run")
    p.add_argument("--time-pass", action="store_true",
                   help="after the search, run every variant once more at --time-depth, back to back, for the "
                        "step-time column (the search's runs are spread over the whole, drifting, run)")
    p.add_argument("--retries", type=int, default=1, help="times a failed run is measured again (after 30 s)")
    a = p.parse_args()

    argv = ["--suite", "peak", "--devices", str(a.devices), "--timeout", str(a.timeout)]
    for k in ("n_embd", "n_head", "vocab", "batch_size", "steps", "warmup"):
        if getattr(a, k) is not None:
            argv += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    if a.quick:
        argv.append("--quick")  # the peak suite's smoke sizes: width 192, 1 warmup + 1 timed step
    args = parse_args(argv, default_suite="peak")
    args.budget_mib = a.budget_mib if a.budget_mib is not None else (800.0 if a.quick else 1024.0)
    args.variants = list(a.variants or (("ddp", "zero3") if a.quick else DEFAULT_VARIANTS))
    args.fit_depths = a.fit_depths or ([1, 2] if a.quick else [2, 6])
    args.time_depth = a.time_depth if a.time_depth is not None else args.fit_depths[1]
    args.max_depth = min(a.max_depth, 4) if a.quick else a.max_depth
    args.max_runs = a.max_runs
    args.out_dir = a.out_dir
    args.reuse, args.retries, args.time_pass = a.reuse, a.retries, a.time_pass
    if min(args.fit_depths) < 1 or args.fit_depths[0] == args.fit_depths[1]:
        p.error("--fit-depths: two different depths >= 1")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    run_budget(args)


if __name__ == "__main__":
    main()
