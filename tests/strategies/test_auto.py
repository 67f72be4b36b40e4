"""strategy=auto: the planner chooses at setup; whatever it picks trains in parity with one process."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from tests.harness import fresh_world
from tests.scenarios import fit_zero
from tests.zoo import max_diff, params_of, reference_fit


def test_auto_strategy_chooses_and_matches_reference():
    with fresh_world(2) as w:
        res = w.run(fit_zero, "auto", "auto", 3, model="tiny_lm", strategy_kwargs={"topology": "cpu"})
    ref, _ = reference_fit(5, 3, 2, model="tiny_lm")
    assert res[0]["chosen"] in ("zero0", "zero1", "zero2", "zero3", "fsdp_shard")
    assert res[0]["chosen"] == res[1]["chosen"]
    for r in res:
        assert max_diff(params_of(r["state"]), params_of(ref)) <= 1e-5
    assert "zero_auto" in StrategyRegistry
