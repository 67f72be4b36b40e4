"""Building the engine's buckets from the plan (:mod:`.plan`): flat buckets for stages 0-2, unit buckets for
stage 3, materializing a deferred (meta-device) model module by module so a unit is sharded as soon as every
module touching it is done."""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from .buckets.bucket import Bucket
from .buckets.plan import Owner, flat_buckets, unit_buckets
from .zero3.deferred import DeferredInit
from .zero3.plan import UnitSpec
from .zero3.unit import Unit

# (index, parameters, names, optimizer index or None, stage 3: the unit's name) -> a Bucket in the engine's context
MakeBucket = Callable[[int, list[nn.Parameter], list[str], Optional[int], Optional[str]], Bucket]


def build_flat(module: nn.Module, owner: dict[int, Owner], bucket_bytes: int,
               make: MakeBucket) -> list[Bucket]:
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}
    return [make(i, ps, [names[id(p)] for p in ps], key, None)
            for i, (key, ps) in enumerate(flat_buckets(module, owner, bucket_bytes))]


def build_units(specs: list[UnitSpec], owner: dict[int, Owner], deferred: Optional[DeferredInit],
                make: MakeBucket) -> tuple[list[Bucket], list[Unit]]:
    """Stage 3: the buckets of :func:`.plan.unit_buckets`, unit by unit. Bucket order, the reduction launch
    order, is reverse unit order: roughly the order backward produces gradients. Each unit knows its buckets; a
    bucket knows its unit's name only (for messages): ``unit_of`` maps back."""
    per_unit: dict[int, list[Bucket]] = {}

    def shard(ui: int) -> None:
        spec = specs[ui]
        per_unit[ui] = [make(-1, [spec.params[i] for i in idx], [spec.names[i] for i in idx], key, spec.name)
                        for key, idx in unit_buckets(spec, owner)]
        if deferred is not None:
            deferred.sharded(spec.params)

    if deferred is None:
        for ui in range(len(specs)):
            shard(ui)
    else:
        waiting = {ui: {id(m) for p in spec.params if deferred.is_deferred(p) for m in deferred.referrers[id(p)]}
                   for ui, spec in enumerate(specs)}
        for ui, w in waiting.items():
            if not w:
                shard(ui)
        for m in deferred.modules_in_order():
            deferred.materialize(m)
            for ui, w in waiting.items():
                if ui not in per_unit and id(m) in w:
                    w.discard(id(m))
                    if not w:
                        shard(ui)
    buckets: list[Bucket] = []
    for ui in reversed(range(len(specs))):
        for b in per_unit[ui]:
            b.index = len(buckets)
            buckets.append(b)
    return buckets, [Unit(ui, spec, per_unit[ui]) for ui, spec in enumerate(specs)]


def unit_of(units: list[Unit]) -> dict[int, Unit]:
    """``id(bucket) -> its unit`` (stage 3)."""
    return {id(b): u for u in units for b in u.buckets}
