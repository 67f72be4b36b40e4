"""hpZ, ``secondary_shard`` (issue 14): each unit's first gather of an optimizer step runs over every rank; its other
gathers until the step run inside the island from the copies kept then. It moves the same values, so the result is
that of one process as tightly as without it (1e-5, DEFAULT knobs otherwise, models nobody on the project wrote,
rank 0's ``model.state_dict()`` after fit), and the ledger shows where each gather ran."""

from __future__ import annotations

from collections import Counter
from typing import Any

import lightning as L
import pytest

from lightning_shard.engine.comm import collectives as C
from tests.foreign import fit_foreign
from tests.strategies.test_foreign_models import STEPS, TOL, check, reference


class StepMarks(L.Callback):
    """The ledger's position at each optimizer step: the parameter gathers between two marks belong to one window
    (the post-step gathers a step issues open the next one)."""

    def __init__(self) -> None:
        self.marks: list[int] = []

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.marks.append(C.LEDGER.mark())


def fit_counting(name: str, strategy: Any, acc: int, knobs: dict | None) -> dict[str, Any]:
    """Fit, then the ledger's parameter gathers: their groups in all, and per optimizer window (before the first
    step, between two steps, after the last) each bucket's gathers in order, as the group each ran on."""
    start, steps = C.LEDGER.mark(), StepMarks()
    out = fit_foreign(name, strategy, STEPS, acc, strategy_kwargs=knobs, callbacks=[steps])
    entries = C.LEDGER.since(start)
    windows: list[dict[str, list[str]]] = []
    lo = 0
    for hi in [m - start for m in steps.marks] + [len(entries)]:
        per_bucket: dict[str, list[str]] = {}
        for e in entries[lo:hi]:
            if e.tag.startswith("unshard_"):
                per_bucket.setdefault(e.tag, []).append(e.group)
        windows.append(per_bucket)
        lo = hi
    gathers = Counter(e.group for e in entries if e.tag.startswith("unshard_"))
    return {"state": out["state"], "gathers": gathers, "windows": windows}


def island_gathers(r: dict[str, Any]) -> int:
    """Asserts, window by window and bucket by bucket, that the first gather ran over every rank ("gather" group)
    and every later one inside the island ("island" group); returns how many ran in the island."""
    assert len(r["windows"]) == STEPS + 1, len(r["windows"])
    island = 0
    for w, per_bucket in enumerate(r["windows"]):
        assert per_bucket, f"window {w}: no parameter gather"
        for tag, groups in per_bucket.items():
            assert groups[0] == "gather" and all(g == "island" for g in groups[1:]), (w, tag, groups)
            island += len(groups) - 1
    return island


@pytest.mark.parametrize("strategy", ["zero3", "fsdp_shard"])
@pytest.mark.parametrize("name", ["torch_mha", "hf_gpt2", "hf_gpt2_lora", "routed"])
def test_island_gathers_match_one_process(worlds, name, strategy):
    acc = 3
    res = worlds(4).run(fit_counting, name, strategy, acc, {"secondary_shard": 2})
    check(name, res[0]["state"], reference(name, acc, 4), TOL)
    for r in res:  # per step and bucket: 1 gather over the world, the others (up to 2 * acc - 1) in the island
        world, island = r["gathers"]["gather"], r["gathers"]["island"]
        assert 0 < world < island <= (2 * acc - 1) * world, r["gathers"]
        assert island_gathers(r) == island


@pytest.mark.parametrize("knobs", [{"activation_checkpointing": "auto"}, {"accumulation": "keep_params"},
                                   {"tuning": {"reshard_after_forward": False}}, {"tuning": {"prefetch_depth": 0}}])
def test_island_gathers_with_the_other_stage3_options(worlds, knobs):
    """Recomputation in backward, parameters kept over the window, no reshard after forward, no prefetch: the
    gathers that remain still come from the island copies, and the result is still one process's."""
    res = worlds(4).run(fit_counting, "hf_gpt2", "zero3", 3, dict(knobs, secondary_shard=2))
    check("hf_gpt2", res[0]["state"], reference("hf_gpt2", 3, 4), TOL)
    assert res[0]["gathers"]["gather"] > 0
    for r in res:  # keep_params holds each unit over the window: its first gather is its only one
        assert (island_gathers(r) > 0) == (knobs != {"accumulation": "keep_params"}), r["windows"]


def test_island_from_the_topology(worlds):
    """``secondary_shard="island"`` takes the island size from the topology (cpu_2x2: two islands of two)."""
    res = worlds(4).run(fit_counting, "hf_gpt2", "zero3", 3, {"secondary_shard": "island", "topology": "cpu_2x2"})
    check("hf_gpt2", res[0]["state"], reference("hf_gpt2", 3, 4), TOL)
    assert res[0]["gathers"]["island"] > res[0]["gathers"]["gather"] > 0
    assert all(island_gathers(r) > 0 for r in res)


def test_with_int8_gathers_the_island_copies_are_the_dequantized_values(worlds):
    """The first gather is quantized, the island gathers repeat its values: close to one process as int8 gathers
    alone are (tests/strategies/test_quant_lightning.py bounds), and nothing stays in the island copies after fit."""
    knobs = {"secondary_shard": 2, "compression": {"gather_quant": "int8"}}
    res = worlds(4).run(fit_counting, "torch_mha", "zero3", 3, knobs)
    check("torch_mha", res[0]["state"], reference("torch_mha", 3, 4), 6e-3)
    assert all(island_gathers(r) > 0 for r in res)


@pytest.mark.parametrize("knobs,match", [
    ({"secondary_shard": 3}, "must divide the world size 4"),
    ({"secondary_shard": 4}, "must divide the world size 4 and be smaller"),
    ({"secondary_shard": 2, "shard_size": 2}, "hybrid sharding already keeps every parameter gather"),
    ({"secondary_shard": "island"}, "takes the island size from a topology"),
    ({"secondary_shard": 1}, "an integer >= 2"),
])
def test_bad_secondary_shard_is_refused_with_the_fix(knobs, match):
    from lightning_shard.strategies import Zero3Strategy
    from lightning_shard.strategies.process_groups import island_groups

    if "shard_size" in knobs or knobs["secondary_shard"] == 1:
        with pytest.raises(ValueError, match=match):
            Zero3Strategy(**knobs)
        return
    with pytest.raises(ValueError, match=match):
        island_groups(knobs["secondary_shard"], None, 4, 1)


def fit_auto_with_hpz() -> dict[str, Any]:
    """strategy=auto whose planner row carries secondary_shard (as on two nodes): the island groups are made and
    used, not silently dropped."""
    from lightning_shard.planner.recommend import Recommendation
    from lightning_shard.strategies import AutoStrategy

    class PlannedHpZ(AutoStrategy):
        def recommend(self, accumulate_grad_batches: int = 1) -> Recommendation:
            return Recommendation("zero3", {"accumulation": "keep_unsharded_grads", "secondary_shard": 2},
                                  "test: a row with hpZ", [])

    return fit_counting("hf_gpt2", PlannedHpZ(topology=None), 3, None)


def test_strategy_auto_applies_a_planned_secondary_shard(worlds):
    res = worlds(4).run(fit_auto_with_hpz)
    check("hf_gpt2", res[0]["state"], reference("hf_gpt2", 3, 4), TOL)
    assert res[0]["gathers"]["island"] > res[0]["gathers"]["gather"] > 0
    assert all(island_gathers(r) > 0 for r in res)
