"""Resuming and the last checkpoint of the app: ``ckpt_path=last|<run folder>|<file>`` and
``<run folder>/checkpoints/last.ckpt`` holding the final step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from omegaconf import DictConfig, OmegaConf

from lightning_shard.checkpoint.dcp import DCP_METADATA, is_dcp_checkpoint
from lightning_shard.checkpoint.format import META, is_sharded_checkpoint

from .checks import ConfigError

CKPT_DIR, LAST = "checkpoints", "last.ckpt"


def _run_dir(cfg: DictConfig) -> Optional[Path]:
    if OmegaConf.select(cfg, "hydra", default=None) is not None:  # the preflight's composed config
        hc = HydraConfig.instance()  # resolve ${hydra:...} in hydra.run.dir against this config
        previous, _ = hc.cfg, hc.set_config(cfg)
        try:
            return Path(OmegaConf.select(cfg, "hydra.run.dir"))
        finally:
            hc.cfg = previous
    if HydraConfig.initialized():  # inside the job
        return Path(HydraConfig.get().runtime.output_dir)
    return None


def _complete(ckpt: Path) -> bool:
    """A checkpoint that was written to the end: a sharded or DCP directory has its index (written last, atomically:
    a rank that died while saving leaves only a ``.tmp-`` folder or the previous version), a file is a file."""
    if ckpt.is_dir():
        return is_sharded_checkpoint(ckpt) or is_dcp_checkpoint(ckpt)
    return ckpt.is_file()


def _written_at(ckpt: Path) -> float:
    marker = next((m for m in (ckpt / META, ckpt / DCP_METADATA) if m.is_file()), ckpt) if ckpt.is_dir() else ckpt
    return marker.stat().st_mtime


def last_checkpoint(here: Path) -> Optional[Path]:
    """The newest complete ``checkpoints/last.ckpt`` of this run folder (a restarted or requeued job) and of the
    earlier runs of the same recipe x strategy x topology (its sibling folders); None when there is none."""
    found = [p for p in here.parent.glob(f"*/{CKPT_DIR}/{LAST}") if _complete(p)]
    return max(found, key=_written_at, default=None)


def resolve_ckpt_path(cfg: DictConfig) -> Optional[str]:
    """``ckpt_path``: null (start fresh), ``last`` (:func:`last_checkpoint`; with none, a warning and a fresh start,
    so one command line serves a job's first start and every restart, as Lightning's ``fit(ckpt_path="last")``), a
    run folder, or a checkpoint path. Raises :class:`ConfigError` for a path that does not exist."""
    value = cfg.get("ckpt_path")
    if value in (None, ""):
        return None
    value = str(value)
    if value == "last":
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            raise ConfigError("ckpt_path=last is for single runs; in a -m sweep give each job a path")
        here = _run_dir(cfg)
        if here is None:
            raise ConfigError("ckpt_path=last needs a Hydra run folder; give a checkpoint path instead")
        found = last_checkpoint(here)
        if found is None:
            rank_zero_warn(f"ckpt_path=last: no complete {CKPT_DIR}/{LAST} in this run's folder or an earlier run's "
                           f"under {here.parent}/: starting from scratch")
            return None
        return str(found)
    path = Path(value)
    if path.is_dir() and (path / CKPT_DIR / LAST).exists():  # a run folder
        return str(path / CKPT_DIR / LAST)
    if not path.exists():
        raise ConfigError(f"ckpt_path={value}: no such checkpoint or run folder")
    return str(path)


class ResumeReport(L.Callback):
    """Says, once training starts, from which optimizer step a run resumed (``ckpt_path``)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.ckpt_path:
            rank_zero_info(f"lightning_shard.train: resumed at optimizer step {trainer.global_step} (epoch "
                           f"{trainer.current_epoch}) from {trainer.ckpt_path}")


class FinalCheckpoint(L.Callback):
    """Makes ``checkpoints/last.ckpt`` hold the final step: Lightning's ``ModelCheckpoint`` saves on its own
    schedule (``every_n_train_steps``), so a run whose last step is not on it would resume from an older one.
    Saved in ``on_train_end``, while the strategy still holds its shards (sharded format)."""

    def __init__(self) -> None:
        self.path: Optional[str] = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cb = trainer.checkpoint_callback
        if cb is None or not getattr(cb, "save_last", False) or cb.dirpath is None:
            return
        self.path = os.path.join(cb.dirpath, LAST)
        if getattr(cb, "_last_global_step_saved", None) != trainer.global_step or not os.path.exists(self.path):
            trainer.save_checkpoint(self.path)  # collective: every rank runs this hook
