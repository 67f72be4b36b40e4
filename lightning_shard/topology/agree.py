"""Do the nodes of a job have the same machine? Each node resolves its ``topology`` on its own (a capture file or
``"detect"`` describes the node it is read on); the strategies gather each node's :func:`node_summary` when they
join the process group and :func:`disagreement` names the nodes that differ, before any group is built from it."""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

from lightning_shard.topology.model import Topology


def node_summary(topo: Topology, node: int = 0) -> str:
    """One line that two identical nodes share and two different ones do not: the devices of ``node`` (count and
    models) and how many of their pairs each link class joins, e.g. ``8 x NVIDIA H100 80GB HBM3; pairs: NV18 x 28``."""
    devices = [d for d in topo.devices if d.node == node]
    models = Counter(d.model or d.kind for d in devices)
    links = Counter(topo.link(a.index, b.index).token or topo.link(a.index, b.index).cls.name
                    for i, a in enumerate(devices) for b in devices[i + 1:])
    kinds = ", ".join(f"{n} x {m}" for m, n in sorted(models.items()))
    pairs = ", ".join(f"{c} x {n}" for c, n in sorted(links.items())) or "none"
    return f"{kinds}; pairs: {pairs}"


def disagreement(nodes: Sequence[tuple[int, str, str]]) -> Optional[str]:
    """``nodes``: (node rank, host, :func:`node_summary`) of every node. None when all agree; else one message that
    names the nodes whose machine differs from node 0's, and how."""
    by_node = {rank: (host, summary) for rank, host, summary in nodes}
    host0, first = by_node[min(by_node)]
    odd = [(rank, host, summary) for rank, (host, summary) in sorted(by_node.items()) if summary != first]
    if not odd:
        return None
    lines = [f"  node {rank} ({host}): {summary}" for rank, host, summary in odd]
    return ("the nodes of this job do not have the same machine, so one topology cannot describe them; node 0 "
            f"({host0}): {first}, but\n" + "\n".join(lines) + "\nLaunch on identical nodes (same GPUs, same links: "
            "check `lightning-shard topo` on each), or give every node the same topology preset.")
