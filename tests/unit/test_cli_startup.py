"""What the console script imports: `--help` and `topo` load neither torch nor Lightning, while the strategy
names still register when Lightning is imported (in either order). Each check runs in a fresh interpreter:
this test process has torch loaded already (conftest)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "lightning", "pytorch_lightning", "lightning_shard.strategies", "lightning_shard.planner")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _modules_after(argv: list[str]) -> dict:
    """Run cli.main(argv) in a fresh interpreter; its exit code, stdout, and which heavy modules got imported."""
    code = f"""
import contextlib, io, json, sys
from lightning_shard.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        rc = main({argv!r})
    except SystemExit as exit:
        rc = exit.code
print(json.dumps({{"rc": rc, "out": out.getvalue(), "loaded": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""
    done = _python(code)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["topo", "--help"], ["consolidate", "--help"],
                                  ["topo", "--preset", "h100_nvl_8", "--json"]])
def test_help_and_topo_import_no_torch(argv):
    got = _modules_after(argv)
    assert got["rc"] == 0 and got["loaded"] == []
    if argv == ["--help"]:  # every subcommand listed with its summary, though no module was imported
        for name in ("topo", "plan", "consolidate", "train"):
            assert re.search(rf"^\s+{name}\b", got["out"], re.M), name
    if argv[0] == "topo" and "--json" in argv:
        assert json.loads(got["out"])["fabric"]["pcie_gen"] == 5


def test_plan_help_imports_no_torch():
    got = _modules_after(["plan", "--help"])  # the planner package itself loads (its options), torch does not
    assert got["rc"] == 0 and "--global-batch" in got["out"] and got["loaded"] == ["lightning_shard.planner"]


@pytest.mark.slow
def test_import_package_loads_no_torch_and_strategies_still_register():
    """`import lightning_shard` first, Lightning later: the names are registered once Lightning is imported;
    `from lightning_shard import Zero2Strategy` still works (module __getattr__)."""
    done = _python("""
import sys
import lightning_shard
assert not [m for m in ("torch", "lightning") if m in sys.modules], "eager import"
import lightning as L
from lightning.pytorch.strategies import StrategyRegistry
names = [n for n in ("zero0", "zero1", "zero2", "zero3", "fsdp_shard", "zero2_hybrid", "zero_auto")
         if n in StrategyRegistry]
from lightning_shard import Zero2Strategy
from lightning_shard.strategies import Zero2Strategy as Z2
print(names, Zero2Strategy is Z2, StrategyRegistry["zero2"]["strategy"] is Z2, "Zero3Strategy" in dir(lightning_shard))
""")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == ("['zero0', 'zero1', 'zero2', 'zero3', 'fsdp_shard', 'zero2_hybrid', "
                                           "'zero_auto'] True True True")
    reverse = _python("""
import lightning as L
import lightning_shard  # the README's order
from lightning.pytorch.strategies import StrategyRegistry
print("zero2" in StrategyRegistry, "zero3" in StrategyRegistry)
""")
    assert reverse.returncode == 0, reverse.stderr
    assert reverse.stdout.split("\n")[-2] == "True True"


def test_console_script_and_module_entry():
    """pyproject's console script is cli.main; `python -m lightning_shard.cli` runs it too."""
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^lightning-shard = "lightning_shard\.cli:main"$', text, re.M)
    done = subprocess.run([sys.executable, "-m", "lightning_shard.cli", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("usage: lightning-shard ") and "consolidate" in done.stdout


@pytest.mark.parametrize("path, words", [("/nonexistent/topo.txt", "no such file"), (".", "not a file")])
def test_topo_file_errors_exit_nonzero_with_one_line(path, words):
    done = subprocess.run([sys.executable, "-m", "lightning_shard.cli", "topo", "--file", path], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"lightning-shard topo: error: --file {path}: {words}")


def test_summaries_match_the_subcommands():
    """cli.SUMMARIES (listed by `--help` without importing) says what each module's own parser says."""
    from lightning_shard.cli import SUBCOMMANDS, SUMMARIES, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    helps = {a.dest: a.help for a in sub._choices_actions}
    assert set(SUMMARIES) == set(SUBCOMMANDS) and helps == SUMMARIES
