"""Throughput, memory and traffic of zero0/zero1/zero2 against Lightning DDP and torch's ZeroRedundancyOptimizer.

One run of this script trains the same small GPT (synthetic tokens, fixed seed, AdamW) once per variant,
each variant in a fresh Python process with 2 CPU ranks (gloo, 1 thread per rank), and writes
``bench/results/zero12.json`` and ``bench/results/zero12.md``::

    .venv/bin/python bench/bench_zero12.py            # full run (~5-8 min on 2 cores)
    .venv/bin/python bench/bench_zero12.py --quick    # ~1 min smoke run
    .venv/bin/python bench/bench_zero12.py --variants zero2 ddp --steps 10
    .venv/bin/python bench/bench_zero12.py --suite all   # this table and the stage-3 one (bench_zero3.py)

Variants: ``zero0``/``zero1``/``zero2`` (lightning_shard), ``ddp`` (Lightning ``DDPStrategy``), ``zero_r``
(``torch.distributed.optim.ZeroRedundancyOptimizer`` wrapping AdamW, returned from ``configure_optimizers``
under Lightning ``DDPStrategy``). What is measured and how: ``bench/measure.py`` and ``bench/wire.py``; the
driver, ``bench/driver.py``, is shared by the three scripts.

No speed thresholds: this script reports, it does not judge.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from driver import main  # noqa: E402

if __name__ == "__main__":
    main(default_suite="zero12", description=__doc__)
