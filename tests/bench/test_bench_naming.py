"""bench/naming.py: every suite's result is ``<suite>_<hardware>_<YYYY-MM-DD>``, one per suite and machine."""

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def naming():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import naming as mod

        yield mod
    finally:
        sys.path.remove(str(REPO / "bench"))


@pytest.mark.parametrize("name, slug", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
                                        ("Tesla V100-SXM2-16GB", "v100"), ("AMD Instinct MI300X", "mi300x"),
                                        ("NVIDIA L40S", "l40s"), ("", "gpu")])
def test_a_gpu_is_named_by_its_model(naming, name, slug):
    assert naming.gpu_slug(name) == slug


def test_the_stem_is_suite_hardware_date(naming, monkeypatch):
    monkeypatch.delenv("BENCH_HARDWARE", raising=False)
    monkeypatch.setattr(naming.os, "cpu_count", lambda: 2)
    assert naming.result_stem("speed", day="2026-12-04") == "speed_cpu2_2026-12-04"
    assert naming.result_stem("gpu_check", device="cuda", gpu="NVIDIA H200", day="2026-12-06") == \
        "gpu_check_h200_2026-12-06"
    assert re.fullmatch(r"peak_cpu2_\d{4}-\d{2}-\d{2}", naming.result_stem("peak"))  # the day of the run
    monkeypatch.setenv("BENCH_HARDWARE", "epyc 64")
    assert naming.result_stem("budget", day="2026-12-01") == "budget_epyc-64_2026-12-01"


def test_every_kept_result_follows_the_scheme():
    """bench/results holds one current result per suite and machine, each a .json and .md pair so named."""
    files = sorted(p.name for p in (REPO / "bench" / "results").iterdir()
                   if p.is_file() and not p.name.startswith("."))
    pattern = re.compile(r"(?P<suite>[a-z0-9_]+)_(?P<hw>[A-Za-z0-9.-]+)_(?P<day>\d{4}-\d{2}-\d{2})\.(json|md)")
    seen: dict[tuple[str, str], set[str]] = {}
    for name in files:
        m = pattern.fullmatch(name)
        assert m, name
        seen.setdefault((m["suite"], m["hw"]), set()).add(m["day"])
    assert all(len(days) == 1 for days in seen.values()), seen  # one current result per suite and machine
    stems = {n.rsplit(".", 1)[0] for n in files}
    assert all(f"{s}.json" in files and f"{s}.md" in files for s in stems), files
