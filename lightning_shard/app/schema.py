"""Structured-config schemas: the keys and types every config group may hold.

Plain dataclasses (no Hydra import here, "Design rules" 1); ``lightning_shard.train`` stores them in Hydra's
ConfigStore under ``schema/<group>/<name>`` and the YAML files (or ``conf/train.yaml`` for groups whose files
belong to someone else, e.g. ``conf/topology``) list them first in their defaults, so a typo or a wrong type
fails at composition time with the full key. The strategy schemas are generated from the options dataclasses
(``lightning_shard/options``; a group is a nested node, ``strategy.tuning.bucket_mb``), so
``conf/strategy/*.yaml`` hold only what differs from the defaults.
Value *choices* (``accumulation`` per stage, ``start_method`` ...) are checked by
:mod:`lightning_shard.app.checks`, which reads them from the same dataclasses.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_shard.options import AutoOptions, FSDPOptions, Zero3Options, ZeroOptions

# ------------------------------------------------------------------------------------------ strategy/
_OMEGACONF_TYPES = (str, int, float, bool)


def _omegaconf_type(hint: Any) -> Any:
    """The field type OmegaConf can hold: ``str``/``int``/``float``/``bool``, optionally ``Optional``; else Any."""
    if hint in _OMEGACONF_TYPES:
        return hint
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and len(args) == 2 and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        if inner in _OMEGACONF_TYPES:
            return Optional[inner]
    return Any


def _fields(options: type) -> list[tuple[str, Any, Any]]:
    """The Hydra keys of an options dataclass: each with an OmegaConf-compatible type and its default; a group as a
    nested schema of its own fields."""
    hints = typing.get_type_hints(options)
    out: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(options):
        if not f.metadata.get("hydra", True):
            continue
        if "group" in f.metadata:
            group = f.metadata["group"]
            nested = dataclasses.make_dataclass(f"{group.__name__}Conf", _fields(group))
            nested.__module__ = __name__
            out.append((f.name, nested, field(default_factory=nested)))
        else:
            out.append((f.name, _omegaconf_type(hints[f.name]), field(default=f.default)))
    return out


def strategy_schema(name: str, options: type, target: str, doc: str) -> type:
    """The structured-config schema of a strategy's options dataclass: ``_target_`` plus every option that is a
    Hydra key, with its default and an OmegaConf-compatible type (the options: ``lightning_shard/options``)."""
    schema = dataclasses.make_dataclass(name, [("_target_", str, field(default=target)), *_fields(options)])
    schema.__doc__, schema.__module__ = doc, __name__
    return schema


ZeroStrategyConf = strategy_schema("ZeroStrategyConf", ZeroOptions, "lightning_shard.strategies.Zero2Strategy",
                                   "zero0 / zero1 / zero2 (and zero2_hybrid): ZeroOptions.")
Zero3StrategyConf = strategy_schema("Zero3StrategyConf", Zero3Options, "lightning_shard.strategies.Zero3Strategy",
                                    "zero3 (and zero3_hybrid): ZeroOptions plus parameter sharding per module.")
FSDPShardStrategyConf = strategy_schema("FSDPShardStrategyConf", FSDPOptions,
                                        "lightning_shard.strategies.FSDPShardStrategy",
                                        "fsdp_shard (and fsdp_shard_hybrid): units chosen by a wrap policy.")
AutoStrategyConf = strategy_schema("AutoStrategyConf", AutoOptions, "lightning_shard.strategies.AutoStrategy",
                                   "strategy=auto: the planner picks the strategy, policy and layout at setup.")


@dataclass
class DDPStrategyConf:
    """Lightning's own DDPStrategy: the external reference."""

    _target_: str = "lightning.pytorch.strategies.DDPStrategy"
    start_method: str = "popen"
    find_unused_parameters: bool = False
    process_group_backend: Optional[str] = None


# ------------------------------------------------------------------------------------------ topology/
@dataclass
class TopologyConf:
    """A topology preset (``conf/topology/*.yaml``, read by ``lightning_shard.topology.presets``)."""

    name: str = "cpu"
    description: Optional[str] = None
    devices: Optional[int] = None
    kind: Optional[str] = None  # "cpu" | None (GPU)
    model: Optional[str] = None
    nvlink_gen: Optional[int] = None
    pcie_gen: Optional[int] = None
    expect_nvlink: Optional[bool] = None
    numa: Optional[list[Any]] = None
    uniform: Optional[str] = None
    matrix: Optional[list[str]] = None
    nodes: Optional[int] = None
    network: Optional[str] = None
    nics_per_node: Optional[int] = None
    base: Optional[str] = None


# ------------------------------------------------------------------------------------------ recipe/
@dataclass
class RecipeConf:
    """A recipe: model + data + batch, and what it is for ("Design rules" 12)."""

    name: str = "?"
    hardware: str = "?"  # what the recipe targets
    expected: str = "?"  # the result it should reach there
    global_batch_size: int = 32  # samples per optimizer step, all ranks together
    micro_batch_size: int = 8  # samples per rank per forward/backward
    max_steps: int = 300  # optimizer steps (trainer.max_steps interpolates it)
    val_every_n_steps: int = 100  # optimizer steps between validations
    data: dict[str, Any] = field(default_factory=dict)  # _target_ + DataModule keywords
    model: dict[str, Any] = field(default_factory=dict)  # _target_ + LightningModule keywords


# ------------------------------------------------------------------------------------------ trainer/
@dataclass
class TrainerConf:
    """``lightning.Trainer`` keywords train.py passes through (strategy, logger, callbacks and
    accumulate_grad_batches are train.py's own; devices/num_nodes/accelerator come from the topology)."""

    accelerator: str = "cpu"
    devices: int = 2
    num_nodes: int = 1
    max_steps: int = 300
    max_epochs: Optional[int] = None
    val_check_interval: Optional[Any] = None
    check_val_every_n_epoch: Optional[int] = None
    limit_train_batches: Optional[Any] = None
    limit_val_batches: Optional[Any] = 1.0
    num_sanity_val_steps: int = 0
    log_every_n_steps: int = 10
    precision: str = "32-true"
    gradient_clip_val: Optional[float] = None
    deterministic: Optional[Any] = None
    enable_checkpointing: bool = False
    enable_progress_bar: bool = True
    enable_model_summary: bool = True


SCHEMAS: dict[str, dict[str, type]] = {
    "schema/strategy": {"zero": ZeroStrategyConf, "zero3": Zero3StrategyConf, "fsdp_shard": FSDPShardStrategyConf,
                        "auto": AutoStrategyConf, "ddp": DDPStrategyConf},
    "schema/topology": {"preset": TopologyConf},
    "schema/recipe": {"recipe": RecipeConf},
    "schema/trainer": {"trainer": TrainerConf},
}


def schema_fields(cls: type) -> list[str]:
    return list(cls.__dataclass_fields__)
