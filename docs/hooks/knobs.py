"""mkdocs hook: the option reference (``docs/knobs.md``) rendered at build time from the one options list,
``lightning_shard/options`` (names, types, defaults, choices and documentation of every strategy's options, flat and
per group), and the strategy names from the shipped Hydra configs (``lightning_shard/conf/strategy/*.yaml``).

``docs/knobs.md`` holds only an introduction and :data:`MARKER`; :func:`on_page_markdown` replaces the marker with
:func:`render`. A knob added to the options is on the page at the next build, and there is no hand-written copy to
drift. A page without the marker fails the build.

The options package is plain Python (no torch, no Lightning): it is loaded on its own, without importing
``lightning_shard`` (whose ``__init__`` imports torch and Lightning to register the strategy names), so the build
stays fast and needs no accelerator. ``tests/package/test_docs.py`` renders the page without mkdocs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Optional

ROOT = Path(__file__).resolve().parents[2]
PAGE = "knobs.md"
MARKER = "<!-- knobs: the option reference is generated here from lightning_shard/options (docs/hooks/knobs.py) -->"
GROUP_ORDER = ("tuning", "compression", "safety", "launch")


def load_options(root: Path = ROOT) -> ModuleType:
    """``lightning_shard.options``: the imported module if it is loaded already, else the package loaded on its own
    under a private name (its modules import only each other and the standard library)."""
    if "lightning_shard.options" in sys.modules:
        return sys.modules["lightning_shard.options"]
    name = "_lightning_shard_options_for_docs"
    if name in sys.modules:
        return sys.modules[name]
    folder = root / "lightning_shard" / "options"
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    assert spec is not None and spec.loader is not None, folder
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def strategies_of(options: ModuleType) -> list[tuple[str, type, Optional[int]]]:
    """(Hydra strategy name, options class, stage) of every strategy: the registered names, then ``auto``."""
    out = [(name, cls, stage) for name, (cls, stage) in options.REGISTERED.items()]
    return out + [("auto", options.AutoOptions, None)]


# --- text ------------------------------------------------------------------------------------------------------------

def prose(doc: str) -> str:
    """A docstring of the options as Markdown: ``code`` -> `code`, :class:`X` -> `X`."""
    doc = re.sub(r":(?:class|func|meth|attr|mod|data|exc):`~?([^`]+)`", r"`\1`", doc)
    return re.sub(r"``([^`]+)``", r"`\1`", " ".join(doc.split()))


def _py(v: Any) -> str:
    """``v`` as Python source, strings in double quotes."""
    return f'"{v}"' if isinstance(v, str) else repr(v)


def value(v: Any) -> str:
    """A default or choice as Python spells it, in a code span."""
    if isinstance(v, type):
        return f"`{v.__name__}()`"
    return f"`{_py(v)}`"


def type_name(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", repr(f.type))
    return f"`{t}`"


def names(strategies: list[str], every: list[str]) -> str:
    return "all" if strategies == every else ", ".join(strategies)


def cell(text: str) -> str:
    return text.replace("|", r"\|")


# --- what each strategy says about one option ------------------------------------------------------------------------

@dataclasses.dataclass
class Variant:
    """One option as some strategies define it (same type, default, choices and documentation)."""

    strategies: list[str]
    type: str
    default: Any
    choices: Optional[tuple]
    doc: str
    hydra: bool


def _choices(cls: type, name: str, stage: Optional[int]) -> Optional[tuple]:
    if name in getattr(cls, "__dataclass_fields__", {}) and hasattr(cls, "choices"):
        try:
            return cls.choices(name, stage)  # the options classes narrow `accumulation` by stage
        except TypeError:
            return cls.choices(name)  # a group's Fields.choices(name)
    return None


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def variants(fields: Iterable[tuple[str, type, Optional[int], dataclasses.Field]]) -> list[Variant]:
    """Group (strategy, owning class, stage, field) by what the strategies agree on, in the strategies' order."""
    out: list[Variant] = []
    for strategy, owner, stage, f in fields:
        default = _default(f)
        shown = default.__class__ if dataclasses.is_dataclass(default) else default
        v = Variant([strategy], type_name(f), shown, _choices(owner, f.name, stage), prose(f.metadata.get("doc", "")),
                    f.metadata.get("hydra", True))
        for seen in out:
            if (seen.type, repr(seen.default), seen.choices, seen.doc, seen.hydra) == \
                    (v.type, repr(v.default), v.choices, v.doc, v.hydra):
                seen.strategies.append(strategy)
                break
        else:
            out.append(v)
    return out


def _facts(v: Variant, key: str, every: list[str]) -> str:
    parts = [f"type {v.type}", f"default {value(v.default)}"]
    if v.choices is not None:
        parts.append("choices " + ", ".join(value(c) for c in v.choices))
    parts.append(f"Hydra `{key}`" if v.hydra else "not a Hydra key (the Hydra option `strategy=<name>` chooses it)")
    return f"**{names(v.strategies, every)}**: " + "; ".join(parts)


def entry(title: str, anchor: str, key: str, vs: list[Variant], every: list[str]) -> list[str]:
    """One option: heading (with a stable anchor), facts per strategy variant, documentation."""
    lines = [f"### `{title}` {{#{anchor}}}", ""]
    docs: list[str] = []
    for v in vs:
        if v.doc not in docs:
            docs.append(v.doc)
    for doc in docs:
        for v in vs:
            if v.doc == doc:
                lines += [f"- {_facts(v, key, every)}"]
        lines += ["", doc or "(no documentation)", ""]
    return lines


# --- the page --------------------------------------------------------------------------------------------------------

def _yaml_comment(text: str) -> str:
    """The comment a shipped config opens with, less the pointer every strategy config ends with."""
    head = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        head.append(line.lstrip("#").strip())
    return re.sub(r"\s*Every other option has its default:.*$", "", " ".join(head))


def _target(path: Path) -> str:
    """The class name a shipped strategy config instantiates."""
    import yaml

    return str((yaml.safe_load(path.read_text()) or {}).get("_target_", "")).rsplit(".", 1)[-1]


def strategy_names(conf: Path) -> list[str]:
    """The Hydra ``strategy=`` options: the shipped ``conf/strategy/*.yaml``, their class and what they preset."""
    import yaml  # a dependency of the package (topology presets)

    lines = ["| `strategy=` | class | preset values | what it is |", "| --- | --- | --- | --- |"]
    for path in sorted(conf.glob("*.yaml")):
        text = path.read_text()
        data = yaml.safe_load(text) or {}
        target = _target(path)
        preset = ", ".join(f"`{k}={v}`" for k, v in data.items() if k not in ("defaults", "_target_"))
        lines.append(f"| `{path.stem}` | `{target}` | {cell(preset) or '-'} | {cell(_yaml_comment(text))} |")
    return lines


def render(options: Optional[ModuleType] = None, strategies: Optional[list[tuple[str, type, Optional[int]]]] = None,
           conf: Optional[Path] = None) -> str:
    """The option reference in Markdown: the strategy names, an overview table, every flat option, every group."""
    options = options or load_options()
    strategies = strategies or strategies_of(options)
    every = [s for s, _, _ in strategies]
    conf = conf or ROOT / "lightning_shard" / "conf" / "strategy"

    flat: dict[str, list] = {}  # option -> [(strategy, class, stage, field)], in first-seen order
    groups: dict[str, list] = {}  # group -> [(strategy, group class, stage, group field)]
    for strategy, cls, stage in strategies:
        for f in dataclasses.fields(cls):
            if "group" in f.metadata:
                groups.setdefault(f.name, []).append((strategy, f.metadata["group"], stage, f))
            else:
                flat.setdefault(f.name, []).append((strategy, cls, stage, f))

    overview = ["| option | Hydra key | default | strategies |", "| --- | --- | --- | --- |"]
    body: list[str] = ["## Flat options", "",
                       "Keyword arguments of every strategy class (`Zero2Strategy(accumulation=\"defer\")`) and keys "
                       "of the Hydra `strategy` node (`strategy.accumulation=defer`).", ""]

    def add(title: str, key: str, vs: list[Variant]) -> None:
        by_default: dict[str, list[str]] = {}
        for v in vs:
            by_default.setdefault(value(v.default), []).extend(v.strategies)
        defaults = "; ".join(d + (f" ({names(who, every)})" if len(by_default) > 1 else "")
                             for d, who in by_default.items())
        who = sorted({s for v in vs for s in v.strategies}, key=every.index)
        hydra_key = f"`{key}`" if any(v.hydra for v in vs) else "-"
        overview.append(f"| [`{title}`](#{title}) | {hydra_key} | {cell(defaults)} | {names(who, every)} |")
        body.extend(entry(title, title, key, vs, every))

    for name, fields in flat.items():
        add(name, f"strategy.{name}", variants(fields))

    ordered = [g for g in GROUP_ORDER if g in groups] + [g for g in groups if g not in GROUP_ORDER]
    for gname in ordered:
        owners = groups[gname]
        classes: list[type] = []
        for _, gcls, _, _ in owners:
            if gcls not in classes:
                classes.append(gcls)
        first = owners[0][3]
        body += [f"## `{gname}`: {', '.join(f'`{c.__name__}`' for c in classes)} {{#group-{gname}}}", "",
                 prose(first.metadata.get("doc", ""))]
        for c in classes:
            who = [s for s, gcls, _, _ in owners if gcls is c]
            body += ["", f"`{c.__name__}` ({names(who, every)}): {prose(c.__doc__ or '')}"]
        example, ex = _example(classes[0])
        shipped = [s for s, _, _, _ in owners if (conf / f"{s}.yaml").exists()]
        shown = "zero2" if "zero2" in shipped else (shipped or [owners[0][0]])[0]
        target = _target(conf / f"{shown}.yaml") if shipped else "ZeroStrategy"
        body += ["", "Given as its dataclass or as a mapping of its fields (the other fields keep their defaults); "
                     "in Hydra as a dotted key or a nested YAML node:", "", "```python",
                 f"from lightning_shard.options import {classes[0].__name__}",
                 f"from lightning_shard.strategies import {target}", "",
                 f"{target}({gname}={classes[0].__name__}({example.name}={_py(ex)}))",
                 f"{target}({gname}={{\"{example.name}\": {_py(ex)}}})", "```", "", "```bash",
                 f"python -m lightning_shard.train strategy={shown} strategy.{gname}.{example.name}={_hydra(ex)}",
                 "```", "", "```yaml", f"{gname}:", f"  {example.name}: {_hydra(ex)}", "```", ""]
        fields: dict[str, list] = {}
        for strategy, gcls, stage, _ in owners:
            for g in dataclasses.fields(gcls):
                fields.setdefault(g.name, []).append((strategy, gcls, stage, g))
        for name, fs in fields.items():
            add(f"{gname}.{name}", f"strategy.{gname}.{name}", variants(fs))

    return "\n".join(["## Strategy names", "",
                      "The Hydra option `strategy=<name>` (`lightning_shard/conf/strategy/`); the same names, but "
                      "`auto`, are registered for `Trainer(strategy=...)` and `Fabric(strategy=...)` "
                      "(`strategy=auto` is `\"zero_auto\"` there: Lightning owns `\"auto\"`).", "",
                      *strategy_names(conf), "", "## Every option", "",
                      "Defaults as Python spells them (in YAML: `None` is `null`, `True` is `true`). **all** = "
                      + ", ".join(every) + ".", "", *overview, "", *body])


def _example(cls: type) -> tuple[dataclasses.Field, Any]:
    """A field of group ``cls`` and a value other than its default, for the spelling examples: a choice, else a
    number doubled, else a flipped flag."""
    fields = dataclasses.fields(cls)
    for f in fields:
        other = [c for c in (f.metadata.get("choices") or ()) if c != _default(f)]
        if other:
            return f, other[min(1, len(other) - 1)]
    for f in fields:
        d = _default(f)
        if isinstance(d, (int, float)) and not isinstance(d, bool):
            return f, d * 2
    for f in fields:
        if isinstance(_default(f), bool):
            return f, not _default(f)
    return fields[0], _default(fields[0])


def _hydra(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)


# --- mkdocs hooks ----------------------------------------------------------------------------------------------------

def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lost its marker {MARKER!r}: the option reference has nowhere to go")
    return markdown.replace(MARKER, render())
