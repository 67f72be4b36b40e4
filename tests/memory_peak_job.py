"""Peak memory per rank measured outside the engine, one fresh process per rank and strategy (for
tests/strategies/test_memory_peak.py)::

    MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536 python -m tests.memory_peak_job OUT.json zero0 zero3

The two variables must be in the environment when the interpreter starts (glibc reads them at its first ``malloc``;
forked ranks inherit the setting): blocks of 64 KiB or more are then mmapped and the heap top is trimmed above 64
KiB, so a freed tensor leaves the resident set and the peak follows the live tensors. This job imports torch and
Lightning once, then forks a fresh two-rank :class:`tests.harness.World` per strategy. A forked process starts with
its high-water mark at its resident set (the kernel resets ``VmHWM`` at fork), so each rank's ``VmHWM`` after
training, less its ``VmRSS`` when the scenario starts (interpreter, torch, Lightning, the process group), is the
peak that the run itself added. Nothing measured here asks the engine what it holds; ``engine_report`` (its own
accounting at the end of fit) is carried along for comparison, not asserted on. Writes ``{strategy: [rank 0's
result, rank 1's result]}`` to OUT.json.

Strategies: ``ddp`` (Lightning's ``DDPStrategy``), ``zero0``/``zero1``/``zero2`` (``ZeroStrategy``,
``tuning.bucket_mb=4``), ``zero3`` (``Zero3Strategy``, defaults: one unit per Linear). Always on the CPU (gloo),
also where CUDA is present.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard.engine.comm import collectives as C
from lightning_shard.strategies import Zero3Strategy, ZeroStrategy

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
WIDTH, DEPTH = 1024, 24  # 24 x (1024 x 1024 + 1024) = 25.2M fp32 parameters: 96 MiB per full copy of the model
BATCH, STEPS = 4, 3  # activations: 24 x 4 x 1024 floats (0.4 MiB), nothing against the model state
BUCKET_MB = 4.0  # zero0-2: the full gradients zero2 holds at a time (a few buckets) are small against the model
STRATEGIES = ("ddp", "zero0", "zero1", "zero2", "zero3")


def status_bytes(key: str) -> Optional[int]:
    """A ``kB`` line of ``/proc/self/status`` (``VmHWM``, ``VmRSS``) in bytes; None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class WideMLP(L.LightningModule):
    """``DEPTH`` square Linear layers of ``WIDTH`` with tanh between, Adam: the model state dwarfs everything else.
    Built in ``configure_model`` (zero3: on the meta device, materialized shard by shard, as a user would)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: Optional[nn.Sequential] = None

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = nn.Sequential(*(m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())))

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        return self.layers(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def n_params() -> int:
    return DEPTH * (WIDTH * WIDTH + WIDTH)


def _strategy(name: str) -> Any:
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    if name == "zero3":
        return Zero3Strategy()
    if name in ("zero0", "zero1", "zero2"):
        return ZeroStrategy(stage=int(name[-1]), tuning={"bucket_mb": BUCKET_MB})
    raise ValueError(f"unknown strategy {name!r}; one of {STRATEGIES}")


def peak_run(name: str) -> dict[str, Any]:
    """One rank: ``STEPS`` steps of :class:`WideMLP` under strategy ``name``; this process's peak resident set above
    its resident set at the start (bytes)."""
    rss0 = status_bytes("VmRSS")
    torch.manual_seed(0)
    strategy = _strategy(name)
    data = TensorDataset(torch.randn(BATCH * C.get_world_size() * STEPS, WIDTH))
    trainer = L.Trainer(accelerator="cpu", devices=C.get_world_size(), strategy=strategy, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(WideMLP(), DataLoader(data, batch_size=BATCH))
    hwm = status_bytes("VmHWM")
    engine = getattr(strategy, "engine", None)
    report = {k: int(v) for k, v in engine.memory_report().items()} if engine is not None else None
    return {"rss0": rss0, "hwm": hwm, "peak": hwm - rss0, "engine_report": report}


def main(out: str, names: list[str]) -> None:
    from tests.harness import fresh_world

    wrong = {k: os.environ.get(k) for k, v in MALLOC_ENV.items() if os.environ.get(k) != v}
    if wrong:
        raise SystemExit(f"start this job with {MALLOC_ENV} in its environment (found {wrong})")
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    results = {}
    for name in names:
        with fresh_world(2) as w:  # fresh ranks: VmHWM is a high-water mark of the whole process
            results[name] = w.run(peak_run, name)
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(STRATEGIES))
