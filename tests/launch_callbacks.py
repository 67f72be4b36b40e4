"""Callbacks that the launch tests (tests/app/test_launch.py) add to real jobs through Hydra
(``+callbacks.kill._target_=tests.launch_callbacks.KillAt``): failures injected at a chosen optimizer step."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import lightning as L


class KillAt(L.Callback):
    """SIGKILL this process once, on rank ``rank``, when a training batch starts at optimizer step ``step`` (so the
    checkpoint of the step before is on disk). ``marker`` (a folder) remembers which kills happened, across restarts:
    ``kill-<step>`` holds the time of the kill; ``resumed-<n>`` the time the n-th restart started training."""

    def __init__(self, steps: list[int], marker: str, rank: int = 1) -> None:
        self.steps, self.marker, self.rank = list(steps), Path(marker), rank

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart and trainer.global_rank == 0:
            (self.marker / f"resumed-{restart}").write_text(f"{time.time()} {trainer.global_step}")

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        step = trainer.global_step
        done = self.marker / f"kill-{step}"
        if trainer.global_rank == self.rank and step in self.steps and not done.exists():
            self.marker.mkdir(parents=True, exist_ok=True)
            done.write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


class SignalAt(L.Callback):
    """Send ``signum`` (SLURM's warning signal, SIGUSR1) to this process when a training batch starts at optimizer
    step ``step`` on rank ``rank``, once (``marker`` file): what ``sbatch --signal=USR1@90`` does before the limit."""

    def __init__(self, step: int, marker: str, rank: int = 0, signum: int = int(signal.SIGUSR1)) -> None:
        self.step, self.marker, self.rank, self.signum = step, Path(marker), rank, signum

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step and not self.marker.exists():
            self.marker.write_text(str(time.time()))
            os.kill(os.getpid(), self.signum)
