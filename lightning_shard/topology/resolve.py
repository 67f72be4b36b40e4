"""The one resolver of a topology: every layer that is given a machine (the strategies' ``topology`` option, the
planner, ``lightning-shard topo``/``plan``, the Hydra ``topology`` node of ``python -m lightning_shard.train``)
turns it into a :class:`Topology` here.

Accepted: a :class:`Topology` (as it is); a preset name (``conf/topology/<name>.yaml``); a capture file
(``nvidia-smi topo -m`` / ``rocm-smi`` output); ``"detect"`` (the live machine); ``None`` or ``"cpu"`` (``world``
CPU processes); or a composed Hydra node: a mapping of preset keys plus overrides (``{"name": "cpu",
"devices": 4}``; ``base:`` inheritance resolved), built by the same code as a preset file.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from lightning_shard.topology.detect import detect
from lightning_shard.topology.model import Topology
from lightning_shard.topology.presets import build_preset, from_capture, list_presets, load_preset, read_preset


def resolve(spec: str | Topology | Mapping[str, Any] | None, world: int = 1) -> Topology:
    """The :class:`Topology` ``spec`` names (see the module's docstring)."""
    if isinstance(spec, Topology):
        return spec
    if isinstance(spec, Mapping):
        return _from_node(_merged(spec))
    if spec is None or spec == "cpu":
        return load_preset("cpu", devices=world)
    if spec == "detect":
        return detect()
    if Path(spec).is_file():
        return from_capture(spec)
    if spec not in _preset_names():
        raise ValueError(f"unknown topology {spec!r}: not a preset ({', '.join(_preset_names())}), not a capture "
                         "file, not 'detect' (build a capture with: nvidia-smi topo -m > topo.txt)")
    return load_preset(spec)


@lru_cache(maxsize=64)
def _preset(name: str) -> dict[str, Any]:
    return read_preset(name)


@lru_cache(maxsize=1)
def _preset_names() -> tuple[str, ...]:
    return tuple(list_presets())


def _merged(node: Mapping[str, Any]) -> tuple:
    """A composed node's keys over its preset's (and its base's), hashable for the cache."""
    name = node.get("name")
    if not name:
        raise ValueError("topology.name is missing; choose a preset with topology=<name> "
                         f"(one of {', '.join(_preset_names())})")
    given = {k: v for k, v in node.items() if v is not None}
    base = dict(_preset(name)) if name in _preset_names() else {}
    if "base" in given:  # a composed preset that inherits: its own keys win over the base's
        base = {**_preset(given["base"]), **{k: v for k, v in base.items() if k != "base"}}
    merged = {**base, **{k: v for k, v in given.items() if k != "base"}}
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in merged.items()))


def composed_keys(node: Mapping[str, Any]) -> dict[str, Any]:
    """The keys a composed node has once its preset (and base) are merged in."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in _merged(node)}


@lru_cache(maxsize=64)
def _from_node(frozen: tuple) -> Topology:
    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in frozen}
    return build_preset(cfg, source=f"topology={cfg.get('name')}", prefix="topology.")


__all__ = ["composed_keys", "resolve"]
