"""Running a composed config: one fit (summary, checkpoint, next steps) and a sweep job in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback as HydraCallback
from hydra.utils import instantiate
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import DictConfig

from lightning_shard.callbacks import CommSummary
from lightning_shard.requeue import SlurmRequeue

from .config import build_callbacks, build_loggers, build_trainer_kwargs
from .report import NO_PLOT, write_report, write_summary
from .resume import FinalCheckpoint, ResumeReport, resolve_ckpt_path
from .summary import _choices, full_summary, log_to_run_files, print_next_steps, print_summary


def fit(cfg: DictConfig, accumulate: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    log_to_run_files()
    threads = int(cfg.threads_per_rank)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # also stops Lightning's launchers from resetting threads
    torch.set_num_threads(threads)
    L.seed_everything(cfg.seed, workers=True)

    strategy = instantiate(cfg.strategy, _convert_="all")
    datamodule = instantiate(cfg.recipe.data, micro_batch_size=cfg.recipe.micro_batch_size, seed=cfg.seed,
                             _convert_="all")
    module = instantiate(cfg.recipe.model, _convert_="all")

    comm = CommSummary()
    loggers = build_loggers(cfg)
    out_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else os.getcwd()
    ckpt_path = resolve_ckpt_path(cfg)
    final = FinalCheckpoint()
    # under SLURM: save at a step boundary and requeue on SIGUSR1 (requeue.py) instead of Lightning's handler
    requeue = [SlurmRequeue()] if SLURMEnvironment.detect() else []
    plugins = [SLURMEnvironment(auto_requeue=False)] if requeue else None
    trainer = L.Trainer(strategy=strategy, callbacks=[comm, *build_callbacks(cfg, out_dir), final, ResumeReport(),
                                                      *requeue],
                        plugins=plugins, logger=loggers or False, **build_trainer_kwargs(cfg, accumulate))
    if ckpt_path is not None:
        rank_zero_info(f"lightning_shard.train: resuming from {ckpt_path}")
    choices = _choices()
    if isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher):
        # fork/spawn: fit runs in worker processes and this process gets none of the figures back, so
        # rank 0's worker prints the table at the end of fit (no extra final validation in this mode).
        def report(_: dict) -> None:
            s = full_summary(comm, trainer, module, cfg, choices, time.perf_counter() - t0)
            print_summary(s)
            write_summary(out_dir, s)

        comm.on_fit_end_fn = report
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        return {}
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    last_ckpt = final.path
    last_val_step = comm.val_losses[-1][0] if comm.val_losses else None
    stopped_for_requeue = any(r.saved for r in requeue)  # the time limit is near: no extra validation
    if cfg.final_validation and last_val_step != trainer.global_step and not stopped_for_requeue:
        trainer.validate(module, datamodule=datamodule, verbose=False)

    summary = full_summary(comm, trainer, module, cfg, choices, time.perf_counter() - t0)
    summary["checkpoint"] = last_ckpt
    summary["resumed_from"] = ckpt_path
    if trainer.is_global_zero:
        print_summary(summary)
        write_summary(out_dir, summary)
        print_next_steps(out_dir, last_ckpt, module)
    return summary


def run_isolated() -> dict[str, Any]:
    """One job of a ``-m`` sweep, in a fresh process: the job's own overrides, the job's folder as run dir."""
    hc = HydraConfig.get()
    out = hc.runtime.output_dir
    cmd = [sys.executable, "-m", "lightning_shard.train", *hc.overrides.task, f"hydra.run.dir={out}",
           "hydra.output_subdir=null", "hydra.job.name=run"]
    env = {**os.environ, "LIGHTNING_SHARD_PREFLIGHT": "0"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT"):  # a fresh launch for every job
        env.pop(key, None)
    rc = subprocess.call(cmd, env=env, cwd=hc.runtime.cwd)
    if rc != 0:
        raise RuntimeError(f"sweep job {hc.job.num} ({' '.join(hc.overrides.task)}) failed with exit status {rc}; "
                           f"logs in {out}")
    return {"output_dir": out}


class SweepReport(HydraCallback):
    """Writes ``report.md`` and ``report.png`` in the sweep folder when a ``-m`` run ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        paths = write_report(config.hydra.sweep.dir)
        if paths is not None:
            print(f"sweep report: {paths[0]}" + (f" and {paths[1]}" if paths[1] else f" ({NO_PLOT})"))
