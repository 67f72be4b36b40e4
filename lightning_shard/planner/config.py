"""What the planner is asked about: a strategy configuration and a job (world, batch, precision).

``StrategyConfig`` is one planned row: the registered strategy and the options the planner varies (their defaults,
choices and rules are the options', ``lightning_shard/options``), plus how the backend runs its reduce-scatter
(``reduce_scatter_via``: a property of the machine planned for, not an option). ``kwargs()`` gives what
``Trainer(strategy=Registered(**kwargs))`` takes, groups as mappings; ``options()`` the validated options
themselves. tests/planner/test_planner_advice.py builds every planned row with the real classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from ..options import MIN_UNIT_MB, POLICIES, PREFETCH_DEPTH, REGISTERED, Compression, Tuning, ZeroOptions, options_for

PRECISIONS = {  # Trainer(precision=...) -> (parameter dtype, activation bytes, loss scaling)
    "32-true": (torch.float32, 4, False),
    "bf16-mixed": (torch.float32, 2, False),
    "16-mixed": (torch.float32, 2, True),
    "bf16-true": (torch.bfloat16, 2, False),
    "16-true": (torch.float16, 2, True),
}
STAGE_OF = {name: stage for name, (_, stage) in REGISTERED.items()}  # registered name -> ZeRO stage
HYBRID_NAMES = ("zero2", "zero3", "fsdp_shard")  # those with a registered <name>_hybrid (conf/strategy too)


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {sorted(PRECISIONS)} (Trainer(precision=...))")


@dataclass(frozen=True)
class StrategyConfig:
    strategy: str  # registered name: zero0 | zero1 | zero2 | zero3 | fsdp_shard
    stage: int
    policy: Optional[str] = None  # None: the deferring policy ("defer", at stage 3 "keep_unsharded_grads")
    reshard_after_forward: bool = True
    shard_size: Optional[int] = None  # hybrid: ranks per shard group (None: shard over the world)
    wrap_classes: Any = None  # fsdp_shard
    min_params: Optional[int] = None
    min_unit_mb: float = MIN_UNIT_MB  # zero3: smaller units join the unit enclosing them
    bucket_mb: float = Tuning.bucket_mb
    prefetch_depth: Optional[int] = None  # None: the strategy's default (options.PREFETCH_DEPTH)
    reduce_dtype: Optional[torch.dtype] = None  # None: fp32 for half-precision gradients (the engine's default)
    overlap_param_gather: bool = Tuning.overlap_param_gather  # zero1/2: post-step all-gather waited in the next forward
    offload_optimizer: bool = False  # ZeRO-Offload: master shard, its gradient and the optimizer state in host memory
    offload_params: bool = False  # stage 3, with offload_optimizer: the parameter shards in host memory too
    # how the backend reduce-scatters gradients (the engine's per-backend choice, not an option): "reduce_scatter"
    # (NCCL, the accelerators planned for), "all_to_all" (gloo: the reduce-scatter's bytes, a second full-size
    # buffer in flight but on 2 ranks) or "all_reduce" (the bucket all-reduced, twice the bytes)
    reduce_scatter_via: str = "reduce_scatter"
    # compressed communication (comm/quant.py): block-quantized stage-3 parameter gathers / gradient reductions (an
    # all-to-all of quantized pieces, with an fp32 error-feedback residual per trainable element)
    gather_quant: str = "none"
    reduce_quant: str = "none"
    quant_block: int = Compression.block
    quant_error_feedback: bool = Compression.error_feedback
    secondary_shard: Optional[int] = None  # hpZ: ranks per island holding the secondary copies (None: off)

    def __post_init__(self) -> None:
        if STAGE_OF.get(self.strategy) != self.stage:
            raise ValueError(f"strategy {self.strategy!r} with stage {self.stage}: the planner knows "
                             + ", ".join(f"{k} (stage {v})" for k, v in STAGE_OF.items()))
        if self.policy is None:
            object.__setattr__(self, "policy", "keep_unsharded_grads" if self.stage == 3 else "defer")
        if self.prefetch_depth is None:
            object.__setattr__(self, "prefetch_depth",
                               PREFETCH_DEPTH["fsdp" if self.strategy.startswith("fsdp") else "zero3"])
        if self.policy not in POLICIES[self.stage]:
            hint = "; stage 3 calls deferring 'keep_unsharded_grads'" if self.policy == "defer" else ""
            raise ValueError(f"accumulation policy {self.policy!r} does not exist for {self.strategy} (stage "
                             f"{self.stage}): use one of {POLICIES[self.stage]}{hint}")
        if self.offload_params and not (self.stage == 3 and self.offload_optimizer):
            raise ValueError("offload_params needs stage 3 and offload_optimizer=True")
        if self.reduce_scatter_via not in ("reduce_scatter", "all_reduce", "all_to_all"):
            raise ValueError(f"reduce_scatter_via must be 'reduce_scatter', 'all_reduce' or 'all_to_all' (the planner "
                             f"plans one backend: 'auto' is one of them), got {self.reduce_scatter_via!r}")
        Compression(reduce_dtype=self.reduce_dtype, gather_quant=self.gather_quant, reduce_quant=self.reduce_quant,
                    block=self.quant_block, error_feedback=self.quant_error_feedback).validate(self.stage)
        if self.reduce_quant != "none" and self.reduce_scatter_via == "all_reduce":
            raise ValueError("reduce_quant sends quantized pieces in an all-to-all: it cannot be planned with "
                             "reduce_scatter_via='all_reduce'")
        if self.secondary_shard is not None and (self.stage != 3 or self.shard_size is not None or
                                                 not isinstance(self.secondary_shard, int) or self.secondary_shard < 2):
            raise ValueError(f"secondary_shard={self.secondary_shard!r}: an island size >= 2, for stage 3 without "
                             "shard_size")
        if self.shard_size is not None and self.stage == 0:
            raise ValueError("zero0 replicates everything: a shard_size (hybrid sharding) needs stage 2 or 3")

    @property
    def granularity(self) -> str:
        return "fsdp" if self.strategy.startswith("fsdp") else "zero3"

    @property
    def per_micro_batch(self) -> bool:
        return self.policy == "per_micro_batch"

    @property
    def registered(self) -> str:
        """The registry name (``Trainer(strategy=...)``) and Hydra option (``strategy=...``) of this row."""
        return self.strategy + ("_hybrid" if self.shard_size and self.strategy in HYBRID_NAMES else "")

    @property
    def label(self) -> str:
        name = self.strategy + ("_hybrid" if self.shard_size else "")
        extra = "" if self.stage < 3 or self.reshard_after_forward else ", no reshard"
        extra += ", offload" + (" all" if self.offload_params else "") if self.offload_optimizer else ""
        extra += f", {self.gather_quant} gathers" if self.gather_quant != "none" else ""
        extra += f", {self.reduce_quant} reductions" if self.reduce_quant != "none" else ""
        extra += " without feedback" if self.reduce_quant != "none" and not self.quant_error_feedback else ""
        extra += f", hpZ x{self.secondary_shard}" if self.secondary_shard else ""
        return f"{name} ({self.policy}{extra})"

    def kwargs(self) -> dict[str, Any]:
        """Keywords of the registered strategy class that differ from its defaults, groups as mappings of their
        changed fields (``topology`` is the caller's: ``advice.strategy_kwargs``); ``accumulation`` always."""
        return {"accumulation": self.policy, **self.options().changed()}

    def options(self) -> ZeroOptions:
        """The validated options of this row's registered class."""
        tuning: dict[str, Any] = {}
        if self.stage < 3:
            tuning["bucket_mb"] = self.bucket_mb
        else:
            tuning["reshard_after_forward"] = self.reshard_after_forward
            tuning["prefetch_depth"] = None if self.prefetch_depth == PREFETCH_DEPTH[self.granularity] else \
                self.prefetch_depth
        if self.strategy == "zero3":
            tuning["min_unit_mb"] = self.min_unit_mb
        values: dict[str, Any] = {"accumulation": self.policy, "shard_size": self.shard_size,
                                  "offload_optimizer": self.offload_optimizer, "tuning": tuning,
                                  "compression": {"gather_quant": self.gather_quant, "reduce_quant": self.reduce_quant,
                                                  "block": self.quant_block,
                                                  "error_feedback": self.quant_error_feedback}}
        if self.stage == 3:
            values.update(offload_params=self.offload_params, secondary_shard=self.secondary_shard)
        if self.strategy.startswith("fsdp"):
            values.update(wrap_classes=self.wrap_classes if self.wrap_classes is not None else "auto",
                          min_params=self.min_params)
        return options_for(self.strategy, **values)

    def with_(self, **changes: Any) -> "StrategyConfig":
        return replace(self, **changes)


@dataclass(frozen=True)
class Job:
    world: int
    micro_batch: int = 1  # samples per rank per forward/backward
    accumulation: int = 1  # micro-batches per optimizer step
    seq: int = 1  # tokens per sample (1 for non-sequence models)
    precision: str = "32-true"
    find_unused_parameters: bool = True  # the strategies' default: a used-mask all-reduce per step
    broadcast_buffers: bool = True
    clip: bool = False  # gradient clipping by norm (one 0-dim all-reduce per step)
    optimizer: str = "adam"  # adam | sgd | sgd_momentum: state bytes per element
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_precision(self.precision)

    @property
    def param_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision][0]

    @property
    def act_bytes(self) -> int:
        return PRECISIONS[self.precision][1]

    @property
    def loss_scaling(self) -> bool:
        return PRECISIONS[self.precision][2]

    @property
    def tokens_per_step(self) -> int:
        return self.world * self.micro_batch * self.accumulation * self.seq


def batch_split(global_batch: int, micro_batch: int, world: int) -> int:
    """Accumulation steps from the global batch ("Design rules" 7)."""
    if global_batch < 1 or micro_batch < 1 or world < 1:
        raise ValueError(f"global batch ({global_batch}), micro-batch ({micro_batch}) and world size ({world}) must "
                         "be positive")
    per_pass = micro_batch * world
    if global_batch % per_pass:
        lo = max(per_pass, global_batch // per_pass * per_pass)
        fits = [m for m in range(1, micro_batch + 1) if global_batch % (m * world) == 0]
        raise ValueError(
            f"global batch {global_batch} is not divisible into micro-batches of {micro_batch} on {world} ranks: "
            f"{global_batch} % ({micro_batch} x {world}) = {global_batch % per_pass}. Use a global batch of "
            f"{lo} or {lo + per_pass}" + (f", or a micro-batch of {fits[-1]}" if fits else
                                          f" (the global batch must be a multiple of the world size {world})"))
    return global_batch // per_pass
