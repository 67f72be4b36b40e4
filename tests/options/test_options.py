"""The options are written once (``lightning_shard/options``: name, type, default, choices, documentation, rules)
and everything else is derived from them: the strategy classes' signatures and docstrings (flat options, then the
groups, then Lightning's arguments), the Hydra schemas (a group is a nested node), the YAML files (only what differs
from the defaults), the pre-launch choices, the README's option table, the planner's rows (``StrategyConfig``
builds the options of its registered class) and its class defaults. A scan of the package finds no second literal
copy of a default and no other hard-coded list of option names."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_shard.app.checks import ConfigError, check_strategy
from lightning_shard.app.schema import SCHEMAS
from lightning_shard.options import (
    GROUPS,
    OPTIONS,
    POLICIES,
    PREFETCH_DEPTH,
    REGISTERED,
    AutoOptions,
    FSDPOptions,
    Tuning,
    Zero3Options,
    Zero3Tuning,
    ZeroOptions,
    options_for,
)
from lightning_shard.strategies import (
    AutoStrategy,
    FSDPShardFabricStrategy,
    FSDPShardStrategy,
    Zero0FabricStrategy,
    Zero0Strategy,
    Zero1FabricStrategy,
    Zero1Strategy,
    Zero2FabricStrategy,
    Zero2Strategy,
    Zero3FabricStrategy,
    Zero3Strategy,
    ZeroFabricStrategy,
    ZeroStrategy,
)

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "lightning_shard"
OPTIONS_DIR = PKG / "options"  # the package's one home of the options (options.py before it was split)
TRAINER = (ZeroStrategy, Zero0Strategy, Zero1Strategy, Zero2Strategy, Zero3Strategy, FSDPShardStrategy, AutoStrategy)
FABRIC = (ZeroFabricStrategy, Zero0FabricStrategy, Zero1FabricStrategy, Zero2FabricStrategy, Zero3FabricStrategy,
          FSDPShardFabricStrategy)
STRATEGIES = TRAINER + FABRIC
GROUP_NAMES = ("tuning", "compression", "safety", "launch")
# every name a user can set: the flat options and the groups' fields
OPTION_NAMES = {f.name for c in (*OPTIONS, *GROUPS) for f in dataclasses.fields(c)}


def _flat(options: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(options) if "group" not in f.metadata]


def _groups(options: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(options) if "group" in f.metadata]


def _hydra_fields(options: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(options) if f.metadata.get("hydra", True)]


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _squash(text: str) -> str:
    return " ".join(text.split())


def _options_of(target: str) -> Any:
    """The options class of a ``_target_`` (None for a target that is not ours, Lightning's DDPStrategy)."""
    module, _, attr = target.rpartition(".")
    return getattr(getattr(importlib.import_module(module), attr), "OPTIONS", None)


# ------------------------------------------------------------------------------------------ the options themselves
@pytest.mark.parametrize("cls", (*OPTIONS, *GROUPS), ids=lambda c: c.__name__)
def test_every_option_and_group_field_has_a_doc_and_a_valid_default(cls):
    for f in dataclasses.fields(cls):
        doc = f.metadata.get("doc")
        assert isinstance(doc, str) and len(doc.split()) >= 4, f"{cls.__name__}.{f.name}: no doc"
        assert f.kw_only, f"{cls.__name__}.{f.name}: not keyword-only"
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, \
            f"{cls.__name__}.{f.name}: no default"
        choices = f.metadata.get("choices")
        if choices is not None:
            assert f.default in choices, f"{cls.__name__}.{f.name}: default {f.default!r} not among {choices}"
        if "group" in f.metadata:  # a group field: its class's defaults, and a group of GROUPS
            assert f.metadata["group"] in GROUPS and type(_default(f)) is f.metadata["group"], f.name
    if cls in OPTIONS:  # the defaults pass the rules (stage resolved the way the strategies resolve it)
        for stage in cls.STAGES:
            options = cls(stage=stage)
            assert options.validate() is options
            assert options.changed() == {}, f"{cls.__name__}: the defaults differ from themselves"
    else:
        for stage in ((3,) if cls is Zero3Tuning else (0, 1, 2, 3)):
            cls().validate(stage)


def test_every_group_is_a_field_of_every_options_class_and_takes_a_mapping():
    for cls in OPTIONS:
        assert [f.name for f in _groups(cls)] == list(GROUP_NAMES), cls.__name__
        assert all(f.metadata.get("hydra", True) for f in _groups(cls))
    assert {f.metadata["group"] for c in OPTIONS for f in _groups(c)} == set(GROUPS)
    assert Zero3Options.__dataclass_fields__["tuning"].metadata["group"] is Zero3Tuning
    # a group as a mapping of its fields (what Hydra gives), or as its dataclass
    assert Zero2Strategy(tuning={"bucket_mb": 1}).options.tuning == Tuning(bucket_mb=1.0)
    assert Zero2Strategy(tuning=Tuning(bucket_mb=1)).options.tuning.bucket_mb == 1.0
    # a Tuning where stage 3 takes Zero3Tuning keeps what was set
    z3 = Zero3Strategy(tuning=Tuning(bucket_mb=2)).options.tuning
    assert type(z3) is Zero3Tuning and z3.bucket_mb == 2.0 and z3.reshard_after_forward is True
    with pytest.raises(TypeError, match=r"'bucket_mbb' \(did you mean 'bucket_mb'\?\)"):
        Zero2Strategy(tuning={"bucket_mbb": 1})


def test_accumulation_policies_per_stage_are_what_the_engine_runs():
    """``POLICIES[stage]``: the policies the engine runs at that stage (its own rule, ``ShardEngine._parse_policy``),
    named as the strategies name them (stage 3 calls deferring ``keep_unsharded_grads``, stages 0-2 ``defer``); a
    registered strategy's options offer exactly its stage's policies, and ``auto`` (strategy=auto: the stage-3 names,
    its planned row brings the policy of the stage it picks)."""
    from types import SimpleNamespace

    from lightning_shard.engine.engine import ShardEngine
    from lightning_shard.engine.spec import ShardSpec

    names = {n for c in OPTIONS for n in c.choices("accumulation")} - {"auto"}
    for stage in (0, 1, 2, 3):
        runs = set()
        for name in names - {"defer" if stage == 3 else "keep_unsharded_grads"}:
            try:
                ShardEngine._parse_policy(SimpleNamespace(spec=ShardSpec(stage, 2)), name)
            except ValueError:
                continue
            runs.add(name)
        assert set(POLICIES[stage]) == runs, stage
        for options, registered_stage in REGISTERED.values():
            if registered_stage == stage:
                assert set(options.choices("accumulation", stage)) == runs | {"auto"}, (options.__name__, stage)
    for options, _ in REGISTERED.values():
        assert set(options.choices("accumulation")) == {"auto"}.union(*(POLICIES[s] for s in options.STAGES))
    assert set(AutoOptions.choices("accumulation")) == {"auto", *POLICIES[3]}


# ------------------------------------------------------------------------------------------ the strategy classes
@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_signature_and_docstring_come_from_the_options(cls):
    options = cls.OPTIONS
    sig = inspect.signature(cls)
    flat, groups = [f.name for f in _flat(options)], [f.name for f in _groups(options)]
    assert list(sig.parameters) == flat + groups + list(cls.LIGHTNING_ARGS), \
        "the flat options, then the groups, then Lightning's own arguments"
    assert all(p.kind is p.KEYWORD_ONLY for p in sig.parameters.values())
    for f in dataclasses.fields(options):
        assert sig.parameters[f.name].default == _default(f), (cls.__name__, f.name)
    doc = _squash(cls.__doc__)
    for f in _flat(options):
        if f.name != "stage":  # its text names the class's own stage
            assert _squash(f.metadata["doc"]) in doc, (cls.__name__, f.name)
    for f in _groups(options):
        group = f.metadata["group"]
        assert f"{f.name}={group.__name__}(...)" in doc, (cls.__name__, f.name)
        for g in dataclasses.fields(group):
            assert _squash(g.metadata["doc"]) in doc, (cls.__name__, f"{f.name}.{g.name}")
    # every option is accepted at its default, and lands in ``options``
    strategy = cls(**{f.name: _default(f) for f in dataclasses.fields(options)})
    assert strategy.options.stage == cls.DEFAULT_STAGE and type(strategy.options) is options
    assert strategy.options.changed() == {}
    with pytest.raises(TypeError, match=r"'acumulation' \(did you mean 'accumulation'\?\)"):
        cls(acumulation="auto")
    with pytest.raises(TypeError, match=r"'bucket_mb'.*tuning"):  # a group's field given flat: names its group
        cls(bucket_mb=2)


def test_zero2_has_few_parameters_before_its_groups():
    """The options most users set first are flat; the expert ones wait in groups."""
    names = list(inspect.signature(Zero2Strategy).parameters)
    assert names.index("tuning") <= 8, names


def test_the_options_classes_match_the_strategy_classes_and_the_registry():
    import lightning_shard.strategies as strategies
    from lightning_shard.planner.advice import CLASS_OF

    assert {c.OPTIONS for c in STRATEGIES} == set(OPTIONS)
    assert (ZeroStrategy.OPTIONS, Zero3Strategy.OPTIONS, FSDPShardStrategy.OPTIONS,
            AutoStrategy.OPTIONS) == (ZeroOptions, Zero3Options, FSDPOptions, AutoOptions)
    assert issubclass(Zero3Options, ZeroOptions) and issubclass(FSDPOptions, Zero3Options)
    assert (Zero3Options.GRANULARITY, FSDPOptions.GRANULARITY) == ("zero3", "fsdp")
    for name, (options, stage) in REGISTERED.items():  # options.REGISTERED: the registered names' class and stage
        cls = strategies.REGISTERED[name][0]
        assert cls.OPTIONS is options and cls.DEFAULT_STAGE == stage and stage in options.STAGES, name
        assert CLASS_OF[name] == cls.__name__, name  # the planner's names of the classes
    assert set(CLASS_OF) == set(REGISTERED)


def test_module_docstrings_point_at_the_options_instead_of_listing_them():
    for name in ("zero", "zero3", "auto", "fabric"):
        doc = importlib.import_module(f"lightning_shard.strategies.{name}").__doc__
        listed = [m for m in re.findall(r"^``(\w+)``", doc, re.M) if m in OPTION_NAMES]
        assert not listed, (name, listed)
        assert "lightning_shard.options" in doc, name


# ------------------------------------------------------------------------------------------ Hydra and the app
def test_hydra_schemas_are_the_options():
    seen = set()
    for name, schema in SCHEMAS["schema/strategy"].items():
        options = _options_of(schema.__dataclass_fields__["_target_"].default)
        if options is None:  # Lightning's DDPStrategy
            assert name == "ddp"
            continue
        seen.add(options)
        fields = dataclasses.fields(schema)
        assert [f.name for f in fields] == ["_target_"] + [f.name for f in _hydra_fields(options)], name
        for f in fields[1:]:
            option = options.__dataclass_fields__[f.name]
            if "group" not in option.metadata:
                assert f.default == option.default, (name, f.name)
                continue
            group, nested = option.metadata["group"], _default(f)  # a nested node: the group's fields
            assert dataclasses.is_dataclass(nested), (name, f.name)
            assert [g.name for g in dataclasses.fields(nested)] == list(group.names()), (name, f.name)
            for g in dataclasses.fields(nested):
                assert g.default == group.__dataclass_fields__[g.name].default, (name, f"{f.name}.{g.name}")
    assert seen == set(OPTIONS)


YAML = sorted((ROOT / "conf" / "strategy").glob("*.yaml")) + sorted((ROOT / "conf" / "specialize").glob("*.yaml"))


@pytest.mark.parametrize("path", YAML, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_strategy_yaml_holds_only_what_differs_from_the_defaults(path):
    node = yaml.safe_load(path.read_text()) or {}
    if path.parent.name == "specialize":  # @package strategy, for the strategy its name starts with
        target = yaml.safe_load((ROOT / "conf" / "strategy" / f"{path.stem.rsplit('_', 2)[0]}.yaml").read_text())
        node = {**node, "_target_": target["_target_"]}
    options = _options_of(node["_target_"])
    if options is None:
        return  # ddp: Lightning's own keywords
    defaults = {f.name: _default(f) for f in _hydra_fields(options)}
    for key, value in node.items():
        if key in ("defaults", "_target_"):
            continue
        assert key in defaults, f"{path.name}: {key} is not an option of {options.__name__}"
        default = defaults[key]
        if dataclasses.is_dataclass(default):  # a group: a mapping of its fields, each differing from its default
            assert isinstance(value, dict) and value, f"{path.name}: {key} must be a mapping of its fields"
            for name, v in value.items():
                assert name in default.names(), f"{path.name}: {key}.{name} is not a field of {type(default).__name__}"
                assert v != getattr(default, name), f"{path.name}: {key}.{name}={v!r} is the default; drop the line"
        else:
            assert value != default, f"{path.name}: {key}={value!r} is the default; drop the line"


def _choice_fields(options: type) -> list[tuple[str, Any, tuple]]:
    """(dotted name, default, choices) of every option with choices, a group's fields included."""
    out = []
    for f in dataclasses.fields(options):
        if "group" in f.metadata:
            group = f.metadata["group"]
            out += [(f"{f.name}.{g.name}", g.default, group.choices(g.name)) for g in dataclasses.fields(group)
                    if group.choices(g.name)]
        elif f.metadata.get("choices"):
            out.append((f.name, f.default, options.choices(f.name, 3 if 3 in options.STAGES else None)))
    return out


def _node(target: str, dotted: str, value: Any) -> dict[str, Any]:
    name, _, field_name = dotted.partition(".")
    return {"_target_": target, name: {field_name: value} if field_name else value}


@pytest.mark.parametrize("options,target", [
    (ZeroOptions, "lightning_shard.strategies.Zero2Strategy"),
    (Zero3Options, "lightning_shard.strategies.Zero3Strategy"),
    (FSDPOptions, "lightning_shard.strategies.FSDPShardStrategy"),
    (AutoOptions, "lightning_shard.strategies.AutoStrategy"),
], ids=lambda x: getattr(x, "__name__", "target"))
def test_prelaunch_choices_are_the_options(options, target):
    fields = _choice_fields(options)
    assert {d for d, _, _ in fields} >= {"accumulation", "state_dict_type", "compression.gather_quant",
                                         "compression.reduce_quant", "launch.start_method"}
    for dotted, default, choices in fields:
        with pytest.raises(ConfigError, match=re.escape(f"strategy.{dotted}='bogus'") + ".*" +
                           re.escape(", ".join(map(str, choices)))):
            check_strategy(_node(target, dotted, "bogus"), 1, 1, 2)
        check_strategy(_node(target, dotted, default), 1, 1, 2)


# ------------------------------------------------------------------------------------------ the README
def _readme_rows() -> list[tuple[str, Any]]:
    """(name, default as written) of each row of the README's table of first options (header ``| option | default |
    meaning |``): a flat option (```accumulation```) or a group's field (```tuning.bucket_mb```)."""
    text = (ROOT / "README.md").read_text()
    tables = [block.strip().splitlines() for block in text.split("\n\n")
              if block.strip().startswith("| option | default | meaning |")]
    assert len(tables) == 1, "one table of first options in the README"
    out = []
    for row in tables[0][2:]:
        names_cell, default_cell = [c.strip() for c in row.strip("|").split("|")[:2]]
        (name,) = re.findall(r"`([\w.]+)`", names_cell)
        token = re.match(r"`?([^`\s]+)`?", default_cell).group(1)
        value = {"None": None, "True": True, "False": False}.get(token, token)
        if isinstance(value, str) and re.fullmatch(r"[\d.]+", value):
            value = float(value)
        out.append((name, value))
    return out


def test_readme_first_options_exist_with_their_true_defaults():
    """The README shows a few options (the generated reference, docs/knobs.md, shows them all): each must be an option
    or a group's field, once, with the default the options list gives it."""
    flat = {f.name: f.default for c in reversed(OPTIONS) for f in _flat(c)}  # ZeroOptions' default wins
    fields = {}
    for group_name in GROUP_NAMES:
        classes = [f.metadata["group"] for c in OPTIONS for f in _groups(c) if f.name == group_name]
        fields.update({f"{group_name}.{g.name}": g.default for c in reversed(classes) for g in dataclasses.fields(c)})
    listed = _readme_rows()
    names = [n for n, _ in listed]
    assert len(names) == len(set(names)) >= 5, names
    for name, value in listed:
        known = {**flat, **fields}
        assert name in known, f"README lists {name!r}, which is no option"
        assert value == known[name], f"README says {name}={value!r}, the default is {known[name]!r}"


# ------------------------------------------------------------------------------------------ the planner
def _planned_rows() -> list[Any]:
    """Every row the planner plans on a few machines (CPU/gloo, one and two GPU nodes, pairs of islands; the
    compressed variants where they pay), plus rows that set each of ``StrategyConfig``'s fields."""
    from lightning_shard.planner import plan
    from lightning_shard.planner.config import StrategyConfig
    from lightning_shard.planner.models import from_recipe

    rows = []
    for model, topology, gpus, batch, precision in [("gpt_tiny", "cpu_2x2", 4, 16, "32-true"),
                                                    ("gpt_1b", "h100_nvl_8", None, 64, "bf16-true"),
                                                    ("gpt_7b", "hgx_h100_8", 16, 64, "bf16-true")]:
        res = plan(from_recipe(model), topology, gpus, batch, 1, precision, require_fit=False)
        rows += [r.config for r in res.rows]
    rows += [StrategyConfig("zero2", 2, "per_micro_batch", bucket_mb=50.0, offload_optimizer=True, reduce_quant="int4",
                            quant_block=64, quant_error_feedback=False),
             StrategyConfig("zero1", 1, reduce_scatter_via="all_reduce", shard_size=2),
             StrategyConfig("zero3", 3, "keep_params", prefetch_depth=1, min_unit_mb=0.0, reshard_after_forward=False,
                            offload_optimizer=True, offload_params=True, gather_quant="int8", secondary_shard=4),
             StrategyConfig("fsdp_shard", 3, "keep_unsharded_grads", wrap_classes=["Block"], min_params=100,
                            prefetch_depth=3, shard_size=4)]
    return rows


# StrategyConfig's fields -> the option each one is (the planner's own reduce_scatter_via is none: a property of the
# backend planned for)
ROW_OPTIONS = {"policy": "accumulation", "shard_size": "shard_size", "offload_optimizer": "offload_optimizer",
               "gather_quant": "compression.gather_quant", "reduce_quant": "compression.reduce_quant",
               "quant_block": "compression.block", "quant_error_feedback": "compression.error_feedback"}
ROW_OPTIONS_BELOW_3 = {"bucket_mb": "tuning.bucket_mb"}
ROW_OPTIONS_3 = {"reshard_after_forward": "tuning.reshard_after_forward", "offload_params": "offload_params",
                 "secondary_shard": "secondary_shard"}


def _option(options: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        options = getattr(options, part)
    return options


def _row_is_its_options(cfg: Any, options: Any) -> None:
    """Every field of the planner's row is the value of the option it stands for."""
    fields = {**ROW_OPTIONS, **(ROW_OPTIONS_3 if cfg.stage == 3 else ROW_OPTIONS_BELOW_3)}
    for name, dotted in fields.items():
        assert _option(options, dotted) == getattr(cfg, name), (cfg.label, name, dotted)
    if cfg.stage == 3:
        assert options.tuning.prefetch(options.granularity) == cfg.prefetch_depth, cfg.label
    if cfg.strategy == "zero3":
        assert options.tuning.min_unit_mb == cfg.min_unit_mb, cfg.label
    if cfg.strategy == "fsdp_shard":
        assert options.wrap_classes == (cfg.wrap_classes or "auto") and options.min_params == cfg.min_params


def test_every_planned_row_builds_the_valid_options_of_its_registered_class():
    import lightning_shard.strategies as strategies

    rows = _planned_rows()
    assert {r.strategy for r in rows} == set(REGISTERED)
    assert any(r.gather_quant != "none" for r in rows) and any(r.shard_size for r in rows)
    for cfg in rows:
        _row_is_its_options(cfg, cfg.options())
        kwargs = cfg.kwargs()
        options = options_for(cfg.strategy, **kwargs)  # validates
        assert type(options) is REGISTERED[cfg.strategy][0] and options.stage == cfg.stage, cfg.label
        assert options == cfg.options(), cfg.label
        assert options.changed() == kwargs, cfg.label  # kwargs(): what differs from the class defaults, exactly
        assert all(isinstance(v, dict) for k, v in kwargs.items() if k in GROUP_NAMES), cfg.label
        assert strategies.REGISTERED[cfg.strategy][0](**kwargs).options == options, cfg.label


def test_class_default_is_the_options_default():
    from lightning_shard.planner.advice import _MISSING, class_default, flatten

    for name, (options, stage) in REGISTERED.items():
        defaults = flatten(dataclasses.asdict(options(stage=stage)))
        assert "tuning.bucket_mb" in defaults
        for key, value in defaults.items():
            if key != "stage":
                assert class_default(name, key) == value, (name, key)
        assert class_default(name, "tuning.nope") is _MISSING and class_default(name, "bucket_mb") is _MISSING
    assert class_default("zero2", "tuning.prefetch_depth") is _MISSING  # a stage-3 field


def test_prefetch_depth_defaults_agree_from_option_to_engine_and_planner():
    """zero3 gathers 3 units ahead, fsdp_shard 1 (options.PREFETCH_DEPTH, for ``tuning.prefetch_depth=None``): the
    strategies' options, what the engine asks the options for, and the planner's rows say the same."""
    from lightning_shard.planner.config import StrategyConfig

    assert PREFETCH_DEPTH == {"zero3": 3, "fsdp": 1}
    z3, fsdp = Zero3Strategy().options, FSDPShardStrategy().options
    assert z3.tuning.prefetch_depth is None and fsdp.tuning.prefetch_depth is None
    assert z3.tuning.prefetch(z3.granularity) == 3 and fsdp.tuning.prefetch(fsdp.granularity) == 1
    set_to_0 = Zero3Strategy(tuning={"prefetch_depth": 0}).options
    assert set_to_0.tuning.prefetch(set_to_0.granularity) == 0
    assert StrategyConfig("zero3", 3).prefetch_depth == 3 and StrategyConfig("fsdp_shard", 3).prefetch_depth == 1
    assert "tuning" not in StrategyConfig("zero3", 3).kwargs()  # the class's own depth: nothing to say
    assert StrategyConfig("zero3", 3, prefetch_depth=1).kwargs()["tuning"] == {"prefetch_depth": 1}
    assert StrategyConfig("fsdp_shard", 3, prefetch_depth=3).options().tuning.prefetch("fsdp") == 3


# ------------------------------------------------------------------------------------------ written once
# (file relative to lightning_shard/, name) -> why a literal there may equal an option's default
ALLOWED_DEFAULTS = {
    ("app/schema.py", "start_method"): "Lightning's DDPStrategy keyword and Lightning's own default, not ours",
}
TRIVIAL = ("", "none", "auto")  # "off" and "decide at setup" sentinels, like None, False and 0


def option_defaults() -> dict[str, set]:
    """The non-trivial literal defaults of the options, by name (``prefetch_depth``: what None resolves to)."""
    out: dict[str, set] = {}
    for cls in (*OPTIONS, *GROUPS):
        for f in dataclasses.fields(cls):
            v = f.default
            if v is dataclasses.MISSING or v is None or isinstance(v, bool) or not isinstance(v, (int, float, str)):
                continue
            if (isinstance(v, str) and v in TRIVIAL) or (not isinstance(v, str) and v == 0):
                continue
            out.setdefault(f.name, set()).add(v)
    out.setdefault("prefetch_depth", set()).update(PREFETCH_DEPTH.values())
    return out


def _literal(node: ast.AST) -> tuple[bool, Any]:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)) and \
            not isinstance(node.value, bool):
        return True, node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and isinstance(node.operand.value, (int, float)):
        return True, -node.operand.value
    return False, None


def second_defaults(source: str, defaults: dict[str, set]) -> list[tuple[int, str]]:
    """(line, name) of each literal in ``source`` equal to the default of the option of the same name: a
    module-level constant (``PREFETCH_DEPTH = 3``, ``DEFAULT_BLOCK = 256``: the name, or its last words, is the
    option's), a class field (``bucket_mb: float = 25.0``, ``field(default=25.0)``), a function's parameter default
    (``def f(bucket_mb=25.0)``) or a call's keyword (``f(bucket_mb=25.0)``)."""

    def same(name: str, value: ast.AST, constant: bool = False) -> bool:
        name = name.lower()
        if constant:  # BUCKET_MB, DEFAULT_BUCKET_MB
            name = next((k for k in defaults if name == k or name.endswith("_" + k)), name)
        ok, v = _literal(value)
        return ok and name in defaults and any(
            isinstance(v, str) == isinstance(d, str) and v == d for d in defaults[name])

    hits = []
    tree = ast.parse(source)
    for node in tree.body:  # module-level constants
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            hits += [(node.lineno, t.id) for t in targets if isinstance(t, ast.Name) and same(t.id, node.value, True)]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):  # class fields, dataclass ``field(default=...)`` included
            for s in node.body:
                if isinstance(s, (ast.Assign, ast.AnnAssign)) and s.value is not None:
                    value = s.value
                    if isinstance(value, ast.Call):
                        value = next((k.value for k in value.keywords if k.arg == "default"), value)
                    targets = s.targets if isinstance(s, ast.Assign) else [s.target]
                    hits += [(s.lineno, t.id) for t in targets if isinstance(t, ast.Name) and same(t.id, value)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            hits += [(node.lineno, arg.arg) for arg, d in pairs if same(arg.arg, d)]
        elif isinstance(node, ast.Call):
            hits += [(k.value.lineno, k.arg) for k in node.keywords if k.arg and same(k.arg, k.value)]
    return hits


def test_the_scan_finds_a_second_default():
    defaults = option_defaults()
    assert defaults["bucket_mb"] == {25.0} and defaults["prefetch_depth"] >= {3} and "accumulation" not in defaults
    found = second_defaults(
        "BUCKET_MB = 25.0\n"
        "DEFAULT_BLOCK: int = 256\n"
        "class C:\n    timeout_s: float = 1800.0\n    startup_timeout_s: float = field(default=1800.0)\n"
        "def f(x, optim_chunk_mb=4.0, *, state_dict_type='sharded'):\n    return g(prefetch_depth=3)\n",
        defaults)
    assert [name for _, name in found] == ["BUCKET_MB", "DEFAULT_BLOCK", "timeout_s", "startup_timeout_s",
                                           "optim_chunk_mb", "state_dict_type", "prefetch_depth"], found
    assert second_defaults("bucket_mb = Tuning.bucket_mb\ndef f(bucket_mb=26.0, block=None):\n"
                           "    return g(timeout_s=TIMEOUT, accumulation='auto', start_method=m)\n", defaults) == []


def test_every_default_is_written_once():
    """A default lives in the options only: elsewhere the package reads it from there (``Tuning.bucket_mb``,
    ``options.MIN_UNIT_MB``), so that changing it in one place changes it everywhere."""
    defaults, bad = option_defaults(), []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if path == PKG / "options.py" or OPTIONS_DIR in path.parents:
            continue
        for line, name in second_defaults(path.read_text(), defaults):
            if (rel, name) not in ALLOWED_DEFAULTS:
                bad.append(f"{rel}:{line} {name}")
    assert not bad, f"an option's default written a second time (read it from lightning_shard.options): {bad}"


# (file relative to lightning_shard/, owner) -> why it names several options without being derived from them
ALLOWED_LISTS = {
    ("planner/config.py", "StrategyConfig"): "the planner's row: the options it varies (it builds them: options())",
    ("planner/config.py", "values"): "StrategyConfig.options(): the row's fields as the options they are",
    ("planner/config.py", "Job"): "the planner's model of a job (accumulation steps, DDP-like flags)",
    ("app/schema.py", "DDPStrategyConf"): "Lightning's DDPStrategy keywords, not ours",
    ("strategies/__init__.py", "REGISTERED"): "registry presets: the few values a registered name sets",
    ("engine/buckets/context.py", "BucketContext"): "what the engine gives every bucket, from the options it was "
                                                    "built with (the engine's own parameters)",
}


def option_lists(source: str, min_names: int = 3) -> list[str]:
    """Literal tuples/lists/sets, dict literals and class bodies in ``source`` that name ``min_names`` options or
    more: each named by the variable or class it belongs to."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        owner = None
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            owner = ", ".join(ast.unparse(t) for t in targets)
        elif isinstance(node, ast.ClassDef):
            fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            if len(fields & OPTION_NAMES) >= min_names:
                found.append(node.name)
            continue
        for sub in ast.walk(node) if owner else ():
            if isinstance(sub, (ast.Tuple, ast.List, ast.Set)):
                strings = [e.value for e in sub.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            elif isinstance(sub, ast.Dict):
                strings = [k.value for k in sub.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            else:
                continue
            if len(set(strings) & OPTION_NAMES) >= min_names:
                found.append(owner)
                break
    # loops outside assignments: `for key in ("bucket_mb", ...)`
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.iter, (ast.Tuple, ast.List, ast.Set)):
            strings = [e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(set(strings) & OPTION_NAMES) >= min_names:
                found.append(f"for ... in {ast.unparse(node.iter)[:40]}")
    return found


def test_the_scan_finds_a_list_of_options():
    assert option_lists('NAMES = ("bucket_mb", "overlap", "prefetch_depth")\n') == ["NAMES"]
    assert option_lists("class C:\n    bucket_mb: float = 1\n    overlap: bool = True\n    stage: int = 0\n") == ["C"]
    assert option_lists('def f(s):\n    for k in ["bucket_mb", "overlap", "timeout_s"]:\n        pass\n')
    assert option_lists('D = {"bucket_mb": 1, "block": 2, "timeout_s": 3}\n') == ["D"]
    assert option_lists('X = ("bucket_mb", "overlap")\n') == []


def test_no_other_hard_coded_list_of_options_in_the_package():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if path == PKG / "options.py" or OPTIONS_DIR in path.parents:
            continue
        for owner in option_lists(path.read_text()):
            if (rel, owner) not in ALLOWED_LISTS:
                bad.append(f"{rel}: {owner}")
    assert not bad, f"option names listed outside lightning_shard/options: {bad}"


def test_auto_becomes_the_planned_row_keeping_the_users_options():
    """``convert`` (what strategy=auto becomes at setup): the user's options carry over, inside a group field by
    field, the planned row's changes win, and what the target class has not (stage 3's fields) is dropped."""
    from lightning_shard.options import AutoOptions, Zero3Options, ZeroOptions, convert, merge

    user = AutoOptions(stage=3, param_dtype="bf16", tuning={"find_unused_parameters": False, "prefetch_depth": 2},
                       safety={"timeout_s": 60.0}).validate()
    zero2 = convert(user, ZeroOptions, 2, {"accumulation": "defer", "tuning": {"bucket_mb": 50.0}})
    assert zero2.stage == 2 and zero2.accumulation == "defer" and zero2.param_dtype == "bf16"
    assert zero2.tuning.bucket_mb == 50.0 and zero2.tuning.find_unused_parameters is False
    assert zero2.safety.timeout_s == 60.0 and not hasattr(zero2.tuning, "prefetch_depth")
    zero3 = convert(user, Zero3Options, 3, {"tuning": {"reshard_after_forward": False}})
    assert zero3.tuning.prefetch_depth == 2 and zero3.tuning.reshard_after_forward is False
    assert merge({"tuning": {"a": 1}}, {"tuning": {"b": 2}}, tuning={"a": 3}) == {"tuning": {"a": 3, "b": 2}}
