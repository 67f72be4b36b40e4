"""The knobs of a strategy class, visible where users look: ``help(Zero2Strategy)``, ``inspect.signature``,
Jupyter/IDE call tips, type checkers, and the class docstring, all derived from the class's ``CONFIG`` dataclass
(``strategies/config.py``, where every knob is written once).

- :func:`takes_knobs_of` types a constructor ``(self, **knobs)`` as taking the config dataclass's keyword-only
  parameters, so static tools (pyright, mypy) see every knob with its type and default;
- :func:`describe` gives the class the same keyword-only signature at runtime (``__signature__``: the knobs, then
  Lightning's own Strategy arguments) and appends a "Knobs" section to its docstring with each field's doc.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
import typing
from typing import Any, Callable, Concatenate, Optional, ParamSpec

import torch
from lightning.pytorch.plugins.precision import Precision

# Lightning's own Strategy arguments, accepted for Lightning's sake and not knobs of ours
LIGHTNING_ARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")
_LIGHTNING_TYPES = {"parallel_devices": Optional[list[torch.device]], "precision_plugin": Optional[Precision]}

P = ParamSpec("P")


def takes_knobs_of(config: Callable[P, Any]) -> Callable[[Callable[..., None]], Callable[Concatenate[Any, P], None]]:
    """Decorate ``__init__(self, **knobs)``: static tools see the parameters of ``config`` (a dataclass)."""

    def decorate(init: Callable[..., None]) -> Any:
        return init

    return decorate


def signature_of(cls: type) -> inspect.Signature:
    """Keyword-only signature of strategy ``cls`` (no ``self``): its config's knobs, then Lightning's arguments."""
    config = cls.CONFIG  # type: ignore[attr-defined]
    hints = typing.get_type_hints(config)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
              for f in dataclasses.fields(config)]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None,
                                 annotation=_LIGHTNING_TYPES.get(n, Any))
               for n in getattr(cls, "LIGHTNING_ARGS", LIGHTNING_ARGS)]
    return inspect.Signature(params, return_annotation=None)


def describe(cls: type) -> None:
    """Give ``cls`` its keyword-only signature and append the knob list (defaults and docs) to its docstring."""
    cls.__signature__ = signature_of(cls)  # type: ignore[attr-defined]
    lines = []
    for f in dataclasses.fields(cls.CONFIG):  # type: ignore[attr-defined]
        what = f.metadata["doc"]
        if f.name == "stage":
            what = f"ZeRO stage; None = {getattr(cls, 'DEFAULT_STAGE', '?')} for this class"
        lines.append(f"    {f.name}={f.default!r}")
        lines.append(textwrap.fill(what, 110, initial_indent=" " * 8, subsequent_indent=" " * 8,
                                   break_on_hyphens=False, break_long_words=False))
    not_hydra = [f"``{f.name}``" for f in dataclasses.fields(cls.CONFIG) if f.metadata.get("hydra") is False]
    but = f" but {', '.join(not_hydra)}" if not_hydra else ""
    doc = (cls.__dict__.get("__doc__") or "").rstrip()
    cls.__doc__ = (f"{doc}\n\n    Knobs (keyword arguments, in strategies/config.py; each{but} is also a Hydra key of "
                   f"conf/strategy/):\n\n" + "\n".join(lines) + "\n")


__all__ = ["LIGHTNING_ARGS", "describe", "signature_of", "takes_knobs_of"]
