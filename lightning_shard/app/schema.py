"""Structured-config schemas: the keys and types every config group may hold.

Plain dataclasses (no Hydra import here, DESIGN §3); ``lightning_shard.train`` stores them in Hydra's
ConfigStore under ``schema/<group>/<name>`` and the YAML files (or ``conf/train.yaml`` for groups whose files
belong to someone else, e.g. ``conf/topology``) list them first in their defaults, so a typo or a wrong type
fails at composition time with the full key. Value *choices* (``accumulation`` per stage, ``start_method`` ...)
are checked by :mod:`lightning_shard.app.checks`, which reads them from the strategy classes themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


# ------------------------------------------------------------------------------------------ strategy/
@dataclass
class ZeroStrategyConf:
    """zero0 / zero1 / zero2 (and zero2_hybrid): knobs of ``lightning_shard.strategies.ZeroStrategy``."""

    _target_: str = "lightning_shard.strategies.Zero2Strategy"
    accumulation: str = "auto"
    bucket_mb: float = 25.0
    reduce_dtype: Optional[str] = None
    overlap: bool = True
    broadcast_buffers: bool = True
    start_method: str = "popen"
    process_group_backend: Optional[str] = None
    timeout_s: float = 1800.0
    startup_timeout_s: float = 1800.0
    allow_custom_optimizer: bool = False
    find_unused_parameters: bool = True
    shard_size: Any = None  # None | positive int | "auto"
    topology: Optional[str] = None
    strict_placement: bool = False
    optim_chunk_mb: float = 4.0
    overlap_param_gather: bool = True
    state_dict_type: str = "sharded"  # sharded | full
    skip_nonfinite: Optional[bool] = None
    debug_collectives: bool = False


@dataclass
class Zero3StrategyConf(ZeroStrategyConf):
    """zero3 (and zero3_hybrid): ZeroStrategy's knobs plus parameter sharding per module."""

    _target_: str = "lightning_shard.strategies.Zero3Strategy"
    reshard_after_forward: bool = True
    prefetch_depth: int = 1
    param_init_fn: Any = None
    leaf_modules: Any = None  # None | list of class names or module FQNs


@dataclass
class FSDPShardStrategyConf(Zero3StrategyConf):
    """fsdp_shard (and fsdp_shard_hybrid): units chosen by a wrap policy."""

    _target_: str = "lightning_shard.strategies.FSDPShardStrategy"
    wrap_classes: Any = "auto"  # "auto" | list of class names
    min_params: Optional[int] = None


@dataclass
class AutoStrategyConf(FSDPShardStrategyConf):
    """strategy=auto: the planner picks the strategy, policy and layout at setup."""

    _target_: str = "lightning_shard.strategies.AutoStrategy"
    topology: Optional[str] = "detect"
    global_batch_size: Optional[int] = None
    micro_batch_size: Optional[int] = None


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
    """A recipe: model + data + batch, and what it is for (DESIGN rule 7)."""

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
