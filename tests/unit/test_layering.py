"""Dependency direction (DESIGN.md section 3), checked on the import statements of every module (top-level and
inside functions) and on the attribute chains that reach ``torch.distributed`` without an import.

The layer map: core imports torch only (and the core); topology imports no torch, no Lightning and no other
layer; planner and topology never import the strategies or the app; recipes never import the core; only
``app/`` and ``train.py`` import Hydra; only ``comm/collectives.py`` calls ``torch.distributed`` (its ``checkpoint``
package is allowed where checkpoints live: checkpoint/format.py, checkpoint/pieces.py, checkpoint/dcp.py,
checkpoint/io.py).
Each rule is also checked against a made-up module that breaks it, so a rule that cannot fail is caught."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "lightning_shard"


def _imports(path: Path, source: Optional[str] = None) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package path
                parts = list(path.relative_to(ROOT).with_suffix("").parts)[: -node.level]
                names.add(".".join(parts + ([node.module] if node.module else [])))
            elif node.module:
                names.add(node.module)
    return names


def _files(sub: str) -> list[Path]:
    return sorted((ROOT / sub).rglob("*.py"))


def test_core_imports_torch_only():
    for f in _files("lightning_shard/engine"):
        for name in _imports(f):
            top = name.split(".")[0]
            assert top not in ("lightning", "pytorch_lightning", "hydra", "omegaconf"), f"{f}: imports {name}"
            if top == "lightning_shard":
                assert name.startswith("lightning_shard.engine"), f"{f}: core must not import {name}"


def test_hydra_only_in_the_app():
    for f in _files("lightning_shard"):
        if (f.name == "train.py" and f.parent == PKG) or f.parent == PKG / "app":
            continue
        for name in _imports(f):
            assert not name.startswith(("hydra", "omegaconf")), f"{f}: imports {name}; only app/ and train.py may"


def test_recipes_do_not_reach_into_core():
    for f in _files("recipes"):
        for name in _imports(f):
            assert not name.startswith("lightning_shard.engine"), f"{f}: recipes must not import {name}"


def test_no_pytorch_lightning_namespace():
    for f in _files("lightning_shard") + _files("recipes"):
        for name in _imports(f):
            assert not name.startswith("pytorch_lightning"), f"{f}: use the `lightning` package"


CHECKPOINT_FILES = {"checkpoint/format.py", "checkpoint/pieces.py", "checkpoint/dcp.py", "checkpoint/io.py"}
_THIRD_PARTY_HEAVY = ("torch", "lightning", "pytorch_lightning", "hydra", "omegaconf")


def _dotted(node: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _distributed_calls(source: str) -> set[str]:
    """``torch.distributed.X`` reached through attributes (``import torch`` then ``torch.distributed.barrier()``)."""
    return {d for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
            if (d := _dotted(node)) and d.startswith("torch.distributed.")}


def _rel(f: Path) -> str:
    return str(f.relative_to(PKG)) if PKG in f.parents else str(f.relative_to(ROOT))


def topology_violations(f: Path, source: Optional[str] = None) -> list[str]:
    bad = []
    for name in _imports(f, source):
        top = name.split(".")[0]
        if top in _THIRD_PARTY_HEAVY:
            bad.append(f"{_rel(f)}: topology imports {name} (it describes machines without torch)")
        if top == "lightning_shard" and not name.startswith("lightning_shard.topology"):
            bad.append(f"{_rel(f)}: topology imports {name} (the bottom layer imports no other)")
    return bad


def upward_violations(f: Path, source: Optional[str] = None) -> list[str]:
    return [f"{_rel(f)}: imports {name} (planner and topology never import the strategies or the app)"
            for name in _imports(f, source)
            if name.startswith(("lightning_shard.strategies", "lightning_shard.app", "lightning_shard.train"))
            or name.split(".")[0] in ("lightning", "pytorch_lightning")]


def distributed_violations(f: Path, source: Optional[str] = None) -> list[str]:
    rel = _rel(f)
    if rel == "engine/comm/collectives.py":
        return []
    text = f.read_text() if source is None else source
    used = {n for n in _imports(f, source) if n.startswith("torch.distributed")} | _distributed_calls(text)
    if rel in CHECKPOINT_FILES:
        used = {n for n in used if not n.startswith("torch.distributed.checkpoint")}
    return [f"{rel}: uses {n}; go through engine/comm/collectives.py" for n in sorted(used)]


def test_topology_imports_no_torch_and_no_other_layer():
    assert [v for f in _files("lightning_shard/topology") for v in topology_violations(f)] == []


def test_planner_and_topology_never_import_strategies_or_app():
    files = _files("lightning_shard/planner") + _files("lightning_shard/topology")
    assert [v for f in files for v in upward_violations(f)] == []


def test_no_torch_distributed_calls_outside_collectives():
    files = _files("lightning_shard") + _files("recipes")
    assert [v for f in files for v in distributed_violations(f)] == []


@pytest.mark.parametrize("rule,where,source,expected", [
    (topology_violations, "lightning_shard/topology/x.py", "def f():\n    import torch\n", "imports torch"),
    (topology_violations, "lightning_shard/topology/x.py", "from ..engine import spec\n", "lightning_shard.engine"),
    (upward_violations, "lightning_shard/planner/x.py", "from ..strategies import zero\n", "strategies"),
    (upward_violations, "lightning_shard/topology/x.py", "import lightning as L\n", "imports lightning"),
    (distributed_violations, "lightning_shard/strategies/x.py", "import torch\ntorch.distributed.barrier()\n",
     "torch.distributed.barrier"),
    (distributed_violations, "lightning_shard/engine/engine.py", "import torch.distributed as dist\n",
     "torch.distributed"),
    (distributed_violations, "lightning_shard/checkpoint/format.py", "import torch.distributed.checkpoint as dcp\n"
     "import torch\ntorch.distributed.all_reduce(x)\n", "torch.distributed.all_reduce"),
])
def test_each_rule_catches_a_module_that_breaks_it(rule, where, source, expected):
    found = rule(ROOT / where, source)
    assert found and any(expected in v for v in found), found


def test_checkpoint_files_may_use_torch_distributed_checkpoint():
    source = "import torch.distributed.checkpoint as dcp\n"
    assert distributed_violations(ROOT / "lightning_shard/checkpoint/format.py", source) == []
    assert distributed_violations(ROOT / "lightning_shard/engine/buckets/bucket.py", source) != []
