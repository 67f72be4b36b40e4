"""Peak memory per rank: Lightning DDP, lightning_shard zero0/zero1/zero2, torch FSDP2, lightning_shard zero3 and
fsdp_shard, against what the ZeRO formula says each rung saves.

One run trains Hugging Face GPT-2 (``transformers.GPT2LMHeadModel``, 6 layers x 384, 6 heads, vocab 16384, seq 128,
tied embedding, dropout 0: ~17M parameters; synthetic tokens, fixed seed, fp32 AdamW) for 2 warmup + 3 timed steps
per variant, each variant in a fresh Python process with N CPU ranks (gloo, 1 thread per rank), every rank started
with ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536`` so that the peak follows the live tensors, and
writes ``bench/results/peak_<hardware>_<date>.{json,md}`` (``naming.py``)::

    .venv/bin/python bench/bench_peak.py --sizes 20x512        # the suite: 2 ranks, ~17M and ~72M parameters
    .venv/bin/python bench/bench_peak.py                       # 2 ranks, ~17M parameters only
    .venv/bin/python bench/bench_peak.py --quick               # smoke run (2 x 192, 1 + 1 steps)
    .venv/bin/python bench/bench_peak.py --devices 1           # or 4: any world size
    .venv/bin/python bench/bench_peak.py --sizes 24x512        # + a row set at 24 x 512 (~84M parameters)
    .venv/bin/python bench/bench_peak.py --n-layer 24 --n-embd 512 --out-dir /tmp/peak84m
    .venv/bin/python bench/bench_peak.py --model gpt           # the recipe GPT instead

Variants: ``ddp`` (Lightning ``DDPStrategy``), ``zero0``/``zero1``/``zero2`` (default options, ``tuning.bucket_mb``),
``fsdp2`` (``fully_shard`` per ``model.transformer.h[i]`` then the root, Lightning ``ModelParallelStrategy``),
``zero3`` (``Zero3Strategy()``), ``fsdp_shard`` (``FSDPShardStrategy(wrap_classes=[GPT2Block])``). Opt-in
(``--variants``): the option suffixes of ``variants.py`` and DeepSpeed ZeRO ``ds_zero1``/``ds_zero2``/``ds_zero3``
(``bench/deepspeed_rank.py``; the ``bench-deepspeed`` extra).

Measured per rank: peak RSS (VmHWM, whole process and training window), RSS at ``on_train_start`` (baseline);
for lightning_shard ``engine.memory_report()`` at the last timed step, reported beside the measured peak. What and
how: ``bench/measure.py``; the table and the formula: ``bench/peak.py``; the driver: ``bench/driver.py``.
A variant that fails (e.g. one that cannot run at the chosen world size) is an error row, not the end of the run.

No thresholds: this script reports, it does not judge.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from driver import main  # noqa: E402

if __name__ == "__main__":
    main(default_suite="peak", description=__doc__)
