"""Where a job's ranks run on a topology, and the ring each process group runs on.

Rank order is the one ``topology.groups`` uses: islands contiguous (each in its fastest ring order), node
major; shard groups are consecutive ranks, replicate groups strided (``strategies/process_groups.py``). A ring runs
at its slowest hop (nccl-tests PERFORMANCE.md, "busbw"; "Design rules" 4), so each group is described by
its bottleneck bandwidth (``Topology.ring``), the latency of its slowest hop, and the class of link that
bottleneck is: intra-island (inside an NVLink/NVSwitch island), inter-island (PCIe/SMP on one node),
inter-node (the network).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..topology import Topology, best_subset
from ..topology.groups import island_order


@dataclass(frozen=True)
class Ring:
    ranks: int
    gbps: float  # bottleneck, GB/s per direction
    latency_us: float  # slowest hop
    link_class: str  # intra-island | inter-island | inter-node


@dataclass(frozen=True)
class JobPlacement:
    topology: Topology
    devices: tuple[int, ...]  # rank r runs on topology device devices[r]

    @property
    def world(self) -> int:
        return len(self.devices)

    def ring(self, ranks: Sequence[int]) -> Ring:
        devs = [self.devices[r] for r in ranks]
        if len(devs) < 2:
            return Ring(len(devs), float("inf"), 0.0, "intra-island")
        gbps, order = self.topology.ring(devs)
        hops = [self.topology.link(order[k], order[(k + 1) % len(order)]) for k in range(len(order))]
        nodes = {self.topology.devices[d].node for d in devs}
        islands = {self.topology.island_index(d) for d in devs}
        cls = "inter-node" if len(nodes) > 1 else ("inter-island" if len(islands) > 1 else "intra-island")
        return Ring(len(devs), gbps, max(h.latency_us for h in hops), cls)

    def groups(self, shard_size: Optional[int], island: Optional[int] = None) -> dict[str, Ring]:
        """The rings of rank 0's world, shard and replicate groups (all groups of a kind are alike here); with
        ``island`` (``secondary_shard``) the slowest island group of that many consecutive ranks."""
        n = self.world
        s = shard_size or n
        out = {"world": self.ring(range(n))}
        if s < n:
            shard = [self.ring(range(k, k + s)) for k in range(0, n, s)]
            repl = [self.ring(range(k, n, s)) for k in range(s)]
            out["shard"] = min(shard, key=lambda r: r.gbps)
            out["replicate"] = min(repl, key=lambda r: r.gbps)
        out["gather"] = out.get("shard", out["world"])  # parameter gathers (stage 3, zero1/2 after the step)
        if island:
            out["island"] = min((self.ring(range(k, k + island)) for k in range(0, n, island)), key=lambda r: r.gbps)
        return out


def place(topology: Topology, world: int, devices: Optional[Sequence[int]] = None) -> JobPlacement:
    """Ranks on ``topology``: every device, the fastest subset of one node, or several copies of a one-node
    topology when ``world`` is a multiple of its size. ``devices`` forces the device set (topology indices)."""
    topo = topology
    if devices is not None:
        if len(devices) != world:
            raise ValueError(f"devices={list(devices)} lists {len(devices)} devices for a world of {world} ranks")
        return JobPlacement(topo, tuple(island_order(topo, list(devices))))
    total = len(topo.devices)
    if world > total:
        if topo.num_nodes == 1 and world % total == 0:
            topo = topo.replicate_nodes(world // total)
        else:
            raise ValueError(f"a world of {world} ranks does not fit {topology.name} ({total} devices on "
                             f"{topology.num_nodes} node(s)); use a multiple of {topology.devices_per_node} ranks")
    if world == len(topo.devices):
        order = []
        for node in range(topo.num_nodes):
            order += island_order(topo, [d.index for d in topo.devices if d.node == node])
        return JobPlacement(topo, tuple(order))
    if world > topo.devices_per_node:
        raise ValueError(f"{world} ranks on {topology.name}: use all {len(topo.devices)} devices, at most "
                         f"{topo.devices_per_node} (one node), or whole nodes")
    return JobPlacement(topo, tuple(best_subset(topo, world).devices))
