"""``SlurmRequeue``: save at a step boundary and requeue when SLURM warns that the job's time is ending.

``sbatch --signal=USR1@90`` (``#SBATCH --signal=USR1@90``) sends SIGUSR1 to every task 90 s before the time limit.
Lightning's own answer (``SLURMEnvironment(auto_requeue=True)``) saves ``hpc_ckpt_N.ckpt`` inside the signal
handler, wherever each rank happens to be: with sharded strategies, whose save is collective, one rank may be inside
a gradient reduction while another starts saving. This callback does it at a point every rank shares instead:

1. the handler only notes the signal (on whichever ranks got it);
2. after each optimizer step the ranks agree whether any of them got it (one all-reduce of one number per step,
   recorded in the ledger; only while this callback is installed);
3. if so, every rank saves ``last.ckpt`` (the run's ``ModelCheckpoint`` folder, or ``path``), rank 0 asks SLURM to
   requeue the job (``scontrol requeue $SLURM_JOB_ID``), and training stops cleanly (exit status 0).

The requeued job runs the same command; with ``ckpt_path=last`` (the Hydra app, whose run folder is named by the job
id) it resumes from that checkpoint. ``python -m lightning_shard.train`` installs this callback by itself under SLURM
and turns Lightning's handler off; with your own Trainer pass
``Trainer(callbacks=[SlurmRequeue()], plugins=[SLURMEnvironment(auto_requeue=False)])``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any, Mapping, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn


def slurm_job_id(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """What ``scontrol requeue`` takes: ``<array job>_<task>`` for an array task, else ``SLURM_JOB_ID``."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


class SlurmRequeue(Callback):
    """Save at the next optimizer step and requeue the SLURM job after ``signum`` (see the module's docstring).

    Args:
        signum: the signal SLURM sends before the time limit (``--signal=USR1@<seconds>``).
        path: where to save; None: ``last.ckpt`` in the Trainer's ``ModelCheckpoint`` folder.
        requeue: run ``scontrol requeue`` (False: only save and stop).
    """

    def __init__(self, signum: int = int(signal.SIGUSR1), path: Optional[str] = None, requeue: bool = True) -> None:
        self.signum, self.path, self.requeue = int(signum), path, requeue
        self.signalled = False
        self.saved: Optional[str] = None  # the checkpoint written on the signal, once it is
        self._step = -1

    def _note(self, signum: int, frame: Any) -> None:
        self.signalled = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        signal.signal(self.signum, self._note)  # after Lightning's own handlers are registered
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self._step:
            return  # inside an accumulation window: no step yet
        self._step = trainer.global_step
        flag = torch.tensor(float(self.signalled), device=trainer.strategy.root_device)
        if float(trainer.strategy.reduce(flag, reduce_op="max")) == 0.0:
            return
        self.saved = self._target(trainer)
        trainer.save_checkpoint(self.saved)  # collective: every rank is here, at the same step
        ckpt = trainer.checkpoint_callback
        if isinstance(ckpt, ModelCheckpoint):
            ckpt._last_global_step_saved = trainer.global_step  # so that no callback saves this step again
        rank_zero_info(f"lightning_shard: signal {signal.Signals(self.signum).name}: saved step {trainer.global_step} "
                       f"to {self.saved}")
        if self.requeue and trainer.is_global_zero:
            self._requeue()
        trainer.should_stop = True

    def _target(self, trainer: pl.Trainer) -> str:
        if self.path is not None:
            return self.path
        ckpt = trainer.checkpoint_callback
        if isinstance(ckpt, ModelCheckpoint) and ckpt.dirpath is not None:
            return os.path.join(ckpt.dirpath, ModelCheckpoint.CHECKPOINT_NAME_LAST + ckpt.FILE_EXTENSION)
        return os.path.join(trainer.default_root_dir, "last.ckpt")

    def _requeue(self) -> None:
        job = slurm_job_id()
        if job is None:
            rank_zero_warn("SlurmRequeue: no SLURM_JOB_ID: saved, not requeued")
            return
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if done.returncode == 0:
            rank_zero_info(f"lightning_shard: requeued SLURM job {job}")
        else:
            rank_zero_warn(f"SlurmRequeue: `scontrol requeue {job}` failed ({done.returncode}): {done.stderr.strip()}")
