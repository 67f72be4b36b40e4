"""Dependency direction (DESIGN.md section 3), checked on the import statements of every module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lightning_shard"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
    for f in _files("lightning_shard/core"):
        for name in _imports(f):
            top = name.split(".")[0]
            assert top not in ("lightning", "pytorch_lightning", "hydra", "omegaconf"), f"{f}: imports {name}"
            if top == "lightning_shard":
                assert name.startswith("lightning_shard.core"), f"{f}: core must not import {name}"


def test_only_collectives_calls_torch_distributed():
    for f in _files("lightning_shard") + _files("recipes"):
        if f.name == "collectives.py" and f.parent.name == "core":
            continue
        for name in _imports(f):
            assert not name.startswith("torch.distributed"), f"{f}: imports {name}; go through core/collectives.py"


def test_hydra_only_in_train():
    for f in _files("lightning_shard"):
        if f.name == "train.py" and f.parent == PKG:
            continue
        for name in _imports(f):
            assert not name.startswith(("hydra", "omegaconf")), f"{f}: imports {name}; only train.py may"


def test_recipes_do_not_reach_into_core():
    for f in _files("recipes"):
        for name in _imports(f):
            assert not name.startswith("lightning_shard.core"), f"{f}: recipes must not import {name}"


def test_no_pytorch_lightning_namespace():
    for f in _files("lightning_shard") + _files("recipes"):
        for name in _imports(f):
            assert not name.startswith("pytorch_lightning"), f"{f}: use the `lightning` package"
