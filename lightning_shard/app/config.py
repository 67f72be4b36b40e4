"""The config side of ``python -m lightning_shard.train``: Hydra registration (schemas, the ``ls.topo``
resolver), the checks run before any rank starts, and the builders of the Trainer's keywords, callbacks and
loggers from the composed config."""

from __future__ import annotations

import difflib
import inspect
import os
from typing import Any, Optional

import lightning as L
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from omegaconf import DictConfig, OmegaConf

from .checks import ConfigError, check_all, did_you_mean
from .job import run_name
from .launch import topology_fact
from .resume import CKPT_DIR, resolve_ckpt_path
from .schema import SCHEMAS

REQUIRED_KEYS = (
    "seed", "threads_per_rank", "val_every_n_steps",
    "strategy._target_",
    "recipe.name", "recipe.global_batch_size", "recipe.micro_batch_size",
    "recipe.data._target_", "recipe.model._target_",
    "trainer.accelerator", "trainer.devices", "trainer.num_nodes", "trainer.max_steps",
)
# Trainer kwargs that train.py sets itself; a trainer config that sets them would type things twice.
_OWNED_TRAINER_KEYS = ("strategy", "accumulate_grad_batches", "callbacks", "logger")
_CHECKED_SECTIONS = ("strategy", "recipe", "trainer", "topology")


def _topo_resolver(fact: str, *, _root_: DictConfig) -> Any:
    node = OmegaConf.to_container(_root_.topology, resolve=True)
    try:
        return topology_fact(node, fact)
    except ValueError as err:  # a topology key's value: named as such, not as the trainer key interpolating it
        raise ConfigError(str(err)) from err


def register() -> None:
    """Store the schemas in Hydra's ConfigStore and register the ``ls.topo`` and ``ls.run_name`` resolvers
    (idempotent)."""
    cs = ConfigStore.instance()
    for group, nodes in SCHEMAS.items():
        for name, node in nodes.items():
            cs.store(group=group, name=name, node=node, provider="lightning_shard")
    OmegaConf.register_new_resolver("ls.topo", _topo_resolver, replace=True)
    OmegaConf.register_new_resolver("ls.run_name", run_name, replace=True)


register()


def check_config(cfg: DictConfig) -> int:
    """Validate ``cfg`` before any process starts; return the derived ``accumulate_grad_batches``."""
    missing = [k for k in REQUIRED_KEYS if OmegaConf.select(cfg, k, default=None) is None]
    if missing:
        raise ConfigError(f"config is missing required keys {missing}; set them in a config or on the command "
                          f"line, e.g. {missing[0]}=...")
    owned = [k for k in _OWNED_TRAINER_KEYS if k in cfg.trainer]
    if owned:
        raise ConfigError(owned_key_message(owned[0]))
    accepted = trainer_keywords()
    unknown = [str(k) for k in cfg.trainer if k not in accepted]
    if unknown:
        raise ConfigError(f"trainer.{unknown[0]}: not a keyword of lightning.Trainer"
                          f"{did_you_mean(unknown[0], sorted(accepted))}; nothing was started")
    if cfg.get("ckpt_path") != "last":  # a path must exist; "last" is looked up (or warned about) by fit
        resolve_ckpt_path(cfg)
    for key in map(str, cfg.strategy):  # a group's field added flat (+strategy.bucket_mb=5): where it lives
        value = OmegaConf.select(cfg.strategy, key, default=None, throw_on_resolution_failure=False)
        text = str(value).lower() if isinstance(value, bool) else None if value is None else str(value)
        moved = grouped_key_hint(cfg.strategy, "strategy", key, text, close=False)
        if moved:
            raise ConfigError(f"strategy.{key}: not an option of {cfg.strategy._target_}; {moved}")
    plain = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in _CHECKED_SECTIONS}
    islands = topology_fact(plain["topology"], "islands_per_node")
    return check_all(plain, islands)


def grouped_key_hint(node: Any, parent: str, leaf: str, value: Optional[str] = None,
                     close: bool = True) -> Optional[str]:
    """Where a key given flat lives when a group of ``node`` holds it (the strategies' options are grouped:
    ``strategy.bucket_mb`` is ``strategy.tuning.bucket_mb``), or (``close``) its close match among the groups'
    fields (``strategy.bucket_mbb``); None when no group of ``node`` has such a field."""
    if not isinstance(node, DictConfig):
        return None
    groups = {str(k): [str(f) for f in child.keys()] for k, child in node.items_ex(resolve=False)
              if isinstance(child, DictConfig) and k != "hydra"}
    prefix = f"{parent}." if parent else ""
    for group, fields in groups.items():
        if leaf in fields:
            return (f"{leaf} is an option of the {group} group: {prefix}{group}.{leaf}={value if value else '...'}"
                    f" (YAML: {group}: {{{leaf}: ...}})")
    dotted = [f"{group}.{f}" for group, fields in groups.items() for f in fields]
    match = difflib.get_close_matches(leaf, [d.split(".", 1)[1] for d in dotted], n=1) if close else []
    if match:
        where = next(d for d in dotted if d.split(".", 1)[1] == match[0])
        return f"did you mean {prefix}{where}? (an option of the {where.split('.')[0]} group)"
    return None


def owned_key_message(key: str) -> str:
    """Why ``trainer.<key>`` may not be set, and what to set instead."""
    if key == "accumulate_grad_batches":
        return ("trainer.accumulate_grad_batches is derived, not set: recipe.global_batch_size / "
                "(recipe.micro_batch_size x world size); change recipe.global_batch_size or "
                "recipe.micro_batch_size instead (the world size comes from the topology)")
    instead = {"strategy": "strategy=<name> (conf/strategy/)", "callbacks": "callbacks=<name> (conf/callbacks/)",
               "logger": "logger=<name> (conf/logger/)"}[key]
    return f"trainer.{key} is set by lightning_shard.train, not by the trainer config; use {instead}"


def trainer_keywords() -> set[str]:
    return set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}


def build_trainer_kwargs(cfg: DictConfig, accumulate: int) -> dict[str, Any]:
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.trainer, resolve=True).items() if v is not None
              or k in ("val_check_interval", "check_val_every_n_epoch")}
    if kwargs.get("val_check_interval") is None:
        kwargs["val_check_interval"] = int(cfg.val_every_n_steps) * accumulate
    kwargs["accumulate_grad_batches"] = accumulate
    return kwargs


def build_callbacks(cfg: DictConfig, run_dir: Optional[str] = None) -> list[Any]:
    """The ``callbacks`` group's callbacks; a ``ModelCheckpoint`` without ``dirpath`` writes to
    ``<run_dir>/checkpoints``. Callbacks the trainer config switches off (progress bar, checkpointing) are left out."""
    out = []
    for node in (cfg.get("callbacks") or {}).values():
        if node is None:
            continue
        cb = instantiate(node, _convert_="all")
        if isinstance(cb, ProgressBar) and not cfg.trainer.enable_progress_bar:
            continue  # Lightning refuses a progress-bar callback with enable_progress_bar=False
        if isinstance(cb, ModelCheckpoint):
            if not cfg.trainer.enable_checkpointing:
                continue  # and a checkpoint callback with enable_checkpointing=False
            if cb.dirpath is None and run_dir is not None:
                cb.dirpath = os.path.join(run_dir, CKPT_DIR)
        out.append(cb)
    return out


def build_loggers(cfg: DictConfig) -> list[Any]:
    return [instantiate(node, _convert_="all") for node in (cfg.get("logger") or {}).values() if node is not None]
