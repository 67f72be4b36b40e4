"""The console script and the package's import: `import lightning_shard` imports the strategies (torch and
Lightning with them) and registers the strategy names, whichever of it and Lightning is imported first; the CLI's
subcommands work and `--help` lists them all while importing none of their modules. Each check runs in a fresh
interpreter: this test process has imported everything already (conftest)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_shard.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _main(argv: list[str]) -> dict:
    """Run cli.main(argv) in a fresh interpreter; its exit code, stdout, and which subcommand modules it imported."""
    code = f"""
import contextlib, io, json, sys
from lightning_shard.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        rc = main({argv!r})
    except SystemExit as exit:
        rc = exit.code
print(json.dumps({{"rc": rc, "out": out.getvalue(), "loaded": sorted(m for m in {tuple(SUBCOMMANDS.values())!r}
                                                                    if m in sys.modules)}}))
"""
    done = _python(code)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["topo", "--help"], ["consolidate", "--help"],
                                  ["topo", "--preset", "h100_nvl_8", "--json"]])
def test_help_and_topo(argv):
    got = _main(argv)
    assert got["rc"] == 0
    if argv == ["--help"]:  # every subcommand listed with its summary, though none of their modules was imported
        for name in ("topo", "plan", "consolidate", "train"):
            assert re.search(rf"^\s+{name}\b", got["out"], re.M), name
        assert got["loaded"] == []
    else:  # only the module of the subcommand being run
        assert got["loaded"] == [SUBCOMMANDS[argv[0]]]
    if argv[0] == "topo" and "--json" in argv:
        assert json.loads(got["out"])["fabric"]["pcie_gen"] == 5


def test_plan_help():
    got = _main(["plan", "--help"])
    assert got["rc"] == 0 and "--global-batch" in got["out"] and got["loaded"] == [SUBCOMMANDS["plan"]]


NAMES = ("zero0", "zero1", "zero2", "zero3", "fsdp_shard", "zero2_hybrid", "zero_auto")


@pytest.mark.slow
def test_strategies_register_whichever_is_imported_first():
    """`import lightning_shard` first: the names are registered at once, in the Trainer's and Fabric's registries,
    and `from lightning_shard import Zero2Strategy` is the registered class. Lightning first (the README's order):
    the same."""
    check = f"""
from lightning.pytorch.strategies import StrategyRegistry
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning_shard import Zero2Strategy, Zero3FabricStrategy
print([n for n in {NAMES!r} if n in StrategyRegistry], [n for n in {NAMES[:-1]!r} if n in STRATEGY_REGISTRY],
      StrategyRegistry["zero2"]["strategy"] is Zero2Strategy,
      STRATEGY_REGISTRY["zero3"]["strategy"] is Zero3FabricStrategy)
"""
    expected = f"{list(NAMES)} {list(NAMES[:-1])} True True"
    package_first = _python("import sys\nimport lightning_shard\nassert 'lightning' in sys.modules\n" + check)
    assert package_first.returncode == 0, package_first.stderr
    assert package_first.stdout.split("\n")[-2] == expected
    lightning_first = _python("import lightning as L\nimport lightning_shard\n" + check)
    assert lightning_first.returncode == 0, lightning_first.stderr
    assert lightning_first.stdout.split("\n")[-2] == expected


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
