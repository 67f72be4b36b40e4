"""bench/gpu_check.py (issue 17, the proof on a GPU) is ready to run: its ``--cpu`` mode runs every phase at tiny
sizes on CPU and passes with real numbers, and a wrong result makes it fail loudly, naming the check.

The GPU run itself (``PYTHONPATH=. python3 bench/gpu_check.py``) needs CUDA; here only what CPU allows is run.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the GPU proof's CPU mode: every phase in worker processes

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.py"
PHASES = ["parity", "world2", "perf", "tests"]
STRATEGIES = ["zero0", "zero1", "zero2", "zero3", "fsdp_shard"]


def _run(tmp_path: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("BENCH_HARDWARE", None)  # the result's name from the machine (bench/naming.py)
    return subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out-dir", str(tmp_path), "--budget-s", "540",
                           *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _result(tmp_path: Path, suffix: str) -> Path:
    """The run's one result file: ``gpu_check_cpu<cores>_<YYYY-MM-DD>`` (bench/naming.py: the CPU mode is named by
    the CPU it ran on, a GPU run by its GPU's model)."""
    found = sorted(tmp_path.glob(f"gpu_check_*{suffix}"))
    assert len(found) == 1, found
    assert re.fullmatch(rf"gpu_check_cpu\d+_\d{{4}}-\d{{2}}-\d{{2}}{re.escape(suffix)}", found[0].name), found[0].name
    return found[0]


def _real(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_cpu_mode_runs_every_phase_and_passes_with_real_numbers(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(_result(tmp_path, ".json").read_text())
    assert doc["mode"] == "cpu" and doc["status"] == "pass" and doc["first_failure"] is None
    assert list(doc["phases"]) == PHASES
    for name, sec in doc["phases"].items():
        assert sec["status"] == "pass" and sec["exit_code"] == 0, (name, sec["status"])
        assert sec["checks"] and all(c["passed"] for c in sec["checks"]), name
        assert all(_real(c["value"]) and _real(c["bound"]) for c in sec["checks"]), name

    rows = [r for r in doc["phases"]["parity"]["rows"] if r["strategy"] != "plain"]
    assert {(r["model"], r["precision"], r["strategy"]) for r in rows} == {
        (m, p, s) for m in ("small_tf", "gpt") for p in ("32-true", "bf16-mixed", "bf16-true") for s in STRATEGIES}
    assert {r["strategy_class"] for r in rows} == {"Zero0Strategy", "Zero1Strategy", "Zero2Strategy", "Zero3Strategy",
                                                   "FSDPShardStrategy"}
    assert doc["phases"]["parity"]["backend"] == "gloo"
    for r in rows:
        for key in ("parity", "resume_vs_plain", "resume_vs_uninterrupted", "consolidate_vs_plain", "fit_s"):
            assert _real(r[key]), (r, key)
        assert r["parity"] <= (1e-5 if r["precision"] == "32-true" else r["bound"])
    names = {c["name"] for c in doc["phases"]["parity"]["checks"]}
    kinds = ("parity", "accuracy", "computed", "computed_dtype", "resume", "resume_exact", "consolidate")
    assert {f"{k}/gpt/bf16-true/zero3" for k in kinds} <= names

    w2 = doc["phases"]["world2"]
    assert {p["op"] for p in w2["probes"]} >= {"all_reduce", "broadcast", "all_gather_object", "barrier"}
    assert all(p["ok"] and p["correct"] for p in w2["probes"] if p["ok"] is not None)  # gloo on CPU runs them all
    cases = {c["case"]: c for c in w2["cases"]}
    assert set(STRATEGIES) <= set(cases)
    assert all(c["result"] == "pass" and c["diff"] <= 1e-5 for c in cases.values())
    reductions = ("all_reduce", "reduce_scatter", "all_to_all")  # whichever reduce_scatter_via path gloo takes
    assert sum(cases["zero2"]["ops"].get(op, 0) for op in reductions) > 0 and cases["zero3"]["ops"]["all_gather"] > 0

    perf = doc["phases"]["perf"]
    assert set(perf["results"]) == {"plain", "zero0", "zero1", "zero2", "zero3", "fsdp_shard", "fsdp2"}
    for v, r in perf["results"].items():
        assert r["tokens_per_s"] > 0 and r["peak_bytes"] > 0 and r["mfu"] is None, v  # no MFU on CPU
    assert any(k.startswith("lightning_shard.") for k in perf["results"]["zero3"]["labels"])
    assert any(k.startswith("FSDP::") for k in perf["results"]["fsdp2"]["labels"])
    assert {g["variant"] for g in perf["goals"]} == {"zero2", "zero3", "fsdp_shard"}

    tests = doc["phases"]["tests"]["tests"]
    assert {t["nodeid"].split("[")[0] for t in tests} == set(doc["phases"]["tests"]["gpu_only"])
    assert tests and all(t["outcome"] == "skipped" for t in tests)  # no CUDA here: they skip cleanly

    md = _result(tmp_path, ".md").read_text()
    for heading in ("## 1. Correctness at world 1", "## 2. Two ranks on one device", "## 3-4. Memory and speed",
                    "## 5. The suite's GPU-only tests"):
        assert heading in md


def test_a_wrong_result_fails_loudly_and_names_its_check(tmp_path):
    """The test hook adds 1e-3 to one weight of the zero2 fp32 run only: that parity check fails with that difference
    (the unperturbed runs before it pass at 0), the run stops there, exits 1 and prints the check's name."""
    name = "parity/small_tf/32-true/zero2"
    proc = _run(tmp_path, "--phases", "parity", "world2", "--perturb", f"{name}=1e-3")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"GPU CHECK FAILED: {name}:" in proc.stderr
    doc = json.loads(_result(tmp_path, ".json").read_text())
    assert doc["status"] == "fail" and list(doc["phases"]) == ["parity"]  # stopped: world2 never started
    first = doc["first_failure"]
    assert first["name"] == name and first["perturbed"] and first["bound"] == 1e-5
    assert abs(first["value"] - 1e-3) <= 2e-5  # the injected difference (+- the parity bound), nothing else
    checks = doc["phases"]["parity"]["checks"]
    assert checks[-1]["name"] == name and not checks[-1]["passed"]
    before = [c for c in checks[:-1] if c["name"].startswith("parity/small_tf/32-true/")]
    assert [c["name"].rsplit("/", 1)[1] for c in before] == ["zero0", "zero1"]
    assert all(c["passed"] and c["value"] <= 1e-5 for c in before)
    assert f"**First failure**: `{name}`" in _result(tmp_path, ".md").read_text()


def test_the_gpu_only_tests_are_found_in_the_source():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from gpu_tests import gpu_only_tests
    finally:
        sys.path.remove(str(REPO / "bench"))
    found = gpu_only_tests()
    assert "tests/strategies/test_zero_launch.py::test_cuda_nccl_two_gpus" in found
    assert "tests/strategies/test_offload.py::test_on_cuda_the_host_side_is_pinned_and_the_step_matches" in found
    assert not any("test_gpu_check.py" in n for n in found)  # the check never runs itself
