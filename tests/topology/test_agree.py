"""The nodes of a job agree on their machine, or the one that differs is named (``topology/agree.py``): summaries of
real captures, and the message."""

from __future__ import annotations

from pathlib import Path

from lightning_shard.topology.agree import disagreement, node_summary
from lightning_shard.topology.resolve import resolve

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "topology"


def test_summaries_tell_machines_apart_and_equal_machines_agree():
    nvswitch = node_summary(resolve(str(ASSETS / "f03_h100_sxm_nvswitch_tabs.txt")))
    pairs = node_summary(resolve(str(ASSETS / "f08_h100_nvl_pairs.txt")))
    assert nvswitch == "8 x gpu; pairs: NV18 x 28"
    assert pairs == "8 x gpu; pairs: NODE x 8, NV12 x 4, SYS x 16"
    two_nodes = resolve("hgx_h100_2nodes_ib")
    assert node_summary(two_nodes, 0) == node_summary(two_nodes, 1)
    assert disagreement([(0, "a", nvswitch), (1, "b", nvswitch)]) is None
    message = disagreement([(1, "b", pairs), (0, "a", nvswitch), (2, "c", nvswitch), (3, "d", pairs)])
    assert "node 0 (a): 8 x gpu; pairs: NV18 x 28" in message
    assert "node 1 (b): 8 x gpu; pairs: NODE x 8" in message and "node 3 (d)" in message and "node 2" not in message


def test_fewer_devices_on_a_node_is_a_difference():
    assert disagreement([(0, "a", node_summary(resolve("cpu", 4))), (1, "b", node_summary(resolve("cpu", 2)))])
