"""Shard units for ZeRO-3 and FSDP-style sharding: which parameters are gathered together.

* ``zero3``: every module with direct parameters is a unit (DeepSpeed stage-3 granularity).
* ``fsdp``: modules chosen by a wrap policy (module classes, or a minimum parameter count) are units; each
  owns the parameters of its subtree not owned by a nested unit.
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
        if isinstance(c, str) and c in (type(module).__name__, f"{type(module).__module__}.{type(module).__qualname__}"):
            return True
    return False


def auto_wrap_classes(root: nn.Module) -> tuple[type, ...]:
    """``wrap_classes="auto"``: the classes of modules held in an ``nn.ModuleList`` (transformer blocks)."""
    found: list[type] = []
    for m in root.modules():
        if isinstance(m, nn.ModuleList):
            for child in m:
                if any(True for _ in child.parameters()) and type(child) not in found:
                    found.append(type(child))
    if not found:
        raise ValueError("wrap_classes='auto' found no nn.ModuleList of blocks in this model; pass wrap_classes=[...] "
                         "(your block class) or min_params=N")
    return tuple(found)


def plan_units(root: nn.Module, granularity: str, wrap_classes=None, min_params: Optional[int] = None,
               numel: Callable[[nn.Parameter], int] = lambda p: p.numel()) -> list[UnitSpec]:
    """Units in forward-ish (registration) order, the root unit first if it holds anything."""
    classes = auto_wrap_classes(root) if wrap_classes == "auto" else _classes(wrap_classes)
    if granularity not in ("zero3", "fsdp"):
        raise ValueError(f"unit granularity must be 'zero3' or 'fsdp', got {granularity!r}")
    if granularity == "fsdp" and not classes and min_params is None:
        raise ValueError("fsdp_shard needs a wrap policy: wrap_classes=[...] (e.g. your transformer block class) "
                         "or min_params=N (wrap modules with at least N parameters)")
    modules = dict(root.named_modules())
    if granularity == "zero3":
        # containers have no forward of their own to hook: their parameters are read by the parent's code,
        # so they go to the parent's unit (the root unit when the parent is the LightningModule)
        unit_names = [n for n, m in modules.items() if n and any(True for _ in m.parameters(recurse=False))
                      and not isinstance(m, CONTAINERS)]
    else:
        unit_names = []
        for n, m in modules.items():
            if not n:
                if classes and _matches(m, classes):
                    raise ValueError(f"wrap policy {list(map(str, classes))} matches the root module "
                                     f"{type(m).__name__} itself: wrap its blocks instead (e.g. the transformer block class)")
                continue
            if (classes and _matches(m, classes)) or \
                    (min_params is not None and sum(numel(p) for p in m.parameters()) >= min_params
                     and any(True for _ in m.parameters(recurse=False))):
                unit_names.append(n)
        if not unit_names:
            present = sorted({type(m).__name__ for m in modules.values()})
            raise ValueError(f"wrap policy (classes={[str(c) for c in classes]}, min_params={min_params}) matched no "
                             f"module; module classes in this model: {present}")
        with_params = [n for n, m in modules.items() if n and any(True for _ in m.parameters(recurse=False))]
        if min_params is None and set(with_params) <= set(unit_names) and len(with_params) > 1:
            raise ValueError("the wrap policy makes every module with parameters a unit: that is ZeRO-3 granularity; "
                             "use strategy zero3, or wrap larger blocks (e.g. transformer block classes)")

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
        owners.setdefault(id(p), set()).add(owner_of(module_name))
        first_name.setdefault(id(p), full_name)
        params[id(p)] = p
    specs = {u: UnitSpec(u, modules[u]) for u in unit_names}
    specs[ROOT] = UnitSpec(ROOT, None)
    for pid, p in params.items():
        homes = owners[pid]
        if len(homes) > 1 and granularity == "fsdp" and ROOT not in homes:
            raise ValueError(f"parameter {first_name[pid]} is tied across units {sorted(homes)}: the wrap policy "
                             "would split it. Wrap a common parent of both modules, or leave one of them unwrapped "
                             "so the root unit holds the tied weight.")
        home = homes.pop() if len(homes) == 1 else ROOT
        specs[home].params.append(p)
        specs[home].names.append(first_name[pid])
    ordered = [specs[ROOT]] + [specs[u] for u in unit_names]
    return [s for s in ordered if s.params]
