"""bench/'s suites still run end to end at the smallest sizes, each in a subprocess, and write their one result
``<suite>_<hardware>_<date>.{json,md}`` (bench/naming.py).

Checks the JSON keys the Markdown writers rely on, nonzero measured wire bytes (lightning_shard's LEDGER for zero2,
the DDP comm hook for ddp), and the engine phase times read from the profiled window.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # bench smoke runs, each a few subprocess jobs

REPO = Path(__file__).resolve().parents[2]
TINY = ["--variants", "zero2", "ddp", "--steps", "1", "--warmup", "1", "--profile-steps", "1", "--n-layer", "1",
        "--n-head", "2", "--n-embd", "32", "--vocab", "256", "--block-size", "16", "--batch-size", "1",
        "--repeats", "1", "--timeout", "120"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("BENCH_HARDWARE", None)  # the result's name from the machine
    return env


def result(out_dir: Path, suite: str, suffix: str) -> Path:
    """The suite's one result in ``out_dir``: ``<suite>_cpu<cores>_<YYYY-MM-DD><suffix>``."""
    found = [f for f in out_dir.glob(f"{suite}_*{suffix}")
             if re.fullmatch(rf"{suite}_cpu\d+_\d{{4}}-\d{{2}}-\d{{2}}{re.escape(suffix)}", f.name)]
    assert len(found) == 1, sorted(f.name for f in out_dir.iterdir())
    return found[0]


def test_bench_peak_smoke(tmp_path):
    """The peak suite (the driver's table path) with zero2 and DDP: measured wire bytes, the engine's phases from the
    profiled window, the peak fields, the Markdown table."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_peak.py"), *TINY, "--out-dir", str(tmp_path)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(result(tmp_path, "peak", ".json").read_text())
    assert set(doc) == {"suite", "machine", "command", "wall_s", "results", "row_set_wall_s", "row_sets"}
    assert doc["suite"] == "peak" and doc["row_sets"] == []
    assert doc["machine"]["profile_steps"] == 1
    res = doc["results"]
    assert list(res) == ["ddp", "zero2"]  # the suite's table order
    for v, r in res.items():
        assert "error" not in r, r.get("log_tail")
        for key in ("tokens_per_s_mean", "ratio_vs_ddp", "optimizer_state_mib_per_rank", "peak_rss_mib_per_rank",
                    "wire_mib_per_step_per_rank", "wire_formula_mib_per_step", "wire_source", "wire_detail_rank0",
                    "phase_s_per_step_rank0", "engine_s_per_step_rank0", "model_state_rank0", "final_loss_rank0",
                    "median_step_s_per_rank", "repeats", "train_peak_rss_mib_per_rank"):
            assert key in r, (v, key)
        assert r["wire_mib_per_step_per_rank"] > 0, v
        assert r["wire_source"].startswith("measured"), v
        assert len(r["losses_rank0"]) == 2, v  # warmup + timed steps only, not the profiled one
    ledger = res["zero2"]["wire_detail_rank0"]["ledger"]
    assert ledger and sum(e["wire_bytes"] for e in ledger.values()) > 0
    assert {"post_backward", "finish_step"} <= set(res["zero2"]["engine_s_per_step_rank0"])
    assert res["ddp"]["engine_s_per_step_rank0"] == {}
    assert res["ddp"]["wire_detail_rank0"]["allreduce_bytes_per_step"] > 0
    md = result(tmp_path, "peak", ".md").read_text()
    assert "| variant | peak MiB/rank (VmHWM) |" in md


def test_bench_speed_smoke(tmp_path):
    """The speed suite's main table at the smallest sizes: best-of ratios, the same phase fields for ours and a peer
    (wall and off-CPU per phase, page faults), the engine's collective labels from the profiled window."""
    argv = [sys.executable, str(REPO / "bench" / "bench_speed.py"), "--quick", "--model", "gpt", "--variants",
            "zero2", "ddp", "--repeats", "2", "--profile-steps", "1", "--timeout", "120", "--out-dir", str(tmp_path)]
    proc = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(result(tmp_path, "speed", ".json").read_text())
    assert doc["table"] == "main" and [s["title"] for s in doc["row_sets"]] == ["gpt 2x64"]
    res = doc["row_sets"][0]["results"]
    assert list(res) == ["zero2", "ddp"]
    for v, r in res.items():
        assert "error" not in r, r.get("log_tail")
        assert len(r["repeats"]) == 2
        assert r["tokens_per_s_best"] == max(x["tokens_per_s_mean"] for x in r["repeats"]), v
        assert set(r["off_cpu_s_per_step_rank0"]) == set(r["phase_s_per_step_rank0"]), v
        assert r["minor_faults_per_step_rank0"] is not None, v
        each = r["minor_faults_per_step_per_rank"]  # every rank's count, the mean over the two runs
        assert len(each) == 2 and each[0] == sum(x["minor_faults_per_step_per_rank"][0] for x in r["repeats"]) / 2, v
    assert res["zero2"]["ratio_vs_ddp"] == res["zero2"]["tokens_per_s_best"] / res["ddp"]["tokens_per_s_best"]
    labels = res["zero2"]["labels_s_per_step_rank0"]
    assert {"lightning_shard.reduce_launch", "lightning_shard.reduce_wait", "lightning_shard.post_backward"} <= set(
        labels), labels
    assert "DistributedDataParallel.forward" in res["ddp"]["labels_s_per_step_rank0"]
    md = result(tmp_path, "speed", ".md").read_text()
    assert "| variant | tokens/s (best) | runs | vs DDP | vs FSDP2 |" in md and "page faults / step" in md


def test_bench_compile_smoke(tmp_path):
    """bench_compile.py end to end at the smallest size: eager and inductor jobs of zero2 (fresh Fabric processes),
    the same final loss, the table."""
    argv = [sys.executable, str(REPO / "bench" / "bench_compile.py"), "--variants", "zero2", "--repeats", "1",
            "--steps", "2", "--warmup", "1", "--layers", "1", "--width", "64", "--vocab", "256", "--block", "32",
            "--out-dir", str(tmp_path)]
    proc = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(result(tmp_path, "compile", ".json").read_text())
    eager, inductor = doc["results"]["zero2/eager"][0], doc["results"]["zero2/inductor"][0]
    assert eager["final_loss"] == pytest.approx(inductor["final_loss"], rel=1e-4)
    assert "| zero2 |" in result(tmp_path, "compile", ".md").read_text()


def test_bench_world1_smoke(tmp_path):
    """bench_world1.py end to end, one round: a plain model and zero2/fsdp_shard engines at world 1 in one
    process, the same Hugging Face GPT-2 from the same seed: after the same steps on the same data every model
    computes the plain loop's loss (a lost gradient shows; a wrong gradient scale would not under AdamW: the SGD
    parity tests catch that), and the profiled ops are reported."""
    argv = [sys.executable, str(REPO / "bench" / "bench_world1.py"), "--variants", "zero2", "fsdp_shard",
            "--rounds", "1", "--warmup", "1", "--profile-steps", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(result(tmp_path, "world1", ".json").read_text())
    assert list(doc["variants"]) == ["plain", "zero2", "fsdp_shard"]
    plain = doc["final_loss"]["plain"]
    for v in ("zero2", "fsdp_shard"):
        assert abs(doc["final_loss"][v] - plain) <= 1e-5 * abs(plain), (v, doc["final_loss"])
        assert len(doc["variants"][v]["step_s"]) == 1 and doc["variants"][v]["paired_wall_ratio_median"] > 0
        assert doc["profiles"][v] and all(ms >= 0 for _, ms in doc["profiles"][v])
    assert "| variant | step s (median) |" in result(tmp_path, "world1", ".md").read_text()


def test_bench_collectives_smoke(tmp_path):
    """bench_collectives.py at world 2 and one small size: every form of the reduce-scatter and the all-gather timed
    for the same tensor, the ratios in the table."""
    argv = [sys.executable, str(REPO / "bench" / "bench_collectives.py"), "--worlds", "2", "--sizes-mib", "0.0625",
            "--iters", "1", "--repeats", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(result(tmp_path, "collectives", ".json").read_text())
    assert doc["backend"] == "gloo" and [(r["world"], r["mib"]) for r in doc["rows"]] == [(2, 0.0625)]
    row = doc["rows"][0]
    for op in ("reduce_scatter", "all_reduce+slice", "all_to_all+sum", "all_gather", "all_reduce as gather",
               "broadcasts as gather"):
        assert row[op] > 0 and row[f"{op} cpu"] >= 0, op
    assert "| world | MiB | reduce_scatter |" in result(tmp_path, "collectives", ".md").read_text()
