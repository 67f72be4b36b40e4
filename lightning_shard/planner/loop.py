"""The training loop's own time per step: a small model's step through Lightning's ``Trainer``, timed as a job's is.

A job's step is more than its compute, its collectives and the engine's work: Lightning's loop runs its hooks, the
closure, the precision plugin and the strategy's calls around them on every rank, and where ranks share cores they
reach each of the step's collectives apart, so each waits for the last. ``calibrate.measure_loop`` subtracts the same
model's engine step without the Trainer from :func:`trainer_step_s`; the difference is the profile's
``loop_s_per_step``, which the calibrated time model adds once per optimizer step.

This runs a ``Trainer`` in the calibration's own processes, on their process group (one is made for a world of one
rank and taken down after): it cannot run inside a job that is already fitting (``strategy=auto``), which reuses a
cached figure or goes without.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

import torch
from torch import nn

from ..engine.comm import collectives as C

ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE")


@contextmanager
def lightning_world(device: torch.device, port: int) -> Iterator[int]:
    """The environment a ``Trainer`` reads to join the process group that exists here as one node's ranks (none:
    a group of this process alone, made now on ``port``), restored afterwards. Yields the world size."""
    made = not C.is_initialized()
    if made:
        C.init_process_group("nccl" if device.type == "cuda" else "gloo", 0, 1, f"tcp://127.0.0.1:{port}",
                             timedelta(minutes=5))
    rank, world = C.get_rank(), C.get_world_size()
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), NODE_RANK="0", LOCAL_WORLD_SIZE=str(world))
    try:
        yield world
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if made:
            C.destroy_process_group()


def trainer_step_s(model: nn.Module, batch: torch.Tensor, device: torch.device, steps: int, warmup: int,
                   port: int) -> float:
    """Median seconds from batch start to batch end (as ``bench/measure.py`` times a step) of ``model`` on batches
    like ``batch`` (each rank's own), loss the mean square of its output, AdamW, under the ``zero0`` strategy through
    a ``Trainer``, after ``warmup`` steps; every rank of the process group takes part."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from ..strategies import Zero0Strategy

    class Probe(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, b: Any, batch_idx: int) -> torch.Tensor:
            return self.model(b[0]).float().square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.t = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.t = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.seconds.append(time.perf_counter() - self.t)

    clock = Clock()
    lightning_log = logging.getLogger("lightning.pytorch")  # its info lines are the probe's, not the user's job's
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)
    try:
        with lightning_world(device, port) as world:
            data = TensorDataset(batch.detach().cpu().repeat((warmup + steps) * world, *([1] * (batch.dim() - 1))))
            trainer = pl.Trainer(accelerator=device.type, devices=world, strategy=Zero0Strategy(),
                                 max_steps=warmup + steps, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                 limit_val_batches=0, callbacks=[clock])
            trainer.fit(Probe(), DataLoader(data, batch_size=batch.shape[0]))
    finally:
        lightning_log.setLevel(level)
    timed = sorted(clock.seconds[warmup:])
    return timed[len(timed) // 2]
