"""The knobs of a strategy class, visible where users look: ``help(Zero2Strategy)``, ``inspect.signature``,
Jupyter/IDE call tips that read ``__signature__``, and the class docstring.

The constructors pass most knobs down through ``**kwargs`` (zero3 / fsdp_shard add theirs to ZeroStrategy's), so
:func:`describe` gives each class the merged keyword-only signature of its own and its bases' ``__init__`` and
appends a "Knobs" section to its docstring, with each knob's default and the text the module docstrings give it.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from typing import Optional

# Lightning's own Strategy arguments, accepted for Lightning's sake and not knobs of ours
_LIGHTNING_ARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")
_ENTRY = re.compile(r"^``(\w+)``(?: / ``(\w+)``)?\s+(.*)$")


def knob_docs(doc: Optional[str]) -> dict[str, str]:
    """``name -> text`` from a module docstring's knob list (lines starting with ````name````, continued by
    indented lines)."""
    out: dict[str, list[str]] = {}
    current: list[str] = []
    for line in (doc or "").splitlines():
        m = _ENTRY.match(line)
        if m:
            current = [n for n in m.group(1, 2) if n]
            for n in current:
                out[n] = [m.group(3).strip()]
        elif current and line.startswith("   ") and line.strip():
            for n in current:
                out[n].append(line.strip())
        else:
            current = []
    return {k: " ".join(v) for k, v in out.items()}


def merged_signature(cls: type) -> inspect.Signature:
    """Keyword-only signature of ``cls``: its own ``__init__``'s knobs first, then each base's."""
    params: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or not klass.__module__.startswith("lightning_shard."):
            continue
        for p in inspect.signature(init).parameters.values():
            if p.name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or p.name in params:
                continue
            params[p.name] = p.replace(kind=p.KEYWORD_ONLY)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Signature([self_param, *params.values()], return_annotation=None)


def describe(cls: type, *module_docs: Optional[str]) -> None:
    """Give ``cls.__init__`` the merged signature (when it passes knobs through ``**kwargs``) and append the
    knob list to the class docstring."""
    sig = merged_signature(cls)
    init = cls.__dict__.get("__init__")
    if init is not None and any(p.kind == p.VAR_KEYWORD for p in inspect.signature(init).parameters.values()):
        init.__signature__ = sig
    texts: dict[str, str] = {}
    for doc in module_docs:
        texts.update(knob_docs(doc))
    lines = []
    for p in list(sig.parameters.values())[1:]:
        if p.name in _LIGHTNING_ARGS:
            continue
        default = "" if p.default is inspect.Parameter.empty else f"={p.default!r}"
        what = texts.get(p.name, "")
        if p.name == "stage":
            what = f"ZeRO stage; None = {getattr(cls, 'DEFAULT_STAGE', '?')} for this class"
        lines.append(f"    {p.name}{default}")
        if what:
            lines.append(textwrap.fill(what, 110, initial_indent=" " * 8, subsequent_indent=" " * 8))
    doc = (cls.__dict__.get("__doc__") or "").rstrip()
    cls.__doc__ = f"{doc}\n\n    Knobs (keyword arguments; each is also a Hydra key of conf/strategy/):\n\n" + "\n".join(lines) + "\n"


__all__ = ["describe", "knob_docs", "merged_signature"]
