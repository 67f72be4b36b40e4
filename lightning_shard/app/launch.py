"""Launch shape from a topology: accelerator, devices per node and node count (never typed twice).

The ``topology`` group of ``conf/train.yaml`` *is* the preset directory ``conf/topology/`` (owned by the
topology package, not edited here). A composed ``topology`` node is a preset's keys plus any command-line
override (``topology.devices=2``); ``base:`` inheritance is resolved through
:func:`lightning_shard.topology.resolve.resolve`, the one resolver the strategies and the planner use too.
``trainer.{accelerator,devices,num_nodes}`` interpolate these figures through the ``ls.topo`` resolver that
``train.py`` registers.
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning_shard.topology import Topology
from lightning_shard.topology.resolve import composed_keys, resolve

FACTS = ("accelerator", "devices_per_node", "num_nodes", "islands_per_node", "name")


def topology_from_node(node: Mapping[str, Any]) -> Topology:
    """The :class:`Topology` a composed ``topology`` node describes (preset keys + overrides)."""
    return resolve(node)


def topology_fact(node: Mapping[str, Any], fact: str) -> Any:
    """One of :data:`FACTS` for the composed topology node."""
    if fact not in FACTS:
        raise ValueError(f"unknown topology fact {fact!r}; one of {FACTS}")
    merged = composed_keys(node)
    if fact == "accelerator":
        return "cpu" if merged.get("kind") == "cpu" else "gpu"
    if fact == "name":
        return merged["name"]
    topo = topology_from_node(node)
    if fact == "devices_per_node":
        return int(topo.devices_per_node)
    if fact == "num_nodes":
        return int(topo.num_nodes)
    return len(topo.islands) // max(1, int(topo.num_nodes))
