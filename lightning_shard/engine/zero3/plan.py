"""Shard units for ZeRO-3 and FSDP-style sharding: which parameters are gathered together.

* ``zero3``: every module with direct parameters is a unit (DeepSpeed stage-3 granularity), except that a module
  whose unit would hold fewer than ``min_unit_bytes`` joins the unit of the module enclosing it
  (:func:`small_units_merged`): each unit costs an all-gather in forward, one in backward and a reduction, each
  with a fixed cost (latency, a hook, a thread hand-off) that a small unit's bytes do not pay back.
* ``fsdp``: modules chosen by a wrap policy (module classes, or a minimum parameter count) are units; each
  owns the parameters of its subtree not owned by a nested unit. ``wrap_classes="auto"`` takes the classes of
  the blocks held in ``nn.ModuleList``s; a model without any is one unit (the root), as Lightning's FSDP
  trains a model without a wrap policy.
* ``leaf_modules`` (both): modules whose whole subtree is one unit, gathered in the leaf's forward (e.g. a
  mixture-of-experts block, or a module whose code reads its children's weights in ways the bytecode scan of
  :mod:`.reads` cannot see).
* A ``torch.compile``'d module (``module.compile()`` in place, or the ``OptimizedModule`` that ``torch.compile``
  returns) is a leaf under ``zero3`` unless it holds a list of blocks: the engine's hooks run eagerly, so each
  unit boundary inside a compiled module is a graph break; one unit per compiled block keeps its graph whole.
* A parameter that a module's forward reads itself (``self.out_proj.weight`` in ``nn.MultiheadAttention``)
  belongs to the reader's unit; under ``zero3`` the reader becomes a unit if it was not one.
* The **root unit** holds every parameter no unit claims, plus tied parameters used by modules of different
  units (an embedding shared with the output head). The root is gathered around the whole training step,
  so a tied weight is always materialized wherever it is used.

A unit's parameters are split into flat buckets by (optimizer, param group, dtype, trainable); frozen
parameters are sharded too (LoRA-style fine-tunes keep the frozen base sharded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from torch import nn

from .reads import child_parameter_reads

ROOT = "<root>"
CONTAINERS = (nn.ParameterList, nn.ParameterDict, nn.ModuleList, nn.ModuleDict)


@dataclass
class UnitSpec:
    name: str  # module FQN, or ROOT
    module: Optional[nn.Module]  # None for the root unit (hooked around the training step)
    params: list[nn.Parameter] = field(default_factory=list)
    names: list[str] = field(default_factory=list)


def _classes(spec: Union[None, str, type, list, tuple]) -> tuple:
    if spec is None:
        return ()
    if isinstance(spec, (str, type)):
        spec = [spec]
    return tuple(spec)


def _matches(module: nn.Module, classes: tuple) -> bool:
    for c in classes:
        if isinstance(c, type) and isinstance(module, c):
            return True
        if isinstance(c, str) and c in (type(module).__name__,
                                        f"{type(module).__module__}.{type(module).__qualname__}"):
            return True
    return False


def auto_wrap_classes(root: nn.Module) -> tuple[type, ...]:
    """``wrap_classes="auto"``: the classes of modules held in an ``nn.ModuleList`` (transformer blocks); empty
    when the model has none (the whole model is then one unit)."""
    found: list[type] = []
    for m in root.modules():
        if isinstance(m, nn.ModuleList):
            for child in m:
                if any(True for _ in child.parameters()) and type(child) not in found:
                    found.append(type(child))
    return tuple(found)


def compiled_modules(root: nn.Module) -> list[str]:
    """FQNs of the modules ``torch.compile`` compiles: in place (``module.compile()``) or wrapped
    (``OptimizedModule``), outermost first, registration order."""
    from torch._dynamo.eval_frame import OptimizedModule

    return [n for n, m in root.named_modules()
            if getattr(m, "_compiled_call_impl", None) is not None or isinstance(m, OptimizedModule)]


def _holds_blocks(module: nn.Module) -> bool:
    return any(isinstance(m, nn.ModuleList) and any(True for _ in m.parameters()) for m in module.modules())


def _holder_bytes(root: nn.Module, readers: dict[int, set[str]],
                  numel: Callable[[nn.Parameter], int]) -> dict[str, int]:
    """Parameter bytes per module FQN: what it holds directly, a parameter read by a parent's code counted at the
    (first) reader; each tensor once."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for full_name, p in root.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        holder = sorted(readers[id(p)])[0] if id(p) in readers else (full_name.rsplit(".", 1)[0]
                                                                     if "." in full_name else "")
        out[holder] = out.get(holder, 0) + numel(p) * p.element_size()
    return out


def _named(root: nn.Module, spec) -> set[str]:
    """Names of the modules matching ``spec``: classes, class names, or module FQNs."""
    items = _classes(spec)
    return {n for n, m in root.named_modules() if n and (_matches(m, items) or n in items)}


def describe_plan(specs: list["UnitSpec"], granularity: str) -> str:
    """One line for the log: how many units of which classes, and what the root holds."""
    counts: dict[str, int] = {}
    for s in specs:
        if s.module is not None:
            counts[type(s.module).__name__] = counts.get(type(s.module).__name__, 0) + 1
    root = next((s for s in specs if s.module is None), None)
    kinds = ", ".join(f"{n} x {c}" for c, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    if not counts:
        return (f"{granularity} units: none below the root, so the whole model is one unit gathered around each "
                f"step ({len(root.params) if root else 0} parameters)")
    held = f"; root unit: {len(root.params)} parameters (tied or outside any unit)" if root else ""
    return f"{granularity} units: {kinds}{held}"


MERGE_FRACTION = 64  # zero3 merging stops at 1/64 of the model's parameter bytes: a small model keeps its units


def small_units_merged(modules: dict[str, nn.Module], leaves: set[str], holder_bytes: dict[str, int],
                       min_unit_bytes: float) -> list[str]:
    """zero3: the modules that are units when a unit must hold at least ``min_unit_bytes`` (already bounded by the
    model's size, see :data:`MERGE_FRACTION`).

    Bottom-up over the module tree: a module's unit would hold its own parameters (``holder_bytes``: what it holds
    directly or reads itself) plus those of the modules below it that are not units. A module becomes a unit when
    that reaches ``min_unit_bytes``; otherwise it passes them up to its parent (a block then holds its layer norms
    and small projections, gathered in the block's forward). Containers (``nn.ModuleList`` ...) have no forward to
    hook: they always pass up. What reaches the root goes to the root unit, gathered around the step. Leaves
    (``leaf_modules``, compiled modules) stay units of their whole subtree, whatever their size."""
    below: dict[str, int] = {}  # bytes passed up from non-unit children
    units: list[str] = []
    for name in reversed(list(modules)):  # pre-order reversed: every module after all of its descendants
        if not name:
            continue
        inside_leaf = any(name != leaf and name.startswith(leaf + ".") for leaf in leaves)
        if inside_leaf:
            continue
        total = holder_bytes.get(name, 0) + below.get(name, 0)
        is_container = isinstance(modules[name], CONTAINERS)
        if name in leaves or (not is_container and total > 0 and total >= min_unit_bytes):
            units.append(name)
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        below[parent] = below.get(parent, 0) + total
    return units


def plan_units(root: nn.Module, granularity: str, wrap_classes=None, min_params: Optional[int] = None,
               numel: Callable[[nn.Parameter], int] = lambda p: p.numel(), leaf_modules=None,
               min_unit_bytes: float = 0) -> list[UnitSpec]:
    """Units in forward-ish (registration) order, the root unit first if it holds anything. ``min_unit_bytes``
    (zero3): a unit holds at least min(this, the model's parameter bytes / :data:`MERGE_FRACTION`); smaller
    modules join the unit of a module enclosing them (:func:`small_units_merged`); 0: one unit per module."""
    auto = wrap_classes == "auto"
    classes = auto_wrap_classes(root) if auto else _classes(wrap_classes)
    if granularity not in ("zero3", "fsdp"):
        raise ValueError(f"unit granularity must be 'zero3' or 'fsdp', got {granularity!r}")
    if granularity == "fsdp" and not classes and min_params is None and not auto and not leaf_modules:
        raise ValueError("fsdp_shard needs a wrap policy: wrap_classes=[...] (e.g. your transformer block class), "
                         "min_params=N (wrap modules with at least N parameters) or 'auto'")
    modules = dict(root.named_modules())
    leaves = _named(root, leaf_modules)
    if leaf_modules and not leaves:
        present = sorted({type(m).__name__ for m in modules.values()})
        raise ValueError(f"leaf_modules={list(map(str, _classes(leaf_modules)))} matched no module of the model; "
                         f"module classes in this model: {present}")
    if granularity == "zero3":
        leaves |= {n for n in compiled_modules(root) if n and not _holds_blocks(modules[n])}
    # parameters that a module's forward code reads itself belong to the reader (see reads.py)
    all_params = dict(root.named_parameters(remove_duplicate=False))
    readers: dict[int, set[str]] = {}
    for n, m in modules.items():
        for rel in child_parameter_reads(m):
            p = all_params.get(f"{n}.{rel}" if n else rel)
            if p is not None:
                readers.setdefault(id(p), set()).add(n)
    if granularity == "zero3":
        # containers have no forward of their own to hook: their parameters are read by the parent's code,
        # so they go to the parent's unit (the root unit when the parent is the LightningModule)
        if min_unit_bytes > 0:
            sizes = _holder_bytes(root, readers, numel)
            bound = min(float(min_unit_bytes), sum(sizes.values()) / MERGE_FRACTION)
            unit_names = small_units_merged(modules, leaves, sizes, bound)
        else:
            reading = {r for rs in readers.values() for r in rs}
            unit_names = [n for n, m in modules.items() if n and not isinstance(m, CONTAINERS) and
                          (any(True for _ in m.parameters(recurse=False)) or n in reading)]
    else:
        unit_names = []
        for n, m in modules.items():
            if not n:
                if classes and _matches(m, classes):
                    raise ValueError(f"wrap policy {list(map(str, classes))} matches the root module "
                                     f"{type(m).__name__} itself: wrap its blocks instead "
                                     "(e.g. the transformer block class)")
                continue
            if (classes and _matches(m, classes)) or \
                    (min_params is not None and sum(numel(p) for p in m.parameters()) >= min_params
                     and any(True for _ in m.parameters(recurse=False))):
                unit_names.append(n)
        if not unit_names and not auto and not leaves:
            present = sorted({type(m).__name__ for m in modules.values()})
            raise ValueError(f"wrap policy (classes={[str(c) for c in classes]}, min_params={min_params}) matched no "
                             f"module; module classes in this model: {present}")
        with_params = [n for n, m in modules.items() if n and any(True for _ in m.parameters(recurse=False))]
        if min_params is None and not auto and set(with_params) <= set(unit_names) and len(with_params) > 1:
            raise ValueError("the wrap policy makes every module with parameters a unit: that is ZeRO-3 granularity; "
                             "use strategy zero3, or wrap larger blocks (e.g. transformer block classes)")

    # a leaf's subtree is one unit: no unit inside it survives
    inside = lambda n: any(n != leaf and n.startswith(leaf + ".") for leaf in leaves)  # noqa: E731
    unit_names = [n for n in dict.fromkeys(unit_names + sorted(leaves, key=list(modules).index)) if not inside(n)]
    unit_names.sort(key=list(modules).index)

    # owner unit of each parameter: the innermost unit whose subtree contains the module holding it
    def owner_of(module_name: str) -> str:
        best = ROOT
        for u in unit_names:
            if module_name == u or module_name.startswith(u + "."):
                if best == ROOT or len(u) > len(best):
                    best = u
        return best

    owners: dict[int, set[str]] = {}
    first_name: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    for full_name, p in root.named_parameters(remove_duplicate=False):
        module_name = full_name.rsplit(".", 1)[0] if "." in full_name else ""
        if id(p) in readers:  # read by a parent's code: the readers' units, not the holder's
            owners.setdefault(id(p), set()).update(owner_of(r) for r in readers[id(p)])
        else:
            owners.setdefault(id(p), set()).add(owner_of(module_name))
        first_name.setdefault(id(p), full_name)
        params[id(p)] = p
    specs = {u: UnitSpec(u, modules[u]) for u in unit_names}
    specs[ROOT] = UnitSpec(ROOT, None)
    for pid, p in params.items():
        homes = owners[pid]
        if len(homes) > 1 and granularity == "fsdp" and ROOT not in homes and pid not in readers:
            raise ValueError(f"parameter {first_name[pid]} is tied across units {sorted(homes)}: the wrap policy "
                             "would split it. Wrap a common parent of both modules, or leave one of them unwrapped "
                             "so the root unit holds the tied weight.")
        home = homes.pop() if len(homes) == 1 else ROOT
        specs[home].params.append(p)
        specs[home].names.append(first_name[pid])
    ordered = [specs[ROOT]] + [specs[u] for u in unit_names]
    return [s for s in ordered if s.params]
