"""What exact handling of parameters without gradients costs: zero2 and zero3 with ``tuning.find_unused_parameters``
True (the default: one all-reduce of one byte per parameter tensor per optimizer step, so that a parameter no
rank used is left out of the step as torch leaves it) and False (no exchange), side by side in one run::

    .venv/bin/python bench/bench_unused.py              # ~4 min on 2 cores
    .venv/bin/python bench/bench_unused.py --quick

Writes ``bench/results/unused.json`` and ``.md``. Machinery: ``bench/driver.py``; what is measured:
``bench/measure.py``.
No speed thresholds: this script reports, it does not judge.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from driver import main  # noqa: E402

if __name__ == "__main__":
    main(default_suite="unused", description=__doc__)
