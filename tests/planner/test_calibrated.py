"""The calibrated time model and its machine profile (planner/profile.py, planner/calibrate.py, planner/time.py).

Rates here are synthetic (a profile written by hand) where the test is about the model's arithmetic, and measured
(a real calibration on 2 CPU ranks) where it is about measuring, caching and reuse. No timing thresholds: a
measured profile is checked for what it holds, not for how fast this machine is.
"""

from __future__ import annotations

import json

import pytest

from lightning_shard.planner import plan
from lightning_shard.planner.calibrate import ladder, model_signature, monotone
from lightning_shard.planner.evaluate import collectives_of
from lightning_shard.planner.models import build_gpt
from lightning_shard.planner.placement import place
from lightning_shard.planner.profile import OPS, Curve, MachineProfile, library_versions, load_profile, profile_path
from lightning_shard.planner.time import profile_op
from lightning_shard.topology.resolve import resolve

MICRO, WORLD = 4, 2


def tiny():
    return build_gpt(4, 64, 4, 64, 256)


def link_class(world: int = WORLD) -> str:
    placement = place(resolve("cpu", world), world)
    return placement.ring(range(world)).link_class


def synthetic(latency: float, overlap: float, compute=(0.01, 0.02), world: int = WORLD,
              per_op=None) -> MachineProfile:
    """Every collective costs ``latency`` per call plus 1 GB/s; compute as given for the tiny model; the engine's
    own cost per bucket operation ``per_op`` (None: not measured)."""
    curves = {f"{op}/{world}/{link_class(world)}": Curve([4096, 2**30], [latency, latency + 2**30 / 1e9])
              for op in OPS}
    prof = MachineProfile({"device": "test"}, library_versions(), curves, matmul_flops=1e10,
                          optimizer_s_per_element=1e-9, overlap=overlap, engine_s_per_call=per_op)
    from lightning_shard.planner.config import Job
    from lightning_shard.planner.stats import transformer_shape

    module = tiny()
    job = Job(world=world, micro_batch=MICRO, accumulation=1, seq=64, precision="32-true")
    prof.compute[model_signature(module, transformer_shape(module), job)] = list(compute)
    return prof


def by_label(res):
    return {r.label: r for r in res.rows}


def test_curve_interpolates_between_rungs_and_continues_the_top_bandwidth():
    c = Curve([100, 200, 400], [1.0, 2.0, 3.0])
    assert c(50) == 1.0  # below the first rung: the per-call fixed cost
    assert c(150) == pytest.approx(1.5)
    assert c(300) == pytest.approx(2.5)
    assert c(800) == pytest.approx(5.0)  # 1 s per 200 bytes above the top rung
    assert c.latency_s == 1.0 and c.bandwidth == pytest.approx(200.0)
    assert monotone([3.0, 1.0, 2.0, 5.0]) == [1.0, 1.0, 2.0, 5.0]
    assert ladder(10) == [4096, 16384] and ladder(2**20)[-1] == 2**20


def test_calibrated_step_is_compute_plus_every_call_when_nothing_overlaps():
    """overlap 0: the step is the measured compute, the optimizer on the rank's shard, and each collective's curve at
    its bytes (fixed cost included), whatever the schedule could have hidden."""
    prof = synthetic(latency=2e-3, overlap=0.0)
    res = plan(tiny(), "cpu", WORLD, MICRO * WORLD, MICRO, "32-true", profile=prof)
    ctx = res.context
    assert ctx.calibrated and ctx.rates.compute == (0.01, 0.02)
    psi = ctx.psi
    for row in res.rows:
        colls = collectives_of(ctx, row.config)[1]
        comm = sum(prof.collective(profile_op(c, row.config), c.world, link_class())(c.bytes) for c in colls
                   if c.world > 1)
        opt = psi / (1 if row.config.stage == 0 else WORLD) * 1e-9
        assert row.time.compute == pytest.approx(0.03 + opt), row.label
        assert row.time.total == pytest.approx(0.03 + opt + comm), row.label


def test_a_bucket_operation_pays_the_engine_measured_fixed_cost_instead_of_the_bare_call():
    """With the engine's cost per bucket operation measured (it holds the collective's fixed cost as the engine meets
    it), a bucket operation's collective is priced by its bytes only and the operation by that cost; the step's
    small collectives (used-mask all-reduce, buffer broadcasts) keep their whole curve."""
    prof = synthetic(latency=2e-3, overlap=0.0, per_op=3e-3)
    res = plan(tiny(), "cpu", WORLD, MICRO * WORLD, MICRO, "32-true", profile=prof)
    ctx = res.context
    for row in res.rows:
        colls = collectives_of(ctx, row.config)[1]
        bucket = [c for c in colls if c.kind in ("unshard", "grad", "param")]
        other = [c for c in colls if c not in bucket and c.world > 1]
        curve = prof.collective("gather", WORLD, link_class())  # every op's curve is the same here
        comm = sum(curve(c.bytes) - 2e-3 for c in bucket if c.world > 1) + sum(curve(c.bytes) for c in other)
        assert row.time.engine == pytest.approx(3e-3 * len(bucket)), row.label
        assert row.time.total == pytest.approx(row.time.compute + comm + 3e-3 * len(bucket)), row.label


def test_stage3_rows_pay_the_cost_measured_on_the_model_own_units():
    """With the engine's cost per stage-3 bucket operation measured on this model's blocks (``unit_ops``), zero3 and
    fsdp_shard pay it per unit operation instead of the probe's per-operation cost; stages 0-2 keep the probe's."""
    from lightning_shard.planner.config import Job
    from lightning_shard.planner.stats import transformer_shape

    prof = synthetic(latency=2e-3, overlap=0.0, per_op=3e-3)
    base = by_label(plan(tiny(), "cpu", WORLD, MICRO * WORLD, MICRO, "32-true", profile=prof))
    job = Job(world=WORLD, micro_batch=MICRO, accumulation=1, seq=64, precision="32-true")
    prof.unit_ops[model_signature(tiny(), transformer_shape(tiny()), job)] = 7e-3
    res = plan(tiny(), "cpu", WORLD, MICRO * WORLD, MICRO, "32-true", profile=prof)
    assert res.context.rates.unit_op_s == 7e-3
    for row in res.rows:
        ops = [c for c in collectives_of(res.context, row.config)[1] if c.kind in ("unshard", "grad", "param")]
        before = base[row.label].time
        if row.config.stage == 3:
            assert row.time.engine == pytest.approx(7e-3 * len(ops)), row.label
            assert row.time.total == pytest.approx(before.total + 4e-3 * len(ops)), row.label
        else:
            assert row.time.total == pytest.approx(before.total), row.label


def test_fixed_cost_per_call_ranks_many_small_units_below_few_large_ones():
    """zero3 gathers and reduces one unit per module with parameters, fsdp_shard one per block: with a per-call cost
    the calibrated model puts zero3 behind by about the extra calls x that cost; the nominal model (no such cost
    worth counting on a fast link) cannot tell them apart."""
    prof = synthetic(latency=5e-3, overlap=0.0)
    cal = by_label(plan(tiny(), "cpu", WORLD, MICRO * WORLD, MICRO, "32-true", profile=prof))
    z3, fs = cal["zero3 (per_micro_batch)"], cal["fsdp_shard (per_micro_batch)"]
    ctx = plan(tiny(), "cpu", WORLD, MICRO * WORLD, MICRO, "32-true", profile=prof).context
    calls = {label: sum(c.world > 1 for c in collectives_of(ctx, r.config)[1]) for label, r in cal.items()}
    extra = calls["zero3 (per_micro_batch)"] - calls["fsdp_shard (per_micro_batch)"]
    assert extra > 0
    assert z3.time.total - fs.time.total == pytest.approx(extra * 5e-3, rel=0.05)
    nominal = by_label(plan(tiny(), "cpu", WORLD, MICRO * WORLD, MICRO, "32-true"))
    nz3, nfs = nominal["zero3 (per_micro_batch)"], nominal["fsdp_shard (per_micro_batch)"]
    assert abs(nz3.time.total / nfs.time.total - 1) < 0.01


def test_overlap_hides_only_what_the_schedule_allows():
    """overlap 1: the schedule's hiding (fsdp_shard's gathers prefetched behind the previous unit's compute) counts in
    full; overlap 0: none of it; in between, in proportion. The step is never below compute."""
    steps = {}
    for ov in (0.0, 0.5, 1.0):
        res = plan(tiny(), "cpu", WORLD, MICRO * WORLD, MICRO, "32-true", profile=synthetic(1e-3, ov))
        steps[ov] = by_label(res)["fsdp_shard (per_micro_batch)"].time
    assert steps[0.0].exposed_comm == pytest.approx(steps[0.0].total_comm)
    assert steps[1.0].exposed_comm < steps[0.0].exposed_comm
    assert steps[0.5].exposed_comm == pytest.approx((steps[0.0].exposed_comm + steps[1.0].exposed_comm) / 2)
    assert steps[1.0].total >= steps[1.0].compute


def test_a_profile_round_trips_and_goes_stale_when_the_libraries_change(tmp_path):
    prof = synthetic(1e-3, 0.5)
    path = prof.save(tmp_path / "p.json")
    back, why = load_profile(path)
    assert why == "" and back.to_json() == prof.to_json()
    doc = json.loads(path.read_text())
    doc["versions"]["torch"] = "0.0.1"
    path.write_text(json.dumps(doc))
    back, why = load_profile(path)
    assert back is None and why.startswith("stale profile (torch 0.0.1 -> ")
    assert load_profile(tmp_path / "none.json") == (None, "no profile yet")
    machine = {"device": "x", "backend": "gloo", "world": 2, "threads": 1, "topology": "cpu"}
    assert profile_path(machine) == profile_path(dict(machine))
    assert profile_path(machine) != profile_path({**machine, "world": 4})


def test_calibration_measures_once_then_reuses_and_remeasures_a_stale_profile(tmp_path):
    """A real calibration on 2 CPU ranks: every collective path of the world group, this model's compute, the
    optimizer and the overlap are in the profile; planning again reuses it; a profile of other library versions is
    measured again."""
    path = tmp_path / "profile.json"
    first = plan(tiny(), "cpu", WORLD, MICRO * WORLD, MICRO, "32-true", calibrate=True, profile_path=str(path))
    assert first.calibration.startswith("measured everything"), first.calibration
    prof, why = load_profile(path)
    assert why == ""
    assert {k.split("/")[0] for k in prof.collectives} == set(OPS)
    assert all(c.sizes == sorted(c.sizes) and c.seconds == monotone(c.seconds) and min(c.seconds) > 0
               for c in prof.collectives.values())
    assert len(prof.compute) == 1 and all(t > 0 for t in next(iter(prof.compute.values())))
    assert list(prof.unit_ops) == list(prof.compute) and next(iter(prof.unit_ops.values())) >= 0
    assert first.context.rates.unit_op_s == next(iter(prof.unit_ops.values()))
    assert prof.matmul_flops > 0 and prof.optimizer_s_per_element > 0 and 0 <= prof.overlap <= 1
    assert first.context.calibrated and first.context.rates.compute is not None
    again = plan(tiny(), "cpu", WORLD, MICRO * WORLD, MICRO, "32-true", calibrate=True, profile_path=str(path))
    assert again.calibration == f"reused {path}"
    assert [r.time.total for r in again.rows] == [r.time.total for r in first.rows]
    # another model on the same machine: only its compute is measured
    other = plan(build_gpt(2, 64, 4, 64, 256), "cpu", WORLD, MICRO * WORLD, MICRO, "32-true", calibrate=True,
                 profile_path=str(path))
    assert other.calibration.startswith("measured this model's compute, the engine's cost on this model's units in"), \
        other.calibration
    assert len(load_profile(path)[0].compute) == 2 and len(load_profile(path)[0].unit_ops) == 2
    doc = json.loads(path.read_text())
    doc["versions"]["lightning_shard"] = "0.0.0"
    path.write_text(json.dumps(doc))
    stale = plan(tiny(), "cpu", WORLD, MICRO * WORLD, MICRO, "32-true", calibrate=True, profile_path=str(path))
    assert "stale profile (lightning_shard 0.0.0 -> " in stale.calibration


def test_cli_plan_calibrate_writes_reuses_and_says_which_model(tmp_path, capsys):
    """`plan --calibrate`: the table is timed by the calibrated model (``--json``: ``time_model``), stderr says what
    calibration did, a second run reuses the profile; --profile without --calibrate and --calibrate of two presets
    are refused with the fix."""
    from lightning_shard.cli import main

    path = tmp_path / "p.json"
    args = ["plan", "gpt_test", "--preset", "cpu", "--gpus", "2", "--calibrate", "--profile", str(path)]
    assert main(args + ["--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)[0]
    assert doc["time_model"] == "calibrated" and doc["calibration"].startswith("measured everything")
    assert "calibration: measured everything" in out.err and path.is_file()
    assert main(args) == 0
    out = capsys.readouterr()
    assert f"calibration: reused {path}" in out.err
    text = " ".join(out.out.split())  # however rich wrapped it
    assert "Time: calibrated on this machine" in text
    assert "(calibrated)," in text and "(nominal)" not in text  # the title names the profile's device
    assert main(["plan", "gpt_test", "--preset", "cpu", "--profile", str(path)]) == 2
    assert "--profile is the calibrated model's machine profile: add --calibrate" in capsys.readouterr().err
    assert main(["plan", "gpt_test", "--preset", "cpu", "--preset", "cpu_2x2", "--calibrate"]) == 2
    assert "plan one topology" in capsys.readouterr().err


def probe_collectives() -> dict:
    """Scenario (every rank): collectives per step of the engine probe on the world group and on a group of this rank
    alone, and which probe runs the engine measurement makes on which group."""
    import torch

    from lightning_shard.engine.comm import collectives as C
    from lightning_shard.planner import calibrate

    cpu = torch.device("cpu")
    solo = [C.new_group([r], "calibrate/solo") for r in range(C.get_world_size())][C.get_rank()]
    runs, probe = [], calibrate._probe_step_s

    def recorded(name, layers, device, steps=7, width=16, group=None):
        out = probe(name, layers, device, steps, width, group)
        runs.append((name, layers, width, "solo" if group is solo else "world", out[1]))
        return out

    calibrate._probe_step_s = recorded
    try:
        figures = calibrate.measure_engine_overhead(cpu, solo, repeats=1)
    finally:
        calibrate._probe_step_s = probe
    return {"runs": runs, "figures": figures}


def test_the_engine_costs_that_grow_with_bytes_and_tensors_are_measured_without_collectives(worlds):
    """The engine's cost per byte and per parameter tensor is local work (copies, hooks, the flat optimizer step): it
    is measured with each rank's engine on a group of that rank alone, every rank at once, so that no collective's
    noise is left in a difference of steps (on the world group, a step of the wide probe differs from the narrow one
    by the collectives' growth, which is subtracted by their curves and was many times the figure). The cost per
    bucket operation keeps the world group: it holds the collective's fixed cost as the engine meets it."""
    from lightning_shard.planner.calibrate import ENGINE_PROBE, WIDE

    k1, k2 = ENGINE_PROBE
    for rank in worlds(2).run(probe_collectives):
        runs = {r[:4]: r[4] for r in rank["runs"]}
        assert {r for r in runs if r[3] == "solo"} == {("zero0", k1, 16, "solo"), ("zero0", k2, 16, "solo"),
                                                        ("zero3", k2, 16, "solo"), ("zero0", k2, WIDE, "solo"),
                                                        ("zero3", k2, WIDE, "solo")}
        assert all(calls == 0 for r, calls in runs.items() if r[3] == "solo")  # no collective per step
        engine_world = {r: calls for r, calls in runs.items() if r[3] == "world" and r[0] is not None}
        assert set(engine_world) == {(n, k, 16, "world") for n in ("zero0", "zero3") for k in ENGINE_PROBE}
        assert all(calls >= 1 for calls in engine_world.values())
        assert all(f >= 0 for f in rank["figures"])


def test_the_unit_cost_is_the_median_of_three_measurements(monkeypatch):
    """The engine's cost per stage-3 unit operation is measured three times (each: zero3 against zero0 on stacks of
    1 and 4 of the model's blocks) and the median kept: a single measurement moves by half its value when ranks share
    cores. Here each measurement's steps are written by hand, costing 5 ms, 1 ms and 2 ms per unit operation."""
    import torch

    from lightning_shard.planner import calibrate
    from lightning_shard.planner.config import Job
    from lightning_shard.planner.stats import transformer_shape

    costs, calls = [5e-3, 1e-3, 2e-3], []

    def stack(name, block, depth, shape, job, device, comm):  # 10 ms of compute per block; 3 operations per unit
        cost = costs[len(calls) // 4]  # four runs per measurement
        calls.append((name, depth))
        ops = 3 * depth if name == "zero3" else 1
        return depth * 0.01 + (ops * cost if name == "zero3" else 0.0), 0.0, ops

    monkeypatch.setattr(calibrate, "_stack_step_s", stack)
    module = tiny()
    job = Job(world=1, micro_batch=MICRO, accumulation=1, seq=64, precision="32-true")
    got = calibrate.measure_unit_ops(module, transformer_shape(module), job, torch.device("cpu"), lambda op, n: 0.0)
    assert len(calls) == 12
    assert got == pytest.approx(2e-3)


def test_short_engine_steps_are_timed_in_more_of_them(monkeypatch):
    """The unit probe's runs time at least ``budget_s`` of steps (at least ``steps`` of them, at most MAX_STEPS): a
    step of a tiny layer takes well under a millisecond, so a budget of 50 ms runs many more than 5; the cap holds."""
    import torch
    from torch import nn

    from lightning_shard.planner import calibrate

    def forwards(budget: float) -> int:
        layer, count = nn.Linear(4, 4), [0]
        layer.register_forward_hook(lambda *a: count.__setitem__(0, count[0] + 1))
        calibrate._engine_step_s(None, layer, torch.randn(2, 4), torch.device("cpu"), 5, 1, budget_s=budget)
        return count[0]

    assert forwards(0.0) == 1 + 5  # one untimed step, then 5 timed ones
    assert forwards(0.05) > 2 + 5  # the step that sizes the count, one untimed one, more than 5 timed ones
    monkeypatch.setattr(calibrate, "MAX_STEPS", 8)
    assert forwards(10.0) == 2 + 8
