"""The knob list is written once (lightning_shard/strategies/config.py) and everything else is derived from it:
the strategy classes' signatures, KNOBS and docstrings, the Hydra schemas, the YAML files (only what differs from
the defaults), the pre-launch choices, the README's table; mirrors the planner must keep (it may not import the
strategies) are compared with it here, and a scan of the package finds no other hard-coded list of knob names."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest
import yaml

from lightning_shard.app.checks import ConfigError, check_strategy
from lightning_shard.app.schema import SCHEMAS
from lightning_shard.strategies import (
    AutoStrategy,
    FSDPShardStrategy,
    Zero0Strategy,
    Zero1Strategy,
    Zero2Strategy,
    Zero3Strategy,
    ZeroStrategy,
)
from lightning_shard.strategies.config import CONFIGS, AutoConfig, FSDPConfig, Zero3Config, ZeroConfig
from lightning_shard.strategies.knobs import LIGHTNING_ARGS

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "lightning_shard"
STRATEGIES = (ZeroStrategy, Zero0Strategy, Zero1Strategy, Zero2Strategy, Zero3Strategy, FSDPShardStrategy, AutoStrategy)
KNOB_NAMES = {f.name for c in CONFIGS for f in dataclasses.fields(c)}
# literals / classes naming several knobs that are not the knob list, each with the reason it cannot derive
ALLOWED = {
    ("planner/config.py", "StrategyConfig"): "the planner's model of a strategy row; planner never imports strategies",
    ("planner/advice.py", "CLASS_DEFAULTS"): "mirror of the defaults for the planner, compared below",
    ("planner/config.py", "Job"): "the planner's model of a job (accumulation steps, DDP-like flags)",
    ("app/schema.py", "DDPStrategyConf"): "Lightning's DDPStrategy keywords, not ours",
    ("engine/settings.py", "UnitConfig"): "the engine's own parameters; core imports torch only",
    ("strategies/__init__.py", "REGISTERED"): "registry presets: the few values a registered name sets",
    ("strategies/adapter.py", "ATTRIBUTE_OF"): "the knobs stored under another attribute name",
}


def _hydra_fields(config: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(config) if f.metadata.get("hydra", True)]


def _squash(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_knob_has_a_doc_and_a_valid_default(config):
    for f in dataclasses.fields(config):
        doc = f.metadata.get("doc")
        assert isinstance(doc, str) and len(doc.split()) >= 4, f"{config.__name__}.{f.name}: no doc"
        choices = f.metadata.get("choices")
        if choices is not None:
            assert f.default in choices, f"{config.__name__}.{f.name}: default not among its choices"
        assert f.kw_only and f.default is not dataclasses.MISSING, f"{config.__name__}.{f.name}"
    # the defaults pass the rules (stage resolved the way the strategies resolve it)
    cfg = config(stage=max(config.STAGES))
    assert cfg.validate() is cfg


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_signature_knobs_and_docstring_come_from_the_config(cls):
    config = cls.CONFIG
    names = [f.name for f in dataclasses.fields(config)]
    sig = inspect.signature(cls)
    assert list(sig.parameters) == names + list(LIGHTNING_ARGS)
    assert all(p.kind is p.KEYWORD_ONLY for p in sig.parameters.values())
    for f in dataclasses.fields(config):
        assert sig.parameters[f.name].default == f.default, (cls.__name__, f.name)
    assert cls.KNOBS == tuple(names) + LIGHTNING_ARGS
    assert cls.STAGES == config.STAGES and cls.ACCUMULATION == config.choices("accumulation")
    doc = _squash(cls.__doc__)
    for f in dataclasses.fields(config):
        if f.name != "stage":  # its text names the class's own stage
            assert _squash(f.metadata["doc"]) in doc, (cls.__name__, f.name)
    # every knob is accepted at its default, and lands on the instance
    strategy = cls(**{f.name: f.default for f in dataclasses.fields(config)})
    assert strategy.stage == cls.DEFAULT_STAGE and strategy.config.stage == cls.DEFAULT_STAGE
    with pytest.raises(TypeError, match=r"'prefetch_dept'.*did you mean 'prefetch_depth'|'prefetch_dept'"):
        cls(prefetch_dept=2)


def test_the_config_classes_match_the_strategy_classes():
    assert {c.CONFIG for c in STRATEGIES} == set(CONFIGS)
    assert (Zero3Strategy.CONFIG, FSDPShardStrategy.CONFIG,
            AutoStrategy.CONFIG) == (Zero3Config, FSDPConfig, AutoConfig)
    assert issubclass(Zero3Config, ZeroConfig) and issubclass(FSDPConfig, Zero3Config)


def test_hydra_schemas_are_the_configs():
    seen = set()
    for name, schema in SCHEMAS["schema/strategy"].items():
        target = schema.__dataclass_fields__["_target_"].default
        module, _, attr = target.rpartition(".")
        config = getattr(getattr(importlib.import_module(module), attr), "CONFIG", None)
        if config is None:  # Lightning's DDPStrategy
            assert name == "ddp"
            continue
        seen.add(config)
        fields = dataclasses.fields(schema)
        assert [f.name for f in fields] == ["_target_"] + [f.name for f in _hydra_fields(config)], name
        for f in fields[1:]:
            assert f.default == config.__dataclass_fields__[f.name].default, (name, f.name)
    assert seen == set(CONFIGS)


@pytest.mark.parametrize("path", sorted((ROOT / "conf" / "strategy").glob("*.yaml")), ids=lambda p: p.stem)
def test_strategy_yaml_holds_only_what_differs_from_the_defaults(path):
    node = yaml.safe_load(path.read_text())
    module, _, attr = node["_target_"].rpartition(".")
    config = getattr(getattr(importlib.import_module(module), attr), "CONFIG", None)
    if config is None:
        return  # ddp: Lightning's own keywords
    defaults = {f.name: f.default for f in _hydra_fields(config)}
    for key, value in node.items():
        if key in ("defaults", "_target_"):
            continue
        assert key in defaults, f"{path.name}: {key} is not a knob of {config.__name__}"
        assert value != defaults[key], f"{path.name}: {key}={value!r} is the default; drop the line"


def test_planner_mirrors_agree_with_the_configs():
    from lightning_shard.planner.advice import CLASS_DEFAULTS, class_default
    from lightning_shard.planner.config import POLICIES

    for stage, policies in POLICIES.items():
        config = Zero3Config if stage == 3 else ZeroConfig
        assert set(policies) == set(config.choices("accumulation", stage)) - {"auto"}, stage
    defaults = {**FSDPConfig.defaults(), **Zero3Config.defaults()}
    for key, value in CLASS_DEFAULTS.items():
        assert defaults[key] == value, key
    for name, config in (("zero3", Zero3Config), ("fsdp_shard", FSDPConfig), ("zero2", ZeroConfig)):
        for key, value in config.defaults().items():
            if key in CLASS_DEFAULTS:
                assert class_default(name, key) == value, (name, key)


def test_prefetch_depth_defaults_agree_from_knob_to_engine_and_planner():
    """zero3 gathers 3 units ahead, fsdp_shard 1 (settings.py): the strategies' knobs, the engine's
    UnitConfig when none is given, and the planner's rows say the same."""
    from lightning_shard.engine.settings import PREFETCH_DEPTH, UnitConfig
    from lightning_shard.planner.config import StrategyConfig

    assert PREFETCH_DEPTH == {"zero3": 3, "fsdp": 1}
    assert Zero3Strategy().prefetch_depth == 3
    assert FSDPShardStrategy(wrap_classes="auto").prefetch_depth == 1
    assert Zero3Strategy(prefetch_depth=0).prefetch_depth == 0
    assert UnitConfig("zero3").prefetch_depth == 3 and UnitConfig("fsdp").prefetch_depth == 1
    assert UnitConfig("zero3", prefetch_depth=0).prefetch_depth == 0
    assert StrategyConfig("zero3", 3).prefetch_depth == 3 and StrategyConfig("fsdp_shard", 3).prefetch_depth == 1
    assert StrategyConfig("zero3", 3).kwargs()["prefetch_depth"] == 3


@pytest.mark.parametrize("config,target", [
    (ZeroConfig, "lightning_shard.strategies.Zero2Strategy"), (Zero3Config, "lightning_shard.strategies.Zero3Strategy"),
    (FSDPConfig, "lightning_shard.strategies.FSDPShardStrategy"),
    (AutoConfig, "lightning_shard.strategies.AutoStrategy"),
])
def test_prelaunch_choices_are_the_configs(config, target):
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        if not choices:
            continue
        with pytest.raises(ConfigError, match=re.escape(", ".join(map(str, config.choices(f.name, 3))))):
            check_strategy({"_target_": target, f.name: "bogus"}, 1, 1, 2)
        check_strategy({"_target_": target, f.name: f.default}, 1, 1, 2)


def test_readme_knob_table_is_true():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| knob | default | meaning |"):].split("\n\n")[0].splitlines()[2:]
    assert len(table) >= 10
    for row in table:
        names_cell, default_cell = [c.strip() for c in row.strip("|").split("|")[:2]]
        names = re.findall(r"`(\w+)`", names_cell)
        assert names and set(names) <= KNOB_NAMES, row
        given = [d.strip() for d in default_cell.split(",")]
        given = given if len(given) == len(names) else given[:1] * len(names)
        for name, cell in zip(names, given):
            token = re.match(r"`?([^`\s]+)`?", cell).group(1)
            value = {"None": None, "True": True, "False": False}.get(token, token)
            if isinstance(value, str) and re.fullmatch(r"[\d.]+", value):
                value = float(value)
            default = next(c.__dataclass_fields__[name].default for c in CONFIGS if name in c.__dataclass_fields__)
            assert value == default, f"README says {name}={value!r}, the default is {default!r}"


def knob_lists(source: str, min_names: int = 3) -> list[str]:
    """Literal tuples/lists/sets, dict literals and class bodies in ``source`` that name ``min_names`` knobs or more:
    each named by the variable or class it belongs to."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        owner = None
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            owner = ", ".join(ast.unparse(t) for t in targets)
        elif isinstance(node, ast.ClassDef):
            fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            if len(fields & KNOB_NAMES) >= min_names:
                found.append(node.name)
            continue
        for sub in ast.walk(node) if owner else ():
            if isinstance(sub, (ast.Tuple, ast.List, ast.Set)):
                strings = [e.value for e in sub.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            elif isinstance(sub, ast.Dict):
                strings = [k.value for k in sub.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            else:
                continue
            if len(set(strings) & KNOB_NAMES) >= min_names:
                found.append(owner)
                break
    # loops and calls outside assignments: `for key in ("bucket_mb", ...)`
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.iter, (ast.Tuple, ast.List, ast.Set)):
            strings = [e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(set(strings) & KNOB_NAMES) >= min_names:
                found.append(f"for ... in {ast.unparse(node.iter)[:40]}")
    return found


def test_the_scan_finds_a_knob_list():
    assert knob_lists('KNOBS = ("bucket_mb", "overlap", "prefetch_depth")\n') == ["KNOBS"]
    assert knob_lists("class C:\n    bucket_mb: float = 1\n    overlap: bool = True\n    stage: int = 0\n") == ["C"]
    assert knob_lists('def f(s):\n    for k in ["bucket_mb", "overlap", "timeout_s"]:\n        pass\n')
    assert knob_lists('D = {"bucket_mb": 1, "overlap": 2, "timeout_s": 3}\n') == ["D"]
    assert knob_lists('X = ("bucket_mb", "overlap")\n') == []


def test_no_other_hard_coded_knob_list_in_the_package():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel == "strategies/config.py":
            continue
        for owner in knob_lists(path.read_text()):
            if (rel, owner) not in ALLOWED:
                bad.append(f"{rel}: {owner}")
    assert not bad, f"knob names listed outside strategies/config.py: {bad}"


def test_module_docstrings_point_at_the_configs_instead_of_listing_knobs():
    for name in ("zero", "zero3", "auto", "fabric"):
        doc = importlib.import_module(f"lightning_shard.strategies.{name}").__doc__
        listed = [m for m in re.findall(r"^``(\w+)``", doc, re.M) if m in KNOB_NAMES]
        assert not listed, (name, listed)
        assert "strategies.config" in doc, name
