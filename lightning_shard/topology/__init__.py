"""Machine topology: parse / detect / describe machines; device groups and placement checks.

    from lightning_shard.topology import load_preset, from_capture, detect, build_layout, check_placement
"""

from lightning_shard.topology.detect import detect
from lightning_shard.topology.errors import NotATopologyMatrix, TopologyParseError
from lightning_shard.topology.groups import GroupLayout, Subset, best_subset, build_layout
from lightning_shard.topology.links import Fabric, Link, LinkClass
from lightning_shard.topology.model import Device, Island, Topology
from lightning_shard.topology.parse import parse_topo
from lightning_shard.topology.placement import PlacementError, PlacementWarning, check_placement
from lightning_shard.topology.presets import from_capture, list_presets, load_preset

__all__ = [
    "Device", "Fabric", "GroupLayout", "Island", "Link", "LinkClass", "NotATopologyMatrix", "PlacementError",
    "PlacementWarning", "Subset", "Topology", "TopologyParseError", "best_subset", "build_layout",
    "check_placement", "detect", "from_capture", "list_presets", "load_preset", "parse_topo",
]
