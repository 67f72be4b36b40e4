"""Stage 3 side by side: lightning_shard ``zero3`` and ``fsdp_shard`` against torch FSDP2 (and Lightning DDP).

Same model, data, optimizer (AdamW) and measurements as ``bench_zero12.py`` (``bench/driver.py`` and the modules it
names); writes
``bench/results/zero3.json`` and ``bench/results/zero3.md``::

    .venv/bin/python bench/bench_zero3.py                  # full run: zero3, fsdp_shard, fsdp2, ddp
    .venv/bin/python bench/bench_zero3.py --quick          # smoke run
    .venv/bin/python bench/bench_zero3.py --variants zero3 fsdp2
    .venv/bin/python bench/bench_zero3.py --suite all      # zero12 table too (its ddp run is reused here)

Variants: ``zero3`` (``Zero3Strategy``: every module with parameters a unit), ``fsdp_shard``
(``FSDPShardStrategy(wrap_classes=[lightning_shard.recipes.gpt.Block])``),
``fsdp2`` (``torch.distributed.fsdp.fully_shard`` on
each block then on the GPT root, in ``LightningModule.configure_model()`` with ``self.device_mesh``, run by
Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` on CPU / gloo), ``ddp``.

Reported per variant: tokens/s and its ratio to FSDP2 (and to DDP), model-state bytes per rank (params + grads
+ optimizer state held), peak RSS per rank, and bytes communicated per step per rank (lightning_shard: measured
by the LEDGER; FSDP2: computed from its units, with the collectives it issued counted as a cross-check).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from driver import main  # noqa: E402

if __name__ == "__main__":
    main(default_suite="zero3", description=__doc__)
