"""Measure the structure of a checkout of ``lightning_shard`` (a maintainer's tool, not part of the package).

    .venv/bin/python scripts/structure.py [--root DIR] [--json]

``--root`` measures another checkout (default: the one holding this script); the parts that import the package
run in subprocesses with ``PYTHONPATH=<root>`` and ``cwd=<root>``, so that checkout's package is the one imported.
Reported:

a. the largest classes by instance attributes (distinct ``self.X = ...`` / ``self.X: T = ...`` targets in the
   class's methods, closures included) and the largest files by lines (top 5 each);
b. import cycles among the package's modules: every import statement (top level, inside functions, under
   ``TYPE_CHECKING``), relative imports resolved, ``from pkg import name`` read as ``pkg.name`` when that is a
   module, else ``pkg``; every strongly connected component of more than one module;
c. the keyword parameters of ``inspect.signature(lightning_shard.strategies.Zero2Strategy)`` before the first one
   whose annotation or default is a group (a dataclass instance or type), and the full count;
d. the walks, measured on a world of 2 gloo processes (rank 0 traced with ``sys.setprofile``): the package files
   entered, in order, by (i) one zero2 gradient: from the gradient hook of the parameter that completes a bucket in
   a boundary backward until that bucket's ``finish_reduce`` (``BucketGrads.finish`` after the refactor) has set the
   optimizer's shard gradient (the second step of an accumulation of 2), and (ii) one zero3 gather: from the
   forward pre-hook of the second unit (in the second step) until it returns with the unit's parameters usable.
   A file is *entered* by a call event of code in a
   package file other than the file of the previous package call event; calls outside the package are skipped.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Optional

PKG = "lightning_shard"
TOP = 5
HERE = Path(__file__).resolve()


# ---------------------------------------------------------------------------------------------- static: files
def _modules(pkg_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` of the package (``__init__.py`` is its package)."""
    out = {}
    for f in sorted(pkg_dir.rglob("*.py")):
        if "__pycache__" in f.parts:
            continue
        parts = list(f.relative_to(pkg_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def largest_files(pkg_dir: Path, mods: dict[str, Path]) -> list[dict[str, Any]]:
    rows = []
    for f in mods.values():
        with open(f, encoding="utf-8") as fh:
            rows.append({"file": str(f.relative_to(pkg_dir)), "lines": sum(1 for _ in fh)})
    rows.sort(key=lambda r: (-r["lines"], r["file"]))
    return rows[:TOP]


def _self_attrs(method: ast.AST) -> set[str]:
    """Distinct ``self.X`` assignment targets (plain, annotated, tuple-unpacked) anywhere in a method."""
    args = method.args  # type: ignore[attr-defined]
    first = (args.posonlyargs + args.args)[:1]
    if not first:
        return set()
    me = first[0].arg
    found: set[str] = set()

    def targets(t: ast.AST) -> None:
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                targets(e)
        elif isinstance(t, ast.Starred):
            targets(t.value)
        elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
            found.add(t.attr)

    for node in ast.walk(method):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                targets(t)
        elif isinstance(node, ast.AnnAssign):
            targets(node.target)
    return found


def largest_classes(pkg_dir: Path, mods: dict[str, Path]) -> list[dict[str, Any]]:
    rows = []
    for name, f in mods.items():
        tree = ast.parse(f.read_text(encoding="utf-8"), str(f))
        stack: list[tuple[ast.AST, str]] = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    qual = prefix + child.name
                    attrs: set[str] = set()
                    for item in child.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            decos = {getattr(d, "id", getattr(d, "attr", "")) for d in item.decorator_list}
                            if "staticmethod" not in decos:
                                attrs |= _self_attrs(item)
                    rows.append({"class": f"{name}.{qual}", "file": str(f.relative_to(pkg_dir)),
                                 "attrs": len(attrs)})
                    stack.append((child, qual + "."))
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    stack.append((child, prefix + child.name + ".<locals>."))
    rows.sort(key=lambda r: (-r["attrs"], r["class"]))
    return rows[:TOP]


# ---------------------------------------------------------------------------------------------- static: cycles
def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, f in mods.items():
        is_pkg = f.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), str(f))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                # ``import a.b.c`` names a.b.c; the nearest module of the package it names is the edge
                while t and t not in mods and "." in t:
                    t = t.rpartition(".")[0]
                if t in mods and t != name:
                    graph[name].add(t)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); components of more than one module, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    out.sort(key=lambda c: (-len(c), c))
    return out


# ---------------------------------------------------------------------------------------------- c: keywords
def keyword_counts() -> dict[str, Any]:
    import dataclasses
    import inspect
    import typing

    from lightning_shard import strategies

    cls = strategies.Zero2Strategy
    try:
        sig = inspect.signature(cls, eval_str=True)
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate: read them as written
        sig = inspect.signature(cls)
    globalns = vars(sys.modules[cls.__module__])

    def is_group(t: Any, depth: int = 0) -> bool:
        if isinstance(t, str):
            try:
                t = eval(t, dict(globalns))  # noqa: S307 - an annotation of the package itself
            except Exception:  # noqa: BLE001
                return False
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            return True
        return depth < 4 and any(is_group(a, depth + 1) for a in typing.get_args(t))

    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [n for n, p in sig.parameters.items() if p.kind in kinds]
    first = None
    for n in names:
        p = sig.parameters[n]
        default_group = p.default is not inspect.Parameter.empty and dataclasses.is_dataclass(p.default)
        if default_group or (p.annotation is not inspect.Parameter.empty and is_group(p.annotation)):
            first = n
            break
    before = names.index(first) if first is not None else len(names)
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "before_first_group": before, "first_group": first,
            "total": len(names)}


# ---------------------------------------------------------------------------------------------- d: the walks
class Tracer:
    """``sys.setprofile`` function: the package files entered between a start call and a stop return."""

    def __init__(self, pkg_dir: str, start: Any, stop: Any, restart: bool, nth: int = 1) -> None:
        """``stop``: the code whose first call in the window closes it on return; None: the start call's return.
        ``restart``: a later start call opens the window again; ``nth``: the start call that opens it."""
        self.pkg_dir = pkg_dir.rstrip(os.sep) + os.sep
        self.start, self.stop, self.restart, self.nth = start, stop, restart, nth
        self.seen_starts = 0
        self.active = self.done = False
        self.stop_frame: Any = None
        self.entries: list[tuple[str, str]] = []
        self.last: Optional[str] = None

    def _rel(self, code: Any) -> Optional[str]:
        fn = code.co_filename
        return fn[len(self.pkg_dir):] if fn.startswith(self.pkg_dir) else None

    def _call(self, code: Any, rel: str) -> None:
        if rel != self.last:
            self.entries.append((rel, getattr(code, "co_qualname", code.co_name)))
            self.last = rel

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.done:
            return
        if event == "call":
            code = frame.f_code
            rel = self._rel(code)
            if rel is None:
                return
            if self.start(code) and (not self.active or self.restart):
                self.seen_starts += 1
                if self.seen_starts >= self.nth:
                    self.active, self.entries, self.last, self.stop_frame = True, [], None, None
                    self._call(code, rel)
                    if self.stop is None or self.stop(code):
                        self.stop_frame = frame
                    return
            if self.active:
                self._call(code, rel)
                if self.stop_frame is None and self.stop is not None and self.stop(code):
                    self.stop_frame = frame
        elif event == "return" and self.active and frame is self.stop_frame:
            self.done = True

    def result(self) -> dict[str, Any]:
        files = [f for f, _ in self.entries]
        return {"complete": self.done, "entries": len(files), "distinct": len(set(files)), "files": files,
                "calls": [f"{f}:{q}" for f, q in self.entries]}


def _qual(code: Any) -> str:
    return getattr(code, "co_qualname", code.co_name)


def _find_engine() -> Any:
    import importlib

    for name in (f"{PKG}.engine.engine", f"{PKG}.core.engine", f"{PKG}.engine", f"{PKG}.core"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "ShardEngine"):
            return mod.ShardEngine
    pkg = importlib.import_module(PKG)
    for f in sorted(Path(pkg.__file__).parent.rglob("*.py")):
        if "class ShardEngine" in f.read_text(encoding="utf-8"):
            rel = f.relative_to(Path(pkg.__file__).parent.parent).with_suffix("")
            return importlib.import_module(".".join(rel.parts)).ShardEngine
    raise ImportError("no ShardEngine in the package")


def _test_constructions(stage: int) -> list[tuple[str, dict[str, Any]]]:
    """The engine constructions of tests/engine/test_engine_dist.py for ``stage`` (source, namespace)."""
    path = Path.cwd() / "tests" / "distributed" / "test_engine_dist.py"
    if not path.exists():
        return []
    src = path.read_text(encoding="utf-8")
    tree = ast.parse(src)
    out = []
    top_imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    for fn in [n for n in tree.body if isinstance(n, ast.FunctionDef)]:
        local_imports = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            st = kw.get("stage")
            if not (isinstance(st, ast.Constant) and st.value == stage):
                continue
            ns: dict[str, Any] = {}
            for imp in top_imports + local_imports:
                try:
                    exec(compile(ast.Module([imp], []), str(path), "exec"), ns)  # noqa: S102 - the test's imports
                except Exception:  # noqa: BLE001
                    pass
            out.append((ast.get_source_segment(src, node) or "", ns))
    out.sort(key=lambda c: len(c[0]))
    return out


def _options_attempts(engine_cls: Any, stage: int, model: Any, opt: Any) -> list[tuple[str, Any]]:
    """The engine built from an options object (``lightning_shard.options.options_for``, where the checkout has
    one): accumulation ``defer`` (the old engine's default) or the first that the stage accepts; stage 3 with
    ``min_unit_mb=0`` set in whichever knob group holds it, then with the defaults."""
    import dataclasses
    import importlib

    try:
        mod = importlib.import_module(f"{PKG}.options")
        options_for = mod.options_for
        name = f"zero{stage}"
        cls = mod.REGISTERED[name][0]
    except Exception:  # noqa: BLE001 - no options module in this checkout
        return []
    extras: list[tuple[str, dict[str, Any]]] = []
    if stage == 3:
        try:
            inst = cls(stage=stage)
            for f in dataclasses.fields(cls):
                value = getattr(inst, f.name)
                if dataclasses.is_dataclass(value) and "min_unit_mb" in {g.name for g in dataclasses.fields(value)}:
                    extras.append((f"{f.name}={type(value).__name__}(min_unit_mb=0)",
                                   {f.name: type(value)(min_unit_mb=0)}))
        except Exception:  # noqa: BLE001
            pass
    extras.append(("", {}))
    out = []
    for acc in ("defer", "keep_unsharded_grads", "per_micro_batch"):
        for text, extra in extras:
            how = f"ShardEngine(model, [opt], options_for({name!r}, accumulation={acc!r}{', ' + text if text else ''}))"
            out.append((how, lambda acc=acc, extra=extra: engine_cls(
                model, [opt], options_for(name, accumulation=acc, **extra))))
    return out


def _build(stage: int, model: Any, opt: Any) -> tuple[Any, str, list[str]]:
    """The engine, by the current signature first, then by the tests' constructions; raises the first error."""
    import dataclasses

    errors = []
    try:
        engine_cls = _find_engine()
        attempts: list[tuple[str, Any]] = []
        if stage == 3:
            unit_config = getattr(sys.modules[engine_cls.__module__], "UnitConfig", None)
            if unit_config is not None and "min_unit_mb" in {f.name for f in dataclasses.fields(unit_config)}:
                # one unit per Linear: the default merges units below 1 MiB into the enclosing one
                attempts.append(("ShardEngine(model, [opt], stage=3, units=UnitConfig(min_unit_mb=0))",
                                 lambda: engine_cls(model, [opt], stage=3, units=unit_config(min_unit_mb=0))))
        attempts.append((f"ShardEngine(model, [opt], stage={stage})", lambda: engine_cls(model, [opt], stage=stage)))
        attempts += _options_attempts(engine_cls, stage, model, opt)
        for how, make in attempts:
            try:
                return make(), how, errors
            except Exception as e:  # noqa: BLE001 - the signature may be changing: try the next way
                errors.append(f"{how}: {type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001
        errors.append(f"finding ShardEngine: {type(e).__name__}: {e}")
    for src, ns in _test_constructions(stage):
        ns = dict(ns, model=model, opt=opt)
        try:
            engine = eval(src, ns)  # noqa: S307 - a construction of the package's own tests
            return engine, f"{src} (tests/engine/test_engine_dist.py)", errors
        except Exception as e:  # noqa: BLE001
            errors.append(f"{src}: {type(e).__name__}: {e}")
    raise RuntimeError("could not construct the engine: " + " | ".join(errors))


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _batch(step: int, rank: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def walk_zero2(pkg_dir: str, rank: int) -> dict[str, Any]:
    import contextlib

    model, opt = _model()
    engine, how, errors = _build(2, model, opt)
    tracer = Tracer(pkg_dir, start=lambda c: _qual(c).endswith("_make_hook.<locals>.hook"),
                    stop=lambda c: c.co_name == "finish_reduce" or (c.co_name == "finish" and c.co_filename.endswith(
                        "buckets/grads.py")), restart=True)
    try:
        for step in range(2):
            for micro in range(2):  # accumulation 2: the second micro-batch is the boundary
                boundary = micro == 1
                x, y = _batch(2 * step + micro, rank)
                with contextlib.nullcontext() if boundary else engine.no_sync():
                    loss = ((model(x) - y) ** 2).mean()
                    engine.pre_backward()
                    trace = rank == 0 and step == 1 and boundary
                    if trace:
                        sys.setprofile(tracer)
                    try:
                        loss.backward()
                        engine.post_backward()
                    finally:
                        if trace:
                            sys.setprofile(None)
            _optimizer_step(engine, opt)
    finally:
        engine.remove_hooks()
    return dict(tracer.result(), engine=how, engine_attempts_failed=errors)


def _optimizer_step(engine: Any, opt: Any) -> None:
    """One optimizer step through the engine, as the strategies drive it."""
    engine.prepare_step(opt)
    opt.step()
    engine.finish_step(opt)
    opt.zero_grad()


def walk_zero3(pkg_dir: str, rank: int) -> dict[str, Any]:
    model, opt = _model()
    engine, how, errors = _build(3, model, opt)
    controller = engine.controller
    # the second unit's pre-hook of the second step (the first pass records the schedule under the guard)
    tracer = Tracer(pkg_dir, start=lambda c: _qual(c).endswith("_pre_forward_hook.<locals>.hook"),
                    stop=None, restart=False, nth=2)
    units = len(getattr(engine, "units", []) or [])
    try:
        for step in range(2):
            x, y = _batch(step, rank)
            if controller is not None:
                controller.step_pre_forward()
            trace = rank == 0 and step == 1
            if trace:
                sys.setprofile(tracer)
            try:
                out = model(x)
            finally:
                if trace:
                    sys.setprofile(None)
            loss = ((out - y) ** 2).mean()
            if controller is not None:
                controller.step_post_forward(loss)
            engine.pre_backward()
            loss.backward()
            engine.post_backward()
            _optimizer_step(engine, opt)
    finally:
        engine.remove_hooks()
    return dict(tracer.result(), engine=how, engine_attempts_failed=errors, units=units)


def rank_main(rank: int, port: int, out: Optional[str]) -> None:
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import lightning_shard

    pkg_dir = str(Path(lightning_shard.__file__).resolve().parent)
    result: dict[str, Any] = {"package": pkg_dir}
    init = f"tcp://127.0.0.1:{port}"
    try:  # the package's own set-up (its exit guard for gloo's threads) when it has one
        engine_cls = _find_engine()
        C = next(v for v in vars(sys.modules[engine_cls.__module__]).values()
                 if getattr(v, "__name__", "").endswith(".collectives") and hasattr(v, "init_process_group"))
        C.init_process_group("gloo", rank, 2, init, timedelta(seconds=60))
    except Exception:  # noqa: BLE001
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    for name, walk in (("zero2", walk_zero2), ("zero3", walk_zero3)):
        try:
            result[name] = walk(pkg_dir, rank)
        except Exception as e:  # noqa: BLE001 - reported, the next walk runs
            result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
    if out:
        Path(out).write_text(json.dumps(result))
    try:
        dist.barrier()
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        os._exit(0)


# ---------------------------------------------------------------------------------------------- orchestration
def _isolate() -> None:
    """In a measuring subprocess: import the package from ``cwd`` only. An editable install of another checkout
    puts a finder after the path finder that would supply the modules this checkout lacks (e.g. ``engine/`` to a
    checkout that has ``core/``); it is removed, and the package imported must live under ``cwd``."""
    def editable(f: Any) -> bool:
        return getattr(f, "__module__", "").startswith("__editable__")

    sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
    sys.path_importer_cache.clear()
    import lightning_shard

    where = Path(lightning_shard.__file__).resolve().parent
    if where.parent != Path.cwd().resolve():
        raise SystemExit(f"imported {where}, not the package of {Path.cwd()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(root: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")


def measure_walks(root: Path, timeout: float = 300.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, str(HERE), "--_rank", str(r), "--_port", str(port)]
                                  + (["--_out", out] if r == 0 else []),
                                  cwd=root, env=_env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for r in range(2)]
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                logs.append(p.communicate()[0])
        if not Path(out).exists():
            err = {"error": "the world of 2 produced no result: " + (logs[0] or "")[-2000:]}
            return {"zero2": err, "zero3": err}
        return json.loads(Path(out).read_text())


def measure_keywords(root: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(HERE), "--_keywords"], cwd=root, env=_env(root),
                          capture_output=True, text=True, timeout=300)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": (proc.stderr or proc.stdout)[-2000:]}


def measure(root: Path) -> dict[str, Any]:
    pkg_dir = root / PKG
    if not pkg_dir.is_dir():
        raise SystemExit(f"no package {PKG}/ under {root}")
    mods = _modules(pkg_dir)
    components = strongly_connected(import_graph(mods))
    return {"root": str(root), "modules": len(mods),
            "largest_classes": largest_classes(pkg_dir, mods), "largest_files": largest_files(pkg_dir, mods),
            "cycles": {"count": len(components), "components": components},
            "keywords": measure_keywords(root), "walks": measure_walks(root)}


def _walk_lines(name: str, w: dict[str, Any]) -> list[str]:
    if "error" in w:
        return [f"  {name}: ERROR {w['error']}"]
    lines = [f"  {name}: {w['entries']} files entered, {w['distinct']} distinct"
             + ("" if w.get("complete") else " (window not closed)")]
    failed = len(w.get("engine_attempts_failed", []))
    lines.append(f"    engine: {w.get('engine')}" + (f" ({w['units']} units)" if "units" in w else "")
                 + (f" [after {failed} failed construction(s), listed in --json]" if failed else ""))
    lines += [f"    {i:2d}. {c}" for i, c in enumerate(w["calls"], 1)]
    return lines


def render(r: dict[str, Any]) -> str:
    out = [f"structure of {r['root']} ({r['modules']} modules)", "",
           "a. largest classes by instance attributes", f"  {'attrs':>5}  class"]
    out += [f"  {c['attrs']:>5}  {c['class']}" for c in r["largest_classes"]]
    out += ["", "   largest files by lines", f"  {'lines':>5}  file"]
    out += [f"  {f['lines']:>5}  {f['file']}" for f in r["largest_files"]]
    cyc = r["cycles"]
    out += ["", f"b. import cycles (strongly connected components > 1 module): {cyc['count']} (target 0)"]
    out += [f"  {len(c)} modules: {' '.join(c)}" for c in cyc["components"]]
    k = r["keywords"]
    out += ["", "c. Zero2Strategy keyword parameters"]
    if "error" in k:
        out += [f"  ERROR {k['error'].strip().splitlines()[-1] if k['error'].strip() else k['error']}"]
    else:
        out += [f"  before the first group: {k['before_first_group']}"
                f" (first group: {k['first_group'] or 'none'})", f"  in all: {k['total']}"]
    out += ["", "d. the walks (package files entered, rank 0 of 2 gloo ranks)"]
    walks = r["walks"]
    if "package" in walks:
        out.append(f"  package imported: {walks['package']}")
    out += _walk_lines("zero2 gradient (hook -> shard gradient set)", walks.get("zero2", {"error": "missing"}))
    out += _walk_lines("zero3 gather (unit pre-hook -> parameters usable)", walks.get("zero3", {"error": "missing"}))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=str(HERE.parents[1]), help="the checkout to measure (default: this one)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--_keywords", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_port", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._keywords or a._rank is not None:
        _isolate()
    if a._keywords:
        try:
            print(json.dumps(keyword_counts()))
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return
    if a._rank is not None:
        rank_main(a._rank, a._port, a._out)
        return
    result = measure(Path(a.root).resolve())
    print(json.dumps(result, indent=1) if a.json else render(result))


if __name__ == "__main__":
    main()
