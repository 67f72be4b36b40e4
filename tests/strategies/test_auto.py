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


def test_auto_with_calibration_measures_in_the_job_and_checks_its_prediction(tmp_path):
    """strategy=auto with calibrate=True: every rank measures on the job's own group, rank 0 writes the profile, both
    ranks pick the same row by the calibrated model, train it in parity with one process, and the step check logs the
    calibrated prediction beside a measured step. A second job reuses the profile (nothing measured)."""
    from lightning_shard.planner.profile import load_profile

    path = tmp_path / "profile.json"
    kw = {"topology": "cpu", "calibrate": True, "profile": str(path), "check_after_steps": 2}
    with fresh_world(2) as w:
        res = w.run(fit_zero, "auto", "auto", 1, steps=4, model="tiny_lm", strategy_kwargs=kw)
    prof, why = load_profile(path)
    assert why == "" and prof.machine["world"] == 2 and prof.collectives
    assert res[0]["chosen"] == res[1]["chosen"]
    assert res[0]["step_check"] is not None, "no predicted-vs-measured step check ran"
    predicted, measured, model = res[0]["step_check"]
    assert model == "calibrated" and predicted > 0 and measured > 0
    ref, _ = reference_fit(4, 1, 2, model="tiny_lm")
    for r in res:
        assert max_diff(params_of(r["state"]), params_of(ref)) <= 1e-5
    before = path.stat().st_mtime_ns
    with fresh_world(2) as w:
        again = w.run(fit_zero, "auto", "auto", 1, steps=4, model="tiny_lm", strategy_kwargs=kw)
    assert path.stat().st_mtime_ns == before  # reused: not measured, not written again
    assert again[0]["chosen"] == res[0]["chosen"]
