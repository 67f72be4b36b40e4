"""Phase 5, the suite's GPU-only tests: every test whose ``skipif`` condition reads ``torch.cuda`` (found in the source,
so a new one is picked up), run by node id with pytest in a subprocess.

On the GPU a test that runs must pass, and one may skip only for needing more GPUs than the machine has (the 2-GPU
tests on one H200: named in the report). With ``--cpu`` every one of them must skip (the suite's own promise: GPU-only
tests skip cleanly without a GPU).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from gpu_common import REPO, Recorder


def gpu_only_tests(root: Path = REPO / "tests") -> list[str]:
    """Node ids (``path::function``) of the tests with a ``pytest.mark.skipif`` whose condition mentions cuda."""
    found = []
    for path in sorted(root.rglob("test_*.py")):
        source = path.read_text()
        if "cuda" not in source or path.name == "test_gpu_check.py":  # that one runs this check: never from here
            continue
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
                continue
            for deco in node.decorator_list:
                text = ast.get_source_segment(source, deco) or ""
                if "skipif" in text and "cuda" in text:
                    found.append(f"{path.relative_to(REPO)}::{node.name}")
                    break
    return found


def outcomes(junit: Path) -> list[dict[str, Any]]:
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        row: dict[str, Any] = {"nodeid": f"{path}::{case.get('name')}", "outcome": "passed", "reason": ""}
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                row["outcome"] = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                row["reason"] = (el.get("message") or "").replace("\n", " ")[:300]
        rows.append(row)
    return rows


def run(rec: Recorder) -> None:
    cpu = rec.args.cpu
    gpus = 0
    if not cpu:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not gpus:
            raise RuntimeError("no CUDA device: run the GPU check on a GPU machine, or pass --cpu")
    nodes = gpu_only_tests()
    junit = Path(rec.args.out_dir) / ".gpu_check_tests.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", *nodes]
    rec.put("command", " ".join(["python3" if not cpu else "python", *argv[1:4], *nodes]))
    rec.put("gpu_only", nodes)
    rec.need(15, "pytest")
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=max(10.0, rec.time_left() - 5))
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", flush=True)
    if not junit.exists():
        rec.error("tests/pytest", RuntimeError(f"pytest wrote no report (exit {proc.returncode}): "
                                               f"{proc.stdout[-500:]}"), "pytest")
        return
    rows = outcomes(junit)
    junit.unlink()
    rec.put("tests", rows)
    for row in rows:
        needs_more = gpus < 2 and "2 CUDA GPUs" in row["reason"]  # the skipif's own words (test_zero_launch.py)
        expected = ("skipped",) if cpu else (("passed", "skipped") if needs_more else ("passed",))
        ok = row["outcome"] in expected
        if row["outcome"] == "skipped" and not cpu:
            rec.note(f"{row['nodeid']} skipped on {gpus} GPU(s): {row['reason']}")
        rec.check(f"pytest/{row['nodeid']}", 0.0 if ok else 1.0, 0.0, what=f"outcome {row['outcome']} (expected "
                  f"{' or '.join(expected)})", reference="pytest", reason=row["reason"])
    ran = {r["nodeid"].split("[")[0] for r in rows}
    missing = [n for n in nodes if n not in ran]
    rec.check("pytest/all_collected", float(len(missing)), 0.0, what="GPU-only tests found in the source but not run",
              reference="the skipif markers in tests/", missing=missing)
