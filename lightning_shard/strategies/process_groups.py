"""Process-group layout for a strategy: hybrid shard/replicate groups and the placement check at setup.

``shard_size``: ``None`` shards over every rank; an integer S makes shard groups of S consecutive ranks
(replicated across groups); ``"auto"`` takes S from the topology's islands. ``topology``: a preset name
(``conf/topology/*.yaml``), a path to an ``nvidia-smi topo -m`` capture, or ``"detect"`` (the live machine).
"""

from __future__ import annotations

import logging
import warnings
from datetime import timedelta
from typing import Optional, Union

from ..engine.comm import collectives as C
from ..engine.comm.groups import Groups
from ..topology import Topology, build_layout, check_placement

log = logging.getLogger(__name__)


def _consecutive(size: int, world: int) -> tuple[tuple[int, ...], ...]:
    """Groups of ``size`` consecutive ranks (``size`` divides ``world``): hybrid's shard groups, hpZ's islands."""
    return tuple(tuple(range(s, s + size)) for s in range(0, world, size))


def _topology_layout(knob: str, topology: Optional[Topology], world: int, num_nodes: int):
    """The topology's islands as groups of ranks, for a knob that asks for them (``knob``: how the user wrote it)."""
    if topology is None:
        name = knob.split("=")[0]
        raise ValueError(f"{knob} takes the island size from a topology: pass topology=<preset name, capture file or "
                         f"'detect'>, or an integer {name}")
    return build_layout(topology, world, nodes=num_nodes, hybrid=True)


def island_groups(secondary: Union[int, str], topology: Optional[Topology], world: int,
                  num_nodes: int) -> tuple[tuple[int, ...], ...]:
    """The ranks of each island for ``secondary_shard`` (consecutive ranks, as the shard groups of hybrid
    sharding are)."""
    if secondary == "island":
        groups = _topology_layout("secondary_shard='island'", topology, world, num_nodes).shard_groups
    else:
        if world % secondary or secondary >= world:
            raise ValueError(f"secondary_shard={secondary} must divide the world size {world} and be smaller than it "
                             f"(islands of {secondary} ranks); use one of "
                             f"{[d for d in range(2, world) if world % d == 0] or 'none: the world is too small'}")
        groups = _consecutive(secondary, world)
    if len(groups) < 2:
        raise ValueError(f"secondary_shard: one island of {world} ranks is the whole world, where the first gather "
                         "already runs: drop secondary_shard")
    return groups


def make_groups(shard_size: Union[None, int, str], topology: Optional[Topology], world: int, num_nodes: int,
                rank: int, stage: int = 2, timeout: Optional[timedelta] = None,
                secondary: Union[None, int, str] = None) -> Groups:
    """Create (collectively: every rank calls this) the shard and replicate groups this rank belongs to; at
    stages 1-3 also a copy of each shard group for parameter all-gathers, and with ``secondary``
    (``secondary_shard``) the island groups. ``timeout``: their collective timeout."""
    if shard_size is None:
        mine = Groups(gather=C.duplicate_group(None, "gather", timeout) if stage >= 1 and world > 1 else None)
        if secondary is not None and stage == 3:
            for ranks in island_groups(secondary, topology, world, num_nodes):
                g = C.new_group(list(ranks), "island", timeout)
                if rank in ranks:
                    mine.island = g
        return mine
    if shard_size == "auto":
        layout = _topology_layout("shard_size='auto'", topology, world, num_nodes)
        shard_groups, replicate_groups = layout.shard_groups, layout.replicate_groups
    else:
        if world % shard_size:
            raise ValueError(f"shard_size={shard_size} does not divide the world size {world} "
                             f"({world} % {shard_size} = "
                             f"{world % shard_size}); use one of {[d for d in range(1, world + 1) if world % d == 0]}")
        shard_groups = _consecutive(shard_size, world)
        replicate_groups = tuple(tuple(range(k, world, shard_size)) for k in range(shard_size))
    if len(shard_groups) == 1:
        raise ValueError(f"hybrid sharding with one shard group of {len(shard_groups[0])} ranks is plain sharding: "
                         "drop shard_size (or use a shard_size smaller than the world size)")
    mine = Groups(axes={"replicate": len(shard_groups), "shard": len(shard_groups[0])})
    for ranks in shard_groups:  # every rank creates every group, in the same order
        g = C.new_group(list(ranks), "shard", timeout)
        gather = C.duplicate_group(list(ranks), "gather", timeout) if stage >= 1 else None
        if rank in ranks:
            mine.shard, mine.gather = g, gather
    for ranks in replicate_groups:
        g = C.new_group(list(ranks), "replicate", timeout)
        if rank in ranks:
            mine.replicate = g
    return mine


def check_job_placement(topology: Optional[Topology], local_devices: int, stage: int, shard_size: Optional[int],
                        strict: bool) -> Optional[str]:
    """Warn once (or raise when ``strict``) if this job's traffic crosses slow links needlessly."""
    if topology is None or topology.devices_per_node < local_devices:
        return None
    traffic = "per_layer" if stage == 3 else "per_step"
    warning = check_placement(topology, list(range(local_devices)), traffic, shard_size=shard_size, strict=strict)
    if warning is not None:
        warnings.warn(str(warning), stacklevel=2)
        return str(warning)
    return None
