"""Resuming and the last checkpoint of the app: ``ckpt_path=last|<run folder>|<file>`` and
``<run folder>/checkpoints/last.ckpt`` holding the final step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

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


def resolve_ckpt_path(cfg: DictConfig) -> Optional[str]:
    """``ckpt_path``: null (start fresh), ``last`` (the newest ``checkpoints/last.ckpt`` among the earlier runs
    of this recipe x strategy x topology, i.e. the sibling folders of this run's folder), a run folder, or a
    checkpoint path. Raises :class:`ConfigError` when there is nothing to resume from."""
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
        found = sorted((p for p in here.parent.glob(f"*/{CKPT_DIR}/{LAST}") if p.parents[1] != here),
                       key=lambda p: p.parents[1].name)
        if not found:
            raise ConfigError(f"ckpt_path=last: no earlier run of this combination has {CKPT_DIR}/{LAST} under "
                              f"{here.parent}/; run once without ckpt_path (callbacks=default writes it), or "
                              f"give a path: ckpt_path=<run folder or .ckpt>")
        return str(found[-1])
    path = Path(value)
    if path.is_dir() and (path / CKPT_DIR / LAST).exists():  # a run folder
        return str(path / CKPT_DIR / LAST)
    if not path.exists():
        raise ConfigError(f"ckpt_path={value}: no such checkpoint or run folder")
    return str(path)


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
