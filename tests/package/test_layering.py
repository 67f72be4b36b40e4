"""The package's layer map (docs/architecture.md, "Design rules" 1), checked on the import statements of every module
(top-level and inside functions, ``TYPE_CHECKING`` ones included) and on the attribute chains that reach
``torch.distributed`` without an import.

    options/      the Python standard library only (every layer reads the options)
    engine/       torch, options, the engine
    checkpoint/   torch (``torch.distributed.checkpoint`` included), options, engine; Lightning only in io.py
                  (cli.py: the console script when run as a module, and the recipes' Hugging Face export)
    topology/     no torch, no Lightning, no other layer but shipped.py (where the presets are)
    planner/      torch, options, engine, topology, shipped.py, version.py, the recipes (never strategies,
                  checkpoint, app, Lightning)
    strategies/   Lightning and everything above, never the app
    app/, train.py   Hydra (the only ones) and everything
    recipes/      Lightning and torch, never the engine

Only ``engine/comm/collectives.py`` calls ``torch.distributed`` (the checkpoint files may use its ``checkpoint``
package). No module imports itself back through a circle. Each rule is also tried against a made-up module that
breaks it, so a rule that cannot fail is caught."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Callable, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "lightning_shard"
HEAVY = ("torch", "lightning", "pytorch_lightning", "hydra", "omegaconf")


def _imports(path: Path, source: Optional[str] = None) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package path
                parts = list(path.relative_to(ROOT).with_suffix("").parts)
                parts = parts[: len(parts) - node.level]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            modules = {a.name for a in node.names if _is_module(f"{base}.{a.name}")}
            names.update(f"{base}.{m}" for m in modules)
            if len(modules) < len(node.names):  # a name defined by ``base`` itself: base is imported
                names.add(base)
    return names


def _is_module(name: str) -> bool:
    path = ROOT / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _files(sub: str) -> list[Path]:
    return sorted((ROOT / sub).rglob("*.py"))


def _rel(f: Path) -> str:
    return str(f.relative_to(PKG)) if PKG in f.parents else str(f.relative_to(ROOT))


def _layer(name: str) -> Optional[str]:
    """``lightning_shard.engine.comm.collectives`` -> ``engine``; ``lightning_shard`` itself -> ``""``."""
    parts = name.split(".")
    return None if parts[0] != "lightning_shard" else (parts[1] if len(parts) > 1 else "")


def allowed_violations(f: Path, source: Optional[str], layer: str, third_party: tuple[str, ...],
                       layers: tuple[str, ...]) -> list[str]:
    """Imports of ``f`` outside what ``layer`` may import: ``third_party`` heavy packages, ``layers`` of ours."""
    bad = []
    for name in _imports(f, source):
        top = name.split(".")[0]
        if top in HEAVY and top not in third_party:
            bad.append(f"{_rel(f)}: {layer} imports {name}")
        ours = _layer(name)
        if ours is not None and ours not in (layer, *layers):
            bad.append(f"{_rel(f)}: {layer} imports {name}")
    return bad


def options_violations(f: Path, source: Optional[str] = None) -> list[str]:
    return allowed_violations(f, source, "options", (), ())


def engine_violations(f: Path, source: Optional[str] = None) -> list[str]:
    return allowed_violations(f, source, "engine", ("torch",), ("options",))


def checkpoint_violations(f: Path, source: Optional[str] = None) -> list[str]:
    lightning = ("lightning",) if f.name == "io.py" else ()
    recipes = ("recipes",) if f.name == "cli.py" else ()  # the --hf export of the hf_causal_lm recipe
    return allowed_violations(f, source, "checkpoint", ("torch", *lightning),
                              ("options", "engine", "version", "cli", *recipes))


def topology_violations(f: Path, source: Optional[str] = None) -> list[str]:
    return allowed_violations(f, source, "topology", (), ("shipped",))


def planner_violations(f: Path, source: Optional[str] = None) -> list[str]:
    return allowed_violations(f, source, "planner", ("torch",),
                              ("options", "engine", "topology", "shipped", "version", "recipes"))


def strategies_violations(f: Path, source: Optional[str] = None) -> list[str]:
    return allowed_violations(f, source, "strategies", ("torch", "lightning"),
                              ("options", "engine", "checkpoint", "topology", "planner", "version"))


def hydra_violations(f: Path, source: Optional[str] = None) -> list[str]:
    if (f.name == "train.py" and f.parent == PKG) or PKG / "app" in f.parents:
        return []
    return [f"{_rel(f)}: imports {n}; only app/ and train.py may" for n in _imports(f, source)
            if n.split(".")[0] in ("hydra", "omegaconf")]


def recipe_violations(f: Path, source: Optional[str] = None) -> list[str]:
    return [f"{_rel(f)}: recipes must not import {n}" for n in _imports(f, source)
            if n.startswith("lightning_shard.engine")]


def _dotted(node: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def distributed_violations(f: Path, source: Optional[str] = None) -> list[str]:
    rel = _rel(f)
    if rel == "engine/comm/collectives.py":
        return []
    text = f.read_text() if source is None else source
    used = {n for n in _imports(f, source) if n.startswith("torch.distributed")}
    used |= {d for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Attribute)
             if (d := _dotted(node)) and d.startswith("torch.distributed.")}
    if rel.startswith("checkpoint/"):
        used = {n for n in used if not n.startswith("torch.distributed.checkpoint")}
    return [f"{rel}: uses {n}; go through engine/comm/collectives.py" for n in sorted(used)]


def circles(sources: dict[str, tuple[Path, Optional[str]]]) -> list[list[str]]:
    """Strongly connected components of more than one module in the import graph of ``sources``
    (module name -> (path, source or None to read it))."""
    graph = {m: {n for n in _imports(p, s) if n in sources and n != m} for m, (p, s) in sources.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _module_name(f: Path) -> str:
    parts = list(f.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package() -> dict[str, tuple[Path, Optional[str]]]:
    return {_module_name(f): (f, None) for f in _files("lightning_shard")}


RULES: list[tuple[str, Callable[..., list[str]]]] = [
    ("lightning_shard/options", options_violations),
    ("lightning_shard/engine", engine_violations),
    ("lightning_shard/checkpoint", checkpoint_violations),
    ("lightning_shard/topology", topology_violations),
    ("lightning_shard/planner", planner_violations),
    ("lightning_shard/strategies", strategies_violations),
    ("lightning_shard", hydra_violations),
    ("recipes", recipe_violations),
    ("lightning_shard", distributed_violations),
    ("recipes", distributed_violations),
]


@pytest.mark.parametrize("where,rule", RULES, ids=[f"{w}:{r.__name__}" for w, r in RULES])
def test_the_layer_map_holds(where, rule):
    assert [v for f in _files(where) for v in rule(f)] == []


def test_no_import_circles_in_the_package():
    assert circles(_package()) == []


def test_no_pytorch_lightning_namespace():
    for f in _files("lightning_shard") + _files("recipes"):
        for name in _imports(f):
            assert not name.startswith("pytorch_lightning"), f"{f}: use the `lightning` package"


@pytest.mark.parametrize("rule,where,source,expected", [
    (options_violations, "lightning_shard/options/x.py", "import torch\n", "options imports torch"),
    (options_violations, "lightning_shard/options/x.py", "from ..engine import spec\n", "lightning_shard.engine"),
    (engine_violations, "lightning_shard/engine/x.py", "def f():\n    import lightning\n", "imports lightning"),
    (engine_violations, "lightning_shard/engine/buckets/x.py", "from ...strategies import zero\n", "strategies"),
    (engine_violations, "lightning_shard/engine/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from ..planner import config\n", "planner"),
    (checkpoint_violations, "lightning_shard/checkpoint/format.py", "from lightning.pytorch import Trainer\n",
     "imports lightning"),
    (checkpoint_violations, "lightning_shard/checkpoint/x.py", "from ..strategies import zero\n", "strategies"),
    (topology_violations, "lightning_shard/topology/x.py", "def f():\n    import torch\n", "imports torch"),
    (topology_violations, "lightning_shard/topology/x.py", "from ..options import Tuning\n", "options"),
    (planner_violations, "lightning_shard/planner/x.py", "from ..strategies import zero\n", "strategies"),
    (planner_violations, "lightning_shard/planner/x.py", "import lightning as L\n", "imports lightning"),
    (strategies_violations, "lightning_shard/strategies/x.py", "from ..app import run\n", "lightning_shard.app"),
    (hydra_violations, "lightning_shard/strategies/x.py", "from omegaconf import OmegaConf\n", "omegaconf"),
    (recipe_violations, "recipes/x.py", "from lightning_shard.engine.comm import collectives\n", "engine"),
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


def test_the_circle_rule_catches_a_circle():
    """Two made-up modules importing each other (one only for type checking) form a circle; the package without
    them has none (above)."""
    a, b = PKG / "engine" / "a.py", PKG / "engine" / "b.py"
    sources = {**_package(), "lightning_shard.engine.a": (a, "from .b import y\n"),
               "lightning_shard.engine.b": (b, "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                               "    from .a import x\n")}
    assert ["lightning_shard.engine.a", "lightning_shard.engine.b"] in circles(sources)


def test_checkpoint_files_may_use_torch_distributed_checkpoint():
    source = "import torch.distributed.checkpoint as dcp\n"
    assert distributed_violations(ROOT / "lightning_shard/checkpoint/format.py", source) == []
    assert distributed_violations(ROOT / "lightning_shard/engine/buckets/bucket.py", source) != []
