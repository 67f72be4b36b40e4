"""Launch shape from a topology: accelerator, devices per node and node count (never typed twice).

The ``topology`` group of ``conf/train.yaml`` *is* the preset directory ``conf/topology/`` (owned by the
topology package, not edited here). A composed ``topology`` node is a preset's keys plus any command-line
override (``topology.devices=2``); ``base:`` inheritance is resolved through
:func:`lightning_shard.topology.presets.read_preset`, and the result is built into a ``Topology`` by the
same code the strategies use. ``trainer.{accelerator,devices,num_nodes}`` interpolate these figures through
the ``ls.topo`` resolver that ``train.py`` registers.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping

from lightning_shard.topology import Topology
from lightning_shard.topology.presets import build_preset, list_presets, read_preset

FACTS = ("accelerator", "devices_per_node", "num_nodes", "islands_per_node", "name")


@lru_cache(maxsize=64)
def _preset(name: str) -> dict[str, Any]:
    return read_preset(name)


@lru_cache(maxsize=1)
def _preset_names() -> tuple[str, ...]:
    return tuple(list_presets())


def _merged(node: Mapping[str, Any]) -> dict[str, Any]:
    name = node.get("name")
    if not name:
        raise ValueError("topology.name is missing; choose a preset with topology=<name> "
                         f"(one of {', '.join(_preset_names())})")
    given = {k: v for k, v in node.items() if v is not None}
    base = dict(_preset(name)) if name in _preset_names() else {}
    if "base" in given:  # a composed preset that inherits: its own keys win over the base's
        base = {**_preset(given["base"]), **{k: v for k, v in base.items() if k != "base"}}
    merged = {**base, **{k: v for k, v in given.items() if k != "base"}}
    return merged


@lru_cache(maxsize=64)
def _topology(frozen: tuple) -> Topology:
    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in frozen}
    return build_preset(cfg, source=f"topology={cfg.get('name')}", prefix="topology.")


def topology_from_node(node: Mapping[str, Any]) -> Topology:
    """The :class:`Topology` a composed ``topology`` node describes (preset keys + overrides)."""
    merged = _merged(node)
    return _topology(tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in merged.items())))


def topology_fact(node: Mapping[str, Any], fact: str) -> Any:
    """One of :data:`FACTS` for the composed topology node."""
    if fact not in FACTS:
        raise ValueError(f"unknown topology fact {fact!r}; one of {FACTS}")
    merged = _merged(node)
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
