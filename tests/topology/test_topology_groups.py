"""Shard / replicate group layouts, best device subsets and the placement check."""

from __future__ import annotations

import pytest

from lightning_shard.topology import PlacementError, best_subset, build_layout, check_placement, load_preset
from lightning_shard.topology.model import Topology


def test_hybrid_on_fake_cpu_islands():
    layout = build_layout(load_preset("cpu_2x2"), world_size=4, hybrid=True)
    assert layout.axes == {"replicate": 2, "shard": 2}
    assert layout.shard_groups == ((0, 1), (2, 3)) and layout.replicate_groups == ((0, 2), (1, 3))
    assert layout.devices == (0, 1, 2, 3) and layout.cuda_visible_devices == ("0,1,2,3",)
    assert layout.shard_ring_gbps == 40.0 and layout.replicate_ring_gbps < 40.0


def test_full_shard_default_and_explicit_shard_size():
    full = build_layout(load_preset("hgx_h100_8"), world_size=8)
    assert full.axes == {"replicate": 1, "shard": 8} and full.replicate_groups == tuple((r,) for r in range(8))
    assert full.replicate_ring_gbps == float("inf") and full.shard_ring_gbps == 450.0
    forced = build_layout(load_preset("hgx_h100_8"), world_size=8, shard_size=4)
    assert forced.shard_groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and forced.replicate_groups[0] == (0, 4)


def test_islands_are_made_contiguous():
    """Devices chosen out of island order come back grouped by island (rank order follows)."""
    layout = build_layout(load_preset("h100_nvl_8"), world_size=4, devices=[4, 0, 5, 1], hybrid=True)
    assert layout.devices == (0, 1, 4, 5) and layout.cuda_visible_devices == ("0,1,4,5",)
    assert layout.shard_groups == ((0, 1), (2, 3)) and layout.shard_ring_gbps == 300.0
    dgx1 = build_layout(load_preset("dgx1_v100"), world_size=8)
    assert dgx1.devices == (0, 3, 2, 1, 5, 6, 7, 4) and dgx1.shard_ring_gbps == 50.0  # the NV2 ring


def test_multi_node_groups():
    two = build_layout(load_preset("hgx_h100_2nodes_ib"), world_size=16, nodes=2, hybrid=True)
    assert two.axes == {"replicate": 2, "shard": 8}
    assert two.shard_groups == (tuple(range(8)), tuple(range(8, 16)))
    assert two.replicate_groups[3] == (3, 11) and two.replicate_ring_gbps == 50.0
    assert two.cuda_visible_devices == ("0,1,2,3,4,5,6,7",) * 2
    # a one-node preset is replicated per node; nodes x islands
    nvl = build_layout(load_preset("h100_nvl_8"), world_size=16, nodes=2, hybrid=True)
    assert nvl.axes == {"replicate": 8, "shard": 2} and nvl.devices[8] == 8
    cpu = build_layout(load_preset("cpu", devices=2), world_size=4, nodes=2, hybrid=True)
    assert cpu.axes == {"replicate": 2, "shard": 2} and cpu.shard_groups == ((0, 1), (2, 3))


@pytest.mark.parametrize(
    "preset, kwargs, words",
    [
        ("hgx_h100_8", dict(world_size=4),
         "8 devices per node but the job runs 4 ranks per node.*CUDA_VISIBLE_DEVICES=0,1,2,3"),
        ("a100_pcie_4_pairs", dict(world_size=8), "4 devices per node but the job runs 8.*use a preset with 8 devices"),
        ("hgx_h100_8", dict(world_size=8, shard_size=3),
         r"shard group size 3 does not divide world size 8 \(8 % 3 = 2\): use one of \[1, 2, 4, 8\]"),
        ("hgx_h100_8", dict(world_size=8, hybrid=True),
         "hybrid sharding needs at least 2 islands.*one nvswitch island: use full sharding"),
        ("hgx_h100_8", dict(world_size=6, nodes=4), r"world_size 6 is not a multiple of nodes 4 \(6 % 4 = 2\)"),
        ("hgx_h100_2nodes_ib", dict(world_size=24, nodes=3), "has 2 nodes but the job asks for 3"),
        ("h100_nvl_8", dict(world_size=3, devices=[0, 1, 2], hybrid=True), r"islands of sizes \[2, 1\]"),
        ("h100_nvl_8", dict(world_size=2, devices=[0, 9]), "distinct local indices in 0..7"),
    ],
)
def test_layout_errors_name_the_fix(preset, kwargs, words):
    with pytest.raises(ValueError, match=words):
        build_layout(load_preset(preset), **kwargs)


def test_best_subset():
    nvl = load_preset("h100_nvl_8")
    assert best_subset(nvl, 2).cuda_visible_devices == "0,1" and best_subset(nvl, 2).ring_gbps == 300.0
    four = best_subset(nvl, 4)  # two pairs on one socket (NODE) beat pairs across sockets (SYS)
    assert four.devices == (0, 1, 2, 3) and four.ring_gbps == 63.0
    assert best_subset(load_preset("pcie_8"), 2).cuda_visible_devices == "0,1"  # PIX pair
    assert best_subset(load_preset("dgx1_v100"), 2).ring_gbps == 50.0  # an NV2 pair
    sub = best_subset(nvl.subset([6, 7, 0, 2]), 2)  # names follow the physical GPUs
    assert sub.cuda_visible_devices == "6,7"
    with pytest.raises(ValueError, match="cannot pick 9 devices"):
        best_subset(nvl, 9)


def test_best_subset_large_box_is_fast():
    rows = [["X" if i == j else ("NV6" if i // 8 == j // 8 else "SYS") for j in range(16)] for i in range(16)]
    big = Topology.from_tokens("two_switch_halves", rows)
    sub = best_subset(big, 8)  # C(16, 8) = 12870: island heuristic, not brute force
    assert sub.devices == tuple(range(8)) and sub.ring_gbps == 150.0


def test_placement_across_nvl_pairs_warns_and_names_a_better_placement():
    nvl = load_preset("h100_nvl_8")
    w = check_placement(nvl, [0, 1, 4, 5], "per_step")  # pairs across sockets
    assert w.cuda_visible_devices == "0,1,2,3" and w.slowdown == pytest.approx(63.0 / 51.66, rel=1e-3)
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in str(w) and "1.2x" in str(w)
    z3 = check_placement(nvl, [0, 1, 2, 3], "per_layer")  # zero3 over two pairs: shard inside pairs instead
    assert z3.hybrid_shard_size == 2 and z3.slowdown == pytest.approx(300.0 / 63.0, rel=1e-3)
    assert "shard_size=2" in str(z3) and "4.8x" in str(z3)
    with pytest.raises(PlacementError, match="CUDA_VISIBLE_DEVICES=0,1,2,3"):
        check_placement(nvl, [0, 1, 4, 5], "per_step", strict=True)
    assert isinstance(PlacementError("x"), ValueError)


def test_placement_quiet_when_nothing_is_better():
    nvl = load_preset("h100_nvl_8")
    assert check_placement(nvl, [0, 1], "per_layer") is None  # inside one island
    assert check_placement(nvl, [0, 1, 2, 3], "per_step") is None  # already the best 4
    assert check_placement(nvl, [0, 1, 2, 3], "per_layer", shard_size=2) is None  # hybrid keeps per-layer inside
    assert check_placement(load_preset("pcie_8"), list(range(8)), "per_layer") is None  # no fast links anywhere
    assert check_placement(load_preset("hgx_h100_8"), [0, 5], "per_layer") is None


def test_placement_bad_input():
    nvl = load_preset("h100_nvl_8")
    with pytest.raises(ValueError, match="traffic='weekly'"):
        check_placement(nvl, [0, 1], "weekly")
    with pytest.raises(ValueError, match="shard group size 3 does not divide the job's 4 ranks"):
        check_placement(nvl, [0, 1, 2, 3], "per_layer", shard_size=3)
    with pytest.raises(ValueError, match="must be distinct"):
        check_placement(nvl, [0, 0], "per_step")
