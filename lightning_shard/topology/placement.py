"""Placement check: does a job push its traffic across slow links when a better placement exists?

Traffic classes (docs/architecture.md, "Design rules" 4):
- "per_layer": ZeRO-3 / FSDP gather parameters and reduce-scatter gradients for every layer, so every
  layer waits on the ring of the shard group.
- "per_step": DDP / ZeRO-1 / ZeRO-2 communicate once per optimizer step over all ranks.

The estimated slowdown of the collectives is fast-ring bandwidth / actual ring bandwidth (a ring runs at
its slowest hop, nccl-tests busbw): fast is the best of (a) the best k-device subset of the node and,
for per-layer traffic, (b) hybrid sharding with shard groups inside the islands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lightning_shard.topology.groups import best_subset, island_order, island_sizes
from lightning_shard.topology.model import Topology

TRAFFIC = {"per_layer": "per-layer (zero3 / fsdp)", "per_step": "per-step (ddp / zero1 / zero2)"}
_MARGIN = 1.05  # below 5 % we do not bother the user


class PlacementError(ValueError):
    """Raised instead of the warning when strict placement is asked for."""


@dataclass(frozen=True)
class PlacementWarning:
    message: str
    traffic: str
    slowdown: float
    actual_gbps: float
    fast_gbps: float
    cuda_visible_devices: str | None  # a better device set, when one exists
    hybrid_shard_size: int | None  # shard inside islands of this size, when that is the better fix

    def __str__(self) -> str:
        return self.message


def check_placement(topology: Topology, devices: Sequence[int], traffic: str, shard_size: int | None = None,
                    strict: bool = False) -> PlacementWarning | None:
    """A warning (or PlacementError when `strict`) if the job's traffic crosses slow links needlessly."""
    if traffic not in TRAFFIC:
        raise ValueError(f"traffic={traffic!r}: expected one of {sorted(TRAFFIC)} (per_layer for zero3/fsdp, "
                         f"per_step for ddp/zero1/zero2)")
    order = island_order(topology, devices)
    if len(order) != len(devices):
        raise ValueError(f"devices {list(devices)} must be distinct indices of {topology.name} "
                         f"(0..{len(topology.devices) - 1})")
    k = len(order)
    if shard_size is not None and (shard_size < 1 or k % shard_size):
        raise ValueError(f"shard group size {shard_size} does not divide the job's {k} ranks: use one of "
                         f"{[d for d in range(1, k + 1) if k % d == 0]}")
    groups = [order[s:s + (shard_size or k)]
              for s in range(0, k, shard_size or k)] if traffic == "per_layer" else [order]
    if all(len({topology.island_index(d) for d in g}) == 1 for g in groups):
        return None
    actual = min(topology.ring(g)[0] for g in groups)
    cvd, fast, hybrid = None, actual, None
    nodes = {topology.devices[d].node for d in order}
    if len(nodes) == 1:
        sub = best_subset(topology, k, node=nodes.pop())
        if sub.ring_gbps > actual * _MARGIN:
            cvd, fast = sub.cuda_visible_devices, sub.ring_gbps
    if traffic == "per_layer":
        sizes = island_sizes(topology, order)
        if len(set(sizes)) == 1 and 1 < sizes[0] < k:
            inner = min(topology.islands[topology.island_index(d)].ring_gbps for d in order)
            if inner > fast * _MARGIN:
                fast, hybrid, cvd = inner, sizes[0], None
    if fast <= actual * _MARGIN:
        return None
    slowdown = fast / actual
    slow = min((topology.link(a, b) for g in groups for a in g for b in g if a != b), key=lambda lk: lk.gbps)
    fix = (f"set CUDA_VISIBLE_DEVICES={cvd} ({fast:g} GB/s ring)" if cvd else
           f"use hybrid sharding with shard_size={hybrid} (zero3_hybrid / fsdp_shard_hybrid: shard inside each "
           f"{hybrid}-device island at {fast:g} GB/s, replicate across)")
    msg = (f"placement: ranks on {', '.join(topology.devices[d].name for d in order)} span islands joined by "
           f"{slow.cls.value} ({actual:g} GB/s per direction); the {TRAFFIC[traffic]} traffic runs at that speed "
           f"instead of {fast:g} GB/s, an estimated {slowdown:.1f}x slower collectives. Fix: {fix}"
           + ("" if strict else "; strict_placement=True makes this an error"))
    if strict:
        raise PlacementError(msg)
    return PlacementWarning(msg, traffic, round(slowdown, 3), actual, fast, cvd, hybrid)

