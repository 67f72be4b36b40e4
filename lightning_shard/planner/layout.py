"""The engine's flat-buffer layout, reproduced without building an engine (no collectives, no copies).

The planner must predict the ledger's bytes exactly, so this module follows the rules of
``core/engine.py`` (``_build_flat_buckets``, ``_build_unit_buckets``) and ``core/flat.py`` line by line:

* stages 0-2: trainable parameters that an optimizer holds, in REVERSE registration order, fill one open
  bucket per (optimizer index, param group index, dtype, device); a bucket closes once its bytes reach
  ``bucket_mb * 2**20``. Stage 0 keeps one "shard" (no padding); stages 1/2 pad to a multiple of N.
* stage 3: units from :func:`lightning_shard.core.units.plan_units` (reused, not copied); inside a unit one
  bucket per (optimizer/group, or frozen, dtype, device) in first-seen order; bucket order is reverse unit
  order. Every bucket is padded to a multiple of the shard group size.

Parameters may live on the meta device: only shapes, dtypes and identities are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..core.flat import build_layout
from ..core.units import plan_units

# optimizer groups as the engine sees them: per optimizer, per param group, the parameters
OptimizerGroups = Sequence[Sequence[Sequence[nn.Parameter]]]


@dataclass(frozen=True)
class PlannedBucket:
    index: int
    numel: int  # real elements
    padded_numel: int
    num_shards: int
    dtype: torch.dtype
    trainable: bool  # held by an optimizer (stage 3 also shards frozen parameters)
    opt_index: Optional[int]
    group_index: Optional[int]
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


def _owners(module: nn.Module, groups: OptimizerGroups) -> dict[int, tuple[int, int]]:
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}
    owner: dict[int, tuple[int, int]] = {}
    for oi, opt in enumerate(groups):
        for gi, group in enumerate(opt):
            for p in group:
                if id(p) not in names:
                    raise ValueError(f"optimizer {oi}, param group {gi} holds a tensor of shape {tuple(p.shape)} that "
                                     "is not a parameter of the module")
                owner[id(p)] = (oi, gi)
    return owner


def plan_layout(module: nn.Module, groups: Optional[OptimizerGroups], stage: int, shard_world: int,
                bucket_mb: float = 25.0, granularity: str = "zero3", wrap_classes: Any = None,
                min_params: Optional[int] = None, param_dtype: Optional[torch.dtype] = None) -> PlannedLayout:
    """The buckets (and units) the engine would build for ``module`` on a shard group of ``shard_world`` ranks.

    ``param_dtype``: the dtype floating parameters will have after the precision plugin converts the module
    (``bf16-true`` -> bfloat16); None keeps each parameter's own dtype.
    """
    groups = default_groups(module) if groups is None else groups
    owner = _owners(module, groups)

    def dtype_of(p: nn.Parameter) -> torch.dtype:
        return param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype

    def make(index: int, params: list[nn.Parameter], key: Optional[tuple[int, int]], unit: Optional[int],
             num_shards: int) -> PlannedBucket:
        layout = build_layout([("", tuple(p.shape)) for p in params], num_shards)
        return PlannedBucket(index, layout.numel, layout.padded_numel, num_shards, dtype_of(params[0]),
                             key is not None, key[0] if key else None, key[1] if key else None, len(params), unit)

    if stage == 3:
        specs = plan_units(module, granularity, wrap_classes, min_params)
        units: list[PlannedUnit] = []
        per_unit: list[list[tuple[Optional[tuple[int, int]], list[nn.Parameter]]]] = []
        for ui, spec in enumerate(specs):
            keyed: dict[tuple, list[nn.Parameter]] = {}
            for p in spec.params:
                keyed.setdefault((owner.get(id(p)) if p.requires_grad else None, dtype_of(p), p.device), []).append(p)
            per_unit.append([(k[0], ps) for k, ps in keyed.items()])
            units.append(PlannedUnit(ui, spec.name, spec.module is None))
        buckets: list[PlannedBucket] = []
        for ui in reversed(range(len(specs))):
            for key, ps in per_unit[ui]:
                b = make(len(buckets), ps, key, ui, shard_world)
                buckets.append(b)
                units[ui].buckets.append(b)
        return PlannedLayout(stage, shard_world, buckets, units, 0, 0)

    trainable = [p for p in module.parameters() if p.requires_grad and id(p) in owner]
    bucket_bytes = int(bucket_mb * 2**20)
    open_buckets: dict[tuple, list[nn.Parameter]] = {}
    sizes: dict[tuple, int] = {}
    ordered: list[tuple[tuple, list[nn.Parameter]]] = []
    for p in reversed(trainable):
        dt = dtype_of(p)
        key = (*owner[id(p)], dt, p.device)
        if key not in open_buckets:
            open_buckets[key], sizes[key] = [], 0
            ordered.append((key, open_buckets[key]))
        open_buckets[key].append(p)
        sizes[key] += p.numel() * torch.empty(0, dtype=dt, device="meta").element_size()
        if sizes[key] >= bucket_bytes:
            del open_buckets[key]
    num_shards = 1 if stage == 0 else shard_world
    buckets = [make(i, ps, (key[0], key[1]), None, num_shards) for i, (key, ps) in enumerate(ordered)]
    in_bucket = {id(p) for p in trainable}
    frozen = [p for p in module.parameters() if id(p) not in in_bucket]
    frozen_bytes = sum(p.numel() * torch.empty(0, dtype=dtype_of(p), device="meta").element_size() for p in frozen)
    return PlannedLayout(stage, shard_world, buckets, [], frozen_bytes, sum(p.numel() for p in frozen))
