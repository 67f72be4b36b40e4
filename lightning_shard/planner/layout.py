"""The engine's flat-buffer layout, predicted without building an engine (no collectives, no copies).

The bucketing rules are the engine's own (:mod:`lightning_shard.engine.buckets.plan`, units from
:func:`..engine.zero3.plan.plan_units`, flat layouts from :func:`lightning_shard.engine.buckets.flat.flat_layout`);
this module only adds the sizes the planner needs: stage 0 keeps one "shard" (no padding), stages 1-3 pad
every bucket to a multiple of the shard group size. Parameters may live on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from ..engine.buckets.flat import flat_layout
from ..engine.buckets.plan import OptimizerGroups, bucketed_trainable, flat_buckets, param_owners, unit_buckets
from ..engine.zero3.plan import plan_units
from ..options import MIN_UNIT_MB, Tuning

__all__ = ["OptimizerGroups", "PlannedBucket", "PlannedLayout", "PlannedUnit", "default_groups", "groups_of",
           "plan_layout"]


@dataclass(frozen=True)
class PlannedBucket:
    index: int
    numel: int  # real elements
    padded_numel: int
    num_shards: int
    dtype: torch.dtype
    trainable: bool  # held by an optimizer (stage 3 also shards frozen parameters)
    opt_index: Optional[int]  # the optimizer (all of its param groups share the bucket); None: frozen
    num_params: int
    unit: Optional[int] = None  # stage 3: index of its unit in plan order

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype, device="meta").element_size()

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards

    def owned_numel(self, shard_rank: int) -> int:
        """Real elements owned by ``shard_rank`` (padding excluded; stage 0 owns the whole bucket)."""
        if self.num_shards == 1:
            return self.numel
        start = shard_rank * self.shard_numel
        return max(0, min(start + self.shard_numel, self.numel) - min(start, self.numel))


@dataclass
class PlannedUnit:
    index: int
    name: str
    is_root: bool
    buckets: list[PlannedBucket] = field(default_factory=list)

    @property
    def full_bytes(self) -> int:
        return sum(b.padded_numel * b.itemsize for b in self.buckets)


@dataclass
class PlannedLayout:
    stage: int
    shard_world: int
    buckets: list[PlannedBucket]  # in the engine's order (reduction launch order)
    units: list[PlannedUnit]  # stage 3 only, plan order (root first)
    frozen_bytes: int  # stages 0-2: parameters outside every bucket (kept whole on every rank)
    frozen_numel: int

    @property
    def trainable(self) -> list[PlannedBucket]:
        return [b for b in self.buckets if b.trainable]


def default_groups(module: nn.Module) -> list[list[list[nn.Parameter]]]:
    """One optimizer, one param group: every trainable parameter (what ``recommend_for`` assumes without one)."""
    return [[[p for p in module.parameters() if p.requires_grad]]]


def groups_of(optimizers: Any) -> list[list[list[nn.Parameter]]]:
    """Accept torch optimizers (or one), or already-nested lists of parameters."""
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    out = []
    for opt in optimizers:
        if isinstance(opt, torch.optim.Optimizer):
            out.append([list(g["params"]) for g in opt.param_groups])
        else:
            out.append([list(g) for g in opt])
    return out


def plan_layout(module: nn.Module, groups: Optional[OptimizerGroups], stage: int, shard_world: int,
                bucket_mb: float = Tuning.bucket_mb, granularity: str = "zero3", wrap_classes: Any = None,
                min_params: Optional[int] = None, param_dtype: Optional[torch.dtype] = None,
                min_unit_mb: float = MIN_UNIT_MB) -> PlannedLayout:
    """The buckets (and units) the engine would build for ``module`` on a shard group of ``shard_world`` ranks.

    ``param_dtype``: the dtype floating parameters will have after the precision plugin converts the module
    (``bf16-true`` -> bfloat16); None keeps each parameter's own dtype.
    """
    groups = default_groups(module) if groups is None else groups
    owner = param_owners(module, groups)

    def dtype_of(p: nn.Parameter) -> torch.dtype:
        return param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype

    def make(index: int, params: list[nn.Parameter], opt_index: Optional[int], unit: Optional[int],
             num_shards: int) -> PlannedBucket:
        layout = flat_layout([("", tuple(p.shape)) for p in params], num_shards)
        return PlannedBucket(index, layout.numel, layout.padded_numel, num_shards, dtype_of(params[0]),
                             opt_index is not None, opt_index, len(params), unit)

    if stage == 3:
        specs = plan_units(module, granularity, wrap_classes, min_params, min_unit_bytes=min_unit_mb * 2**20)
        units = [PlannedUnit(ui, spec.name, spec.module is None) for ui, spec in enumerate(specs)]
        buckets: list[PlannedBucket] = []
        for ui in reversed(range(len(specs))):  # the engine's launch order: reverse unit order
            for key, idx in unit_buckets(specs[ui], owner, dtype_of):
                b = make(len(buckets), [specs[ui].params[i] for i in idx], key, ui, shard_world)
                buckets.append(b)
                units[ui].buckets.append(b)
        return PlannedLayout(stage, shard_world, buckets, units, 0, 0)

    num_shards = 1 if stage == 0 else shard_world
    buckets = [make(i, ps, key, None, num_shards)
               for i, (key, ps) in enumerate(flat_buckets(module, owner, int(bucket_mb * 2**20), dtype_of))]
    in_bucket = {id(p) for p in bucketed_trainable(module, owner)}
    frozen = [p for p in module.parameters() if id(p) not in in_bucket]
    frozen_bytes = sum(p.numel() * dtype_of(p).itemsize for p in frozen)
    return PlannedLayout(stage, shard_world, buckets, [], frozen_bytes, sum(p.numel() for p in frozen))
