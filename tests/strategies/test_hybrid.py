"""Hybrid sharding on 4 gloo ranks as 2 fake islands x 2 (topology preset cpu_2x2): parity and per-axis traffic."""

from __future__ import annotations

import functools

import pytest

from tests.harness import fresh_world
from tests.scenarios import fit_zero
from tests.zoo import max_diff, params_of, reference_fit

HYBRID = {"shard_size": "auto", "topology": "cpu_2x2"}
CASES = {
    "zero2_hybrid": (2, "per_micro_batch", {}),
    "zero2_hybrid-defer": (2, "defer", {}),
    "zero3_hybrid": (3, "per_micro_batch", {}),
    "zero3_hybrid-keep_params": (3, "keep_params", {}),
    "fsdp_shard_hybrid": (3, "keep_unsharded_grads", {"wrap_classes": ["Block"]}),
}


@pytest.fixture(scope="module")
def world4(worlds):
    return worlds(4)  # the shared per-module World (conftest.py)


@functools.lru_cache(maxsize=None)
def reference(acc: int):
    return reference_fit(5, acc, 4, model="tiny_lm")


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_parity_and_traffic_per_axis(world4, name):
    stage, policy, extra = CASES[name]
    acc = 3
    results = world4.run(fit_zero, stage, policy, acc, model="tiny_lm", strategy_kwargs=dict(HYBRID, **extra))
    ref, _ = reference(acc)
    for r in results:
        assert r["axes"] == {"replicate": 2, "shard": 2}
        assert max_diff(params_of(r["state"]), params_of(ref)) <= 1e-5
    res = results[0]
    padded_grad_bytes = sum(res["bucket_padded"]) * 4
    for i, entries in enumerate(res["per_batch_groups"]):
        boundary = (i + 1) % acc == 0
        replicate = [e for e in entries if e[2] == "replicate"]
        world = [e for e in entries
                 if e[2] == "world" and not e[1].startswith(("buffers", "used_mask", "unit_discovery"))]
        assert world == [], (f"micro-batch {i}: gradient/parameter traffic must stay on the "
                             f"shard/replicate axes: {world}")
        if not boundary:
            assert replicate == [], f"micro-batch {i} is not a boundary but crossed islands: {replicate}"
        else:
            assert {op for op, *_ in replicate} == {"all_reduce"}
            # one all-reduce of this rank's shard per bucket: 1/shard-size of the (padded) gradient bytes
            assert sum(b for *_, b in replicate) == padded_grad_bytes // 2


@pytest.mark.parametrize("name", ["zero2_hybrid-defer", "zero3_hybrid"])
def test_hybrid_gathers_as_broadcasts_inside_the_shard_group(world4, name):
    """``all_gather_via="broadcast"`` in shard groups of 2 out of 4 ranks: each broadcast's source is the group's
    member as a global rank; the same weights as one process, and the gathers' broadcasts stay on the shard axis."""
    stage, policy, extra = CASES[name]
    acc = 3
    results = world4.run(fit_zero, stage, policy, acc, model="tiny_lm",
                         strategy_kwargs=dict(HYBRID, comm={"all_gather": "broadcast"}, **extra))
    ref, _ = reference(acc)
    for r in results:
        assert r["gather_paths"] == ["broadcast"] and set(r["gather_calls"]) == {"broadcast"}
        assert max_diff(params_of(r["state"]), params_of(ref)) <= 1e-5
        gathers = {g for entries in r["per_batch_groups"] for op, _, g, _ in entries if op == "all_gather"}
        assert gathers and gathers <= {"shard", "gather"}, gathers


def test_hybrid_on_a_single_island_is_refused(world4):
    with pytest.raises(RuntimeError, match="hybrid sharding needs at least 2 islands"):
        world4.run(fit_zero, 2, "defer", 1, model="tiny_lm", strategy_kwargs={"shard_size": "auto", "topology": "cpu"})


def test_shard_size_must_divide_world(world4):
    with pytest.raises(RuntimeError, match="shard_size=3 does not divide the world size 4"):
        world4.run(fit_zero, 2, "defer", 1, model="tiny_lm", strategy_kwargs={"shard_size": 3})


def test_two_local_nodes_build_node_aware_groups_and_match():
    """Two simulated nodes of 2 ranks (NODE_RANK/LOCAL_RANK as torchrun sets them): with the per-node `cpu`
    topology, shard_size='auto' shards inside each node and replicates across nodes; training matches."""
    with fresh_world(4, nodes=2) as w:
        results = w.run(fit_zero, 3, "per_micro_batch", 3, model="tiny_lm", num_nodes=2,
                        strategy_kwargs={"shard_size": "auto", "topology": "cpu", "wrap_classes": ["Block"]})
    ref, _ = reference(3)
    for r in results:
        assert r["axes"] == {"replicate": 2, "shard": 2}
        assert max_diff(params_of(r["state"]), params_of(ref)) <= 1e-5
    for i, entries in enumerate(results[0]["per_batch_groups"]):
        assert all(g != "replicate" for _, _, g, _ in entries) or (i + 1) % 3 == 0


def test_placement_across_nvl_pairs_warns_and_strict_raises():
    from lightning_shard.strategies.process_groups import check_job_placement
    from lightning_shard.topology import PlacementError, load_preset

    topo = load_preset("h100_nvl_8")
    # 4 ranks = two NVL pairs: what is slow (the link class and its speed against the islands'), by how much, and
    # the fix (the knob and its value); the warning adds how to make it an error, the error does not
    problem = ("placement: ranks on GPU0, GPU1, GPU2, GPU3 span islands joined by numa_node (63 GB/s per direction); "
               "the per-layer (zero3 / fsdp) traffic runs at that speed instead of 300 GB/s, an estimated 4.8x slower "
               "collectives. Fix: use hybrid sharding with shard_size=2 (zero3_hybrid / fsdp_shard_hybrid: shard "
               "inside each 2-device island at 300 GB/s, replicate across)")
    with pytest.warns(UserWarning) as caught:
        msg = check_job_placement(topo, 4, stage=3, shard_size=None, strict=False)
    assert msg == problem + "; strict_placement=True makes this an error"
    assert [str(w.message) for w in caught] == [msg]
    with pytest.raises(PlacementError) as err:
        check_job_placement(topo, 4, stage=3, shard_size=None, strict=True)
    assert str(err.value) == problem
    assert check_job_placement(topo, 2, stage=3, shard_size=None, strict=True) is None  # one pair: fine
