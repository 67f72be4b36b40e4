"""Speed: tokens/s of lightning_shard's strategies and the peers (Lightning DDP, ZeroRedundancyOptimizer, torch
FSDP2, DeepSpeed ZeRO-1/2/3 where installed) side by side in one run, best of 3 alternating runs, with ratios and
where each strategy's step time goes (``bench/speed.py``: the tables and how they are measured)::

    .venv/bin/python bench/bench_speed.py                        # the suite: HF GPT-2 17M and the recipe GPT 23M
    .venv/bin/python bench/bench_speed.py --tables scaling sizes # world 1/2/4; model size and tensor count
    .venv/bin/python bench/bench_speed.py --variants ddp ddp_aa zero2 zero2_rs   # any variants (A/A control, A/B)
    .venv/bin/python bench/bench_speed.py --quick --tables all   # smoke run of every table at a tiny size

Writes ``bench/results/speed_<hardware>_<date>.{json,md}`` (main table; ``naming.py``) and
``speed_<table>_<hardware>_<date>.{json,md}`` for the others. Measure speed alone: the peak suite's malloc settings
are not used here, and a loaded machine moves every figure (the alternating order spreads drift over the variants,
not away). No thresholds: this script reports, it does not judge.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from driver import main  # noqa: E402

if __name__ == "__main__":
    main(default_suite="speed", description=__doc__)
