"""Device groups of a job: shard groups inside islands/nodes, replicate groups across them.

Everything here is plain rank lists; process groups are created from them elsewhere, through
engine/comm/collectives.py. Ranks are numbered node-major (rank = node * local_world + local_rank, as torchrun
and SLURM do) and local rank k runs on the k-th device of `cuda_visible_devices[node]`, which orders the
devices so that islands are contiguous: shard groups of consecutive ranks then stay inside an island.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import combinations
from math import comb
from typing import Sequence

from lightning_shard.topology.model import Device, Topology

_BRUTE_FORCE_SUBSETS = 5000  # C(n, k) up to which best_subset tries every subset


def visible_id(device: Device) -> int:
    """The number to put in CUDA_VISIBLE_DEVICES: the GPU# the source printed, else the local index."""
    m = re.fullmatch(r"GPU(\d+)", device.name)
    return int(m.group(1)) if m else device.local_index


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Subset:
    devices: tuple[int, ...]  # topology indices, in ring order
    ring_gbps: float
    cuda_visible_devices: str


@dataclass(frozen=True)
class GroupLayout:
    axes: dict[str, int]  # {"replicate": R, "shard": S}, R * S = world size
    devices: tuple[int, ...]  # rank r runs on topology device devices[r]
    shard_groups: tuple[tuple[int, ...], ...]  # ranks
    replicate_groups: tuple[tuple[int, ...], ...]  # ranks
    cuda_visible_devices: tuple[str, ...]  # one per node: local rank k -> k-th entry
    shard_ring_gbps: float  # slowest shard group's ring
    replicate_ring_gbps: float  # slowest replicate group's ring (inf when R == 1)

    @property
    def world_size(self) -> int:
        return len(self.devices)


def island_order(topology: Topology, devices: Sequence[int]) -> list[int]:
    """`devices` reordered so that islands are contiguous, each in its fastest ring order."""
    chosen = set(devices)
    out: list[int] = []
    for isl in sorted(topology.islands, key=lambda i: (i.node, min(i.devices))):
        out += [d for d in isl.ring_order if d in chosen]
    return out


def best_subset(topology: Topology, k: int, node: int = 0) -> Subset:
    """The k devices of `node` with the fastest bottleneck ring (ties: fewer islands, one NUMA node, low ids)."""
    pool = [d.index for d in topology.devices if d.node == node]
    if not 1 <= k <= len(pool):
        raise ValueError(f"cannot pick {k} devices: {topology.name} has {len(pool)} devices on node {node} "
                         f"(1..{len(pool)})")
    if comb(len(pool), k) <= _BRUTE_FORCE_SUBSETS:
        candidates: Sequence[Sequence[int]] = list(combinations(pool, k))
    else:  # large boxes (DGX-2): the first k of each island's ring, and the island-ordered prefix
        candidates = [isl.ring_order[:k] for isl in topology.islands if isl.node == node and len(isl.devices) >= k]
        candidates.append(island_order(topology, pool)[:k])

    def key(combo: Sequence[int]) -> tuple:
        gbps, _ = topology.ring(combo)
        islands = len({topology.island_index(d) for d in combo})
        numas = len({topology.devices[d].numa for d in combo})
        return gbps, -islands, -numas, [-d for d in sorted(combo)]

    best = max(candidates, key=key)
    gbps, _ = topology.ring(best)
    order = island_order(topology, best)
    return Subset(tuple(order), gbps, ",".join(str(visible_id(topology.devices[d])) for d in order))


def _node_topology(topology: Topology, nodes: int) -> Topology:
    if topology.num_nodes == nodes:
        return topology
    if topology.num_nodes == 1:
        return topology.replicate_nodes(nodes)
    raise ValueError(f"topology {topology.name} has {topology.num_nodes} nodes but the job asks for {nodes}: use a "
                     f"one-node preset (it is replicated per node) or set num_nodes={topology.num_nodes}")


def build_layout(topology: Topology, world_size: int, nodes: int = 1, devices: Sequence[int] | None = None,
                 shard_size: int | None = None, hybrid: bool = False) -> GroupLayout:
    """Shard and replicate groups for `world_size` ranks on `nodes` nodes of `topology`.

    devices: local device indices used on every node (default: all of them). shard_size: ranks per shard
    group (default: the island size when `hybrid`, else the whole world).
    """
    if world_size < 1 or nodes < 1:
        raise ValueError(f"world_size ({world_size}) and nodes ({nodes}) must be >= 1")
    if world_size % nodes:
        raise ValueError(f"world_size {world_size} is not a multiple of nodes {nodes} ({world_size} % {nodes} = "
                         f"{world_size % nodes}): every node runs the same number of ranks")
    topo = _node_topology(topology, nodes)
    local, per = world_size // nodes, topo.devices_per_node
    if devices is None:
        if local != per:
            hint = best_subset(topo, local).cuda_visible_devices if local < per else None
            raise ValueError(
                f"topology {topology.name} has {per} devices per node but the job runs {local} ranks per node "
                f"(world_size {world_size} / nodes {nodes}): "
                + (f"pass devices=[...] (fastest: CUDA_VISIBLE_DEVICES={hint}) or " if hint else "")
                + f"use a preset with {local} devices per node")
        devices = list(range(per))
    if len(devices) != local or len(set(devices)) != len(devices) or not all(0 <= d < per for d in devices):
        raise ValueError(f"devices={list(devices)} must be {local} distinct local indices in 0..{per - 1} "
                         f"(world_size {world_size} / nodes {nodes} = {local} per node)")
    order = island_order(topo, list(devices))
    ranks_dev = tuple(node * per + d for node in range(nodes) for d in order)
    islands = island_sizes(topo, order)
    if shard_size is None:
        if hybrid:
            if nodes == 1 and len(islands) == 1:
                raise ValueError(
                    f"hybrid sharding needs at least 2 islands, but devices {order} of {topology.name} form one "
                    f"{topo.islands[topo.island_index(order[0])].link.value} island: "
                    "use full sharding (zero3 / fsdp_shard) "
                    f"instead, or pass shard_size=<divisor of {world_size}> to force groups")
            if len(set(islands)) != 1:
                raise ValueError(f"hybrid sharding needs equal islands, but devices {order} form islands of sizes "
                                 f"{islands}: pass shard_size=<one of {divisors(world_size)}> "
                                 "or choose devices in equal islands")
            shard_size = islands[0] if len(islands) > 1 else local
        else:
            shard_size = world_size
    if shard_size < 1 or world_size % shard_size:
        raise ValueError(f"shard group size {shard_size} does not divide world size {world_size} ({world_size} % "
                         f"{shard_size} = {world_size % shard_size if shard_size else 'n/a'}): "
                         f"use one of {divisors(world_size)}")
    shard = tuple(tuple(range(s, s + shard_size)) for s in range(0, world_size, shard_size))
    repl = tuple(tuple(range(k, world_size, shard_size)) for k in range(shard_size))
    cvd = tuple(",".join(str(visible_id(topo.devices[d])) for d in order) for _ in range(nodes))
    return GroupLayout(
        axes={"replicate": world_size // shard_size, "shard": shard_size},
        devices=ranks_dev, shard_groups=shard, replicate_groups=repl, cuda_visible_devices=cvd,
        shard_ring_gbps=min(topo.ring([ranks_dev[r] for r in g])[0] for g in shard),
        replicate_ring_gbps=min(topo.ring([ranks_dev[r] for r in g])[0] for g in repl),
    )


def island_sizes(topo: Topology, order: Sequence[int]) -> list[int]:
    sizes: dict[int, int] = {}
    for d in order:
        k = topo.island_index(d)
        sizes[k] = sizes.get(k, 0) + 1
    return list(sizes.values())
