"""Which parameters of its children a module's ``forward`` reads itself, found from the bytecode.

ZeRO-3 gathers a unit's parameters in its module's forward pre-hook. Code such as
``torch.nn.MultiheadAttention.forward`` passes ``self.out_proj.weight`` to a functional op instead of calling
``self.out_proj``, so the child's own forward (and its hooks) never runs and its weight would still be a shard.
This module lists, for a module, the parameters reached by attribute chains from ``self`` in the code of its
class's ``forward`` (every class of the MRO that defines one, and nested functions/comprehensions that close
over ``self``): ``self.out_proj.weight``, ``self.a.b.bias``, ``self.head.weight`` of a parametrized module (the
parametrization's originals). The planner then puts those parameters into the reader's unit.

This is a static over-approximation (a chain used only for ``.dtype`` counts as a read; that costs granularity,
never correctness). What it cannot see (indexing ``self.layers[0].weight``, a module handed to a helper that
reads its weight) is caught at run time by :mod:`lightning_shard.engine.zero3.guard` during the first step.
"""

from __future__ import annotations

import dis
import inspect
import types
from functools import lru_cache

from torch import nn

_ATTR_OPS = {"LOAD_ATTR", "LOAD_METHOD"}
_SELF_OPS = {"LOAD_FAST", "LOAD_DEREF", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_FAST_LOAD_FAST"}


def _chains(code: types.CodeType, self_name: str) -> list[tuple[str, ...]]:
    """Attribute chains ``self.a.b...`` (at least two names long) in ``code`` and the code nested in it."""
    out: list[tuple[str, ...]] = []
    ins = list(dis.get_instructions(code))
    for i, x in enumerate(ins):
        if x.opname in _SELF_OPS and x.argval == self_name:
            chain = []
            j = i + 1
            while j < len(ins) and ins[j].opname in _ATTR_OPS:
                chain.append(str(ins[j].argval))
                j += 1
            if len(chain) >= 2:
                out.append(tuple(chain))
    for const in code.co_consts:
        if isinstance(const, types.CodeType) and self_name in const.co_freevars:
            out += _chains(const, self_name)
    return out


@lru_cache(maxsize=None)
def _class_chains(cls: type) -> tuple[tuple[str, ...], ...]:
    found: list[tuple[str, ...]] = []
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or "forward" not in vars(klass):
            continue
        fn = inspect.unwrap(vars(klass)["forward"])
        code = getattr(fn, "__code__", None)
        if code is None or code.co_argcount < 1:
            continue
        try:
            found += _chains(code, code.co_varnames[0])
        except (TypeError, ValueError):  # code we cannot disassemble: the run-time guard covers it
            continue
    return tuple(dict.fromkeys(found))


def child_parameter_reads(module: nn.Module) -> list[str]:
    """Names (relative to ``module``) of descendants' parameters that ``module``'s forward code reads itself."""
    names: list[str] = []
    for chain in _class_chains(type(module)):
        obj: nn.Module = module
        path: list[str] = []
        for k, attr in enumerate(chain):
            if attr in obj._modules and isinstance(obj._modules[attr], nn.Module):
                obj = obj._modules[attr]
                path.append(attr)
                continue
            if k >= 1 and attr in obj._parameters and obj._parameters[attr] is not None:
                names.append(".".join(path + [attr]))
            elif k >= 1 and attr in getattr(obj, "parametrizations", {}):  # weight_norm & co: the originals
                prefix = ".".join(path + ["parametrizations", attr])
                names += [f"{prefix}.{n}" for n, _ in obj.parametrizations[attr].named_parameters()]
            break
    return list(dict.fromkeys(names))
