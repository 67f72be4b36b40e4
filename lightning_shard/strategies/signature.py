"""The options of a strategy class, visible where users look: ``help(Zero2Strategy)``, ``inspect.signature``,
Jupyter/IDE call tips, type checkers, and the class docstring, all derived from the class's ``OPTIONS`` dataclass
(``lightning_shard/options``, where every option is written once).

- :func:`takes_options_of` types a constructor ``(self, **options)`` as taking the options dataclass's keyword-only
  parameters, so static tools (pyright, mypy) see every option with its type and default;
- :func:`describe` gives the class the same keyword-only signature at runtime (``__signature__``: the options, then
  Lightning's own Strategy arguments) and appends an "Options" section to its docstring: the flat options first,
  then each group with its fields.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
import typing
from typing import Any, Callable, Concatenate, Optional, ParamSpec

import torch
from lightning.pytorch.plugins.precision import Precision

# Lightning's own Strategy arguments, accepted for Lightning's sake and not options of ours
LIGHTNING_ARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")
_LIGHTNING_TYPES = {"parallel_devices": Optional[list[torch.device]], "precision_plugin": Optional[Precision]}

P = ParamSpec("P")


def takes_options_of(options: Callable[P, Any]) -> Callable[[Callable[..., None]], Callable[Concatenate[Any, P], None]]:
    """Decorate ``__init__(self, **options)``: static tools see the parameters of ``options`` (a dataclass)."""

    def decorate(init: Callable[..., None]) -> Any:
        return init

    return decorate


def signature_of(cls: type) -> inspect.Signature:
    """Keyword-only signature of strategy ``cls`` (no ``self``): its options, then Lightning's arguments."""
    options = cls.OPTIONS  # type: ignore[attr-defined]
    hints = typing.get_type_hints(options)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name],
                                default=f.default_factory() if f.default is dataclasses.MISSING else f.default)
              for f in sorted(dataclasses.fields(options), key=lambda f: "group" in f.metadata)]  # flat first
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None,
                                 annotation=_LIGHTNING_TYPES.get(n, Any))
               for n in getattr(cls, "LIGHTNING_ARGS", LIGHTNING_ARGS)]
    return inspect.Signature(params, return_annotation=None)


def _entry(name: str, default: Any, doc: str, indent: int) -> list[str]:
    pad = " " * indent
    return [f"{pad}{name}={default!r}",
            textwrap.fill(doc, 110, initial_indent=pad + " " * 4, subsequent_indent=pad + " " * 4,
                          break_on_hyphens=False, break_long_words=False)]


def describe(cls: type) -> None:
    """Give ``cls`` its keyword-only signature and append the option list (defaults and docs) to its docstring."""
    cls.__signature__ = signature_of(cls)  # type: ignore[attr-defined]
    lines: list[str] = []
    groups = []
    for f in dataclasses.fields(cls.OPTIONS):  # type: ignore[attr-defined]
        if "group" in f.metadata:
            groups.append(f)
            continue
        what = f.metadata["doc"]
        if f.name == "stage":
            what = f"ZeRO stage; None = {getattr(cls, 'DEFAULT_STAGE', '?')} for this class"
        lines += _entry(f.name, f.default, what, 4)
    for f in groups:
        group = f.metadata["group"]
        lines += ["", f"    {f.name}={group.__name__}(...): {f.metadata['doc']}"]
        for g in dataclasses.fields(group):
            lines += _entry(g.name, g.default, g.metadata["doc"], 8)
    doc = (cls.__dict__.get("__doc__") or "").rstrip()
    cls.__doc__ = (f"{doc}\n\n    Options (keyword arguments, in lightning_shard/options; each but ``stage`` is "
                   "also a Hydra key of conf/strategy/, a group's fields as strategy.<group>.<field>; a group may be "
                   "given as a mapping of its fields):\n\n" + "\n".join(lines) + "\n")


__all__ = ["LIGHTNING_ARGS", "describe", "signature_of", "takes_options_of"]
