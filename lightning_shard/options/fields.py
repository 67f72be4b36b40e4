"""The building blocks of the options: a documented field (:func:`knob`), a group field (:func:`group`), dtype
names, and what every options dataclass answers about itself (:class:`Fields`). Plain Python."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Mapping, Optional

DTYPE_NAMES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")


def knob(default: Any, doc: str, *, choices: Optional[tuple] = None, hydra: bool = True) -> Any:
    """A documented option field."""
    meta: dict[str, Any] = {"doc": " ".join(doc.split())}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if not hydra:
        meta["hydra"] = False
    return field(default=default, metadata=meta)


def group(cls: type, doc: str) -> Any:
    """A field holding an option group (its defaults unless given)."""
    return field(default_factory=cls, metadata={"doc": " ".join(doc.split()), "group": cls})


def dtype_name(value: Any, what: str, null: str) -> Optional[str]:
    """``None`` or the short name of a dtype given by name (``"bf16"``, ``"bfloat16"``) or as a torch dtype; ``null``:
    what None means, for the message."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"{what} must be null ({null}) or one of {sorted(DTYPE_NAMES)}, got {value!r}")
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)


def is_positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def check_bool(owner: Any, name: str, hint: str = "") -> None:
    if getattr(owner, name) not in (True, False):
        raise ValueError(f"{name} must be True or False{hint}, got {getattr(owner, name)!r}")


class Fields:
    """What every option dataclass answers about itself."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: (f.default_factory() if f.default is dataclasses.MISSING else f.default)  # type: ignore
                for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @classmethod
    def choices(cls, name: str) -> Optional[tuple]:
        return cls.__dataclass_fields__[name].metadata.get("choices")  # type: ignore[attr-defined]

    def _check_choice(self, name: str) -> None:
        valid = self.choices(name)
        if valid is not None and getattr(self, name) not in valid:
            raise ValueError(f"{name} must be one of {valid}, got {getattr(self, name)!r}")

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults (groups: as a dict of their changed fields)."""
        out: dict[str, Any] = {}
        for name, default in self.defaults().items():
            if self.__dataclass_fields__[name].metadata.get("hydra") is False:  # type: ignore[attr-defined]
                continue  # ``stage``: the registered class sets it
            value = getattr(self, name)
            if isinstance(value, Fields):
                inner = value.changed()
                if inner:
                    out[name] = inner
            elif value != default:
                out[name] = value
        return out



def merge(*parts: Optional[Mapping[str, Any]], **changes: Any) -> dict[str, Any]:
    """Options given as keywords, merged left to right; a group's mapping field by field:
    ``merge({"tuning": {"prefetch_depth": 1}}, tuning={"min_unit_mb": 0})`` keeps both fields."""
    out: dict[str, Any] = {}
    for part in (*parts, changes):
        for key, value in (part or {}).items():
            if isinstance(value, Mapping) and isinstance(out.get(key), dict):
                out[key] = {**out[key], **value}
            else:
                out[key] = dict(value) if isinstance(value, Mapping) else value
    return out


__all__ = ["DTYPE_NAMES", "Fields", "check_bool", "dtype_name", "group", "is_positive", "knob", "merge"]
