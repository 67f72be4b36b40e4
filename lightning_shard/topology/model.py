"""The `Topology` model: devices, the link of every device pair, islands and fabric warnings.

Built from a matrix of nvidia-smi topo -m tokens (parsed, detected or from a preset) by
:meth:`Topology.from_tokens`; several identical nodes are joined by :meth:`Topology.replicate_nodes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Sequence

from lightning_shard.topology.links import Fabric, Link, LinkClass, classify_token
from lightning_shard.topology.rings import best_ring

# A GPU has at most 18 NVLinks (H100, B200: NVIDIA NVLink page). If every pair of k >= 4 GPUs shows the
# same NV# and NV# x (k - 1) exceeds what one GPU has, the links cannot be direct: they go through an
# NVSwitch and NV# is each GPU's whole bundle (NV12 on HGX A100, NV18 on HGX H100, NV6 on DGX-2).
# A 4-GPU H100 board with NV6 to each of its 3 peers (6 x 3 = 18) is direct, not switched.
MAX_NVLINKS_PER_GPU = 18
MIN_SWITCH_GPUS = 4


def parse_cpu_list(text: str | None) -> tuple[int, ...]:
    """'0-23,48-71' -> (0, ..., 23, 48, ..., 71); '' / 'N/A' / None -> ()."""
    if not text or text.upper() == "N/A":
        return ()
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


@dataclass(frozen=True)
class Device:
    index: int  # position in this topology: rank order is chosen elsewhere (groups.py)
    name: str  # as the source names it, e.g. "GPU3"
    node: int = 0
    local_index: int = 0  # CUDA ordinal on its node
    kind: str = "gpu"  # gpu | cpu
    model: str | None = None
    pci_bus_id: str | None = None
    uuid: str | None = None
    numa: int | None = None
    cpu_affinity: str | None = None  # as printed, e.g. "0-23,48-71"

    @property
    def cpus(self) -> tuple[int, ...]:
        return parse_cpu_list(self.cpu_affinity)


@dataclass(frozen=True)
class Island:
    """A connected component of the fast-link graph on one node, with its fastest ring."""

    devices: tuple[int, ...]
    node: int
    link: LinkClass  # slowest fast class inside (SELF for a lone device)
    ring_gbps: float
    ring_order: tuple[int, ...]


@dataclass
class Topology:
    name: str
    devices: list[Device]
    links: list[list[Link]]  # full n x n matrix, links[i][i] is SELF
    fabric: Fabric = field(default_factory=Fabric)
    source: str = ""
    nics: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_tokens(
        cls,
        name: str,
        tokens: Sequence[Sequence[str]],
        devices: Sequence[Device] | None = None,
        fabric: Fabric | None = None,
        expect_nvlink: bool = False,
        source: str = "",
        nics: Sequence[str] = (),
        extra_tokens: dict[str, LinkClass] | None = None,
    ) -> "Topology":
        """A one-node topology from an n x n matrix of topo -m tokens (X, NV#, PIX, ..., N/A)."""
        fabric = fabric or Fabric()
        n = len(tokens)
        devs = list(devices) if devices is not None else [Device(index=i, name=f"GPU{i}", local_index=i)
                                                          for i in range(n)]
        if len(devs) != n or any(len(row) != n for row in tokens):
            raise ValueError(f"{name}: a topology matrix must be {len(devs)} x {len(devs)}; got rows of "
                             f"{[len(r) for r in tokens]}")
        classes: list[list[tuple[LinkClass, int]]] = []
        for i, row in enumerate(tokens):
            out = []
            for j, tok in enumerate(row):
                got = (extra_tokens or {}).get(tok, None)
                got = (got, 0) if got is not None else classify_token(tok)
                if got is None:
                    raise ValueError(f"{name}: cell ({devs[i].name}, {devs[j].name}) = {tok!r} is not a link token")
                out.append(got)
            classes.append(out)
        warnings: list[str] = []
        _mark_switched(classes, devs, warnings)
        links = [[fabric.link(c, k, tokens[i][j]) for j, (c, k) in enumerate(row)] for i, row in enumerate(classes)]
        topo = cls(name=name, devices=devs, links=links, fabric=fabric, source=source, nics=list(nics),
                   warnings=warnings)
        topo.warnings.extend(_fabric_warnings(topo, expect_nvlink))
        return topo

    def replicate_nodes(self, nodes: int) -> "Topology":
        """`nodes` copies of this one-node topology joined by the fabric's network."""
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        if self.num_nodes != 1:
            raise ValueError(f"{self.name} already has {self.num_nodes} nodes; replicate a one-node topology")
        per, out_devs = len(self.devices), []
        for node in range(nodes):
            out_devs += [replace(d, index=node * per + d.index, node=node) for d in self.devices]
        net = self.fabric.link(LinkClass.NETWORK, token="NET", gpus_per_node=per)
        links = [[self.links[i % per][j % per] if i // per == j // per else net for j in range(per * nodes)]
                 for i in range(per * nodes)]
        return Topology(f"{self.name}x{nodes}", out_devs, links, self.fabric, self.source, self.nics,
                        list(self.warnings))

    def subset(self, indices: Sequence[int], name: str | None = None) -> "Topology":
        """The topology a job sees when only `indices` are visible, renumbered 0..k-1 in that order."""
        for i in indices:
            if not 0 <= i < len(self.devices):
                raise ValueError(f"device {i} is not in {self.name} (devices 0..{len(self.devices) - 1})")
        devs = [replace(self.devices[i], index=k, local_index=k) for k, i in enumerate(indices)]
        links = [[self.links[i][j] for j in indices] for i in indices]
        return Topology(name or self.name, devs, links, self.fabric, self.source, self.nics, list(self.warnings))

    # ------------------------------------------------------------------ queries
    @property
    def num_nodes(self) -> int:
        return 1 + max((d.node for d in self.devices), default=0)

    @property
    def devices_per_node(self) -> int:
        return len(self.devices) // self.num_nodes

    def link(self, i: int, j: int) -> Link:
        return self.links[i][j]

    def gbps(self, i: int, j: int) -> float:
        return self.links[i][j].gbps

    def ring(self, devices: Sequence[int]) -> tuple[float, tuple[int, ...]]:
        """(GB/s, order) of the fastest ring through `devices`, islands kept contiguous on ties."""
        order = sorted(devices, key=lambda d: (self.island_index(d), d))
        return best_ring(order, self.gbps)

    @cached_property
    def islands(self) -> list[Island]:
        seen: set[int] = set()
        out: list[Island] = []
        for d in self.devices:
            if d.index in seen:
                continue
            comp, stack = {d.index}, [d.index]
            while stack:
                a = stack.pop()
                for b in range(len(self.devices)):
                    if b not in comp and self.links[a][b].cls.is_fast:
                        comp.add(b)
                        stack.append(b)
            seen |= comp
            members = tuple(sorted(comp))
            fast = [self.links[a][b].cls for a in members for b in members if a < b and self.links[a][b].cls.is_fast]
            ring_gbps, order = best_ring(members, self.gbps)
            out.append(Island(members, d.node, max(fast, key=lambda c: c.rank) if fast else LinkClass.SELF,
                              ring_gbps, order))
        return out

    def island_index(self, device: int) -> int:
        return next(k for k, isl in enumerate(self.islands) if device in isl.devices)

    def link_classes(self) -> set[LinkClass]:
        n = len(self.devices)
        return {self.links[i][j].cls for i in range(n) for j in range(i + 1, n)}

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return None if x == float("inf") else x

        gpus = any(d.kind != "cpu" for d in self.devices)

        return {
            "name": self.name,
            "source": self.source,
            "nodes": self.num_nodes,
            # no GPU (cpu presets, detection without one): no NVLink or PCIe generation to report
            "fabric": {"nvlink_gen": self.fabric.nvlink_gen if gpus else None,
                       "pcie_gen": self.fabric.pcie_gen if gpus else None, "network": self.fabric.network},
            "devices": [
                {"index": d.index, "name": d.name, "node": d.node, "local_index": d.local_index, "kind": d.kind,
                 "model": d.model, "pci_bus_id": d.pci_bus_id, "uuid": d.uuid, "numa": d.numa,
                 "cpu_affinity": d.cpu_affinity}
                for d in self.devices
            ],
            "matrix": [[lk.cls.value for lk in row] for row in self.links],
            "gbps": [[num(lk.gbps) for lk in row] for row in self.links],
            "islands": [
                {"devices": list(i.devices), "node": i.node, "link": i.link.value, "ring_gbps": num(i.ring_gbps),
                 "ring_order": list(i.ring_order)}
                for i in self.islands
            ],
            "nics": self.nics,
            "warnings": self.warnings,
        }


def _mark_switched(classes: list[list[tuple[LinkClass, int]]], devs: Sequence[Device], warnings: list[str]) -> None:
    """Turn the NV# cells of a switched fabric into NVSWITCH (heuristic above); infer its missing cells."""
    n = len(classes)
    nv = [i for i in range(n) if any(c is LinkClass.NVLINK for c, _ in classes[i])]
    counts = {classes[i][j][1] for i in nv for j in nv if i != j and classes[i][j][0] is LinkClass.NVLINK}
    clique = all(classes[i][j][0] in (LinkClass.NVLINK, LinkClass.UNKNOWN) for i in nv for j in nv if i != j)
    if len(nv) < MIN_SWITCH_GPUS or len(counts) != 1 or not clique:
        return
    (count,) = counts
    if count * (len(nv) - 1) <= MAX_NVLINKS_PER_GPU:
        return  # direct links can explain it
    inferred = 0
    for i in nv:
        for j in nv:
            if i != j:
                inferred += classes[i][j][0] is LinkClass.UNKNOWN
                classes[i][j] = (LinkClass.NVSWITCH, count)
    if inferred:
        warnings.append(f"{inferred // 2} GPU pairs missing from the capture were taken as NV{count} "
                        "through the NVSwitch fabric")


def _fabric_warnings(topo: Topology, expect_nvlink: bool) -> list[str]:
    out: list[str] = []
    n = len(topo.devices)
    unknown = sum(topo.links[i][j].cls is LinkClass.UNKNOWN for i in range(n) for j in range(i + 1, n))
    if unknown:
        out.append(f"{unknown} device pairs have no link information (partial capture): they count as 0 GB/s")
    has_fast = [any(topo.links[i][j].cls.is_fast for j in range(n) if j != i) for i in range(n)]
    if n < 2 or all(has_fast) or (not any(has_fast) and not expect_nvlink):
        return out
    peers = [topo.devices[i].name for i in range(n) if has_fast[i]]
    for i in range(n):
        if not has_fast[i]:
            why = ("the preset expects NVLink on every GPU" if expect_nvlink else
                   f"its peers {', '.join(peers)} have NVLink")
            out.append(
                f"degraded fabric? {topo.devices[i].name} reaches every peer over PCIe only while {why}: check "
                f"`nvidia-smi nvlink -s -i {topo.devices[i].local_index}` (inactive links) and the fabric manager"
            )
    return out
