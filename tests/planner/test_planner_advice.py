"""What `lightning-shard plan` advises can be run as printed (one process, no ranks, no process group).

* every row of every plan, on every topology preset (and a capture file), builds its strategy: the registered
  Lightning class with the row's kwargs, and the printed Python constructor; the strategy ends up with the
  row's stage, accumulation policy and options (groups included: ``tuning``, ``compression``);
* every row's Hydra overrides compose (conf/train.yaml + conf/strategy/*.yaml + app/schema.py), pass the
  pre-launch checks the app runs, give the planned world size and accumulation, and instantiate the same strategy;
* the printed output names the pick, explains its markers and prints the command and constructor;
* ``--plot`` with two presets draws each preset's memory limit as a labelled line and has the hybrid rows;
* ``strategy=auto`` chooses what the CLI recommends for the same model, machine and batch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shlex
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import OmegaConf

import lightning_shard.strategies as strategies
from lightning_shard.cli import main
from lightning_shard.planner import plan
from lightning_shard.planner.advice import RECIPE_PLACEHOLDER, flatten, python_constructor, reproduce, strategy_kwargs
from lightning_shard.planner.cli_plan import plot
from lightning_shard.planner.config import STAGE_OF
from lightning_shard.planner.hardware import device_spec
from lightning_shard.planner.models import from_recipe
from lightning_shard.strategies import AutoStrategy
from lightning_shard.topology import list_presets, load_preset
from lightning_shard.train import CONF_DIR, check_config

CAPTURE = Path(__file__).parents[1] / "assets" / "topology" / "f08_h100_nvl_pairs.txt"


def _settings() -> list[tuple]:
    """(model, topology, --gpus, global batch, micro-batch, precision) for every preset, hybrid layouts included."""
    out = []
    for name in list_presets():
        topo = load_preset(name)
        if topo.devices[0].kind == "cpu":
            n = len(topo.devices)
            out += [("gpt_tiny", name, n, 4 * n, 2, "32-true"), ("gpt_tiny", name, 2 * n, 8 * n, 1, "32-true")]
            continue
        out += [("gpt_1b", name, None, 64, 1, "bf16-true"), ("gpt_7b", name, None, 64, 1, "bf16-true")]
        if topo.num_nodes == 1:  # two copies of the node: hybrid across nodes (the issue's --gpus 16 on hgx_h100_8)
            out.append(("gpt_7b", name, 2 * len(topo.devices), 64, 1, "bf16-true"))
    out += [("gpt_1b", "dgx1_v100", 4, 64, 1, "bf16-true"),  # a subset of one node: trainer.devices,
                                                             # CUDA_VISIBLE_DEVICES
            ("gpt_1b", str(CAPTURE), None, 64, 1, "bf16-true")]  # a capture file: no preset
    return out


SETTINGS = _settings()
IDS = ["-".join(str(x) for x in (m, Path(t).stem, g or "all", gb, mb)) for m, t, g, gb, mb, _ in SETTINGS]


@functools.lru_cache(maxsize=None)
def _model(name: str):
    return from_recipe(name)


@functools.lru_cache(maxsize=None)
def planned(model: str, topology: str, gpus, global_batch: int, micro: int, precision: str):
    device = device_spec("H100 NVL") if Path(topology).is_file() else None  # captures carry no device model
    return plan(_model(model), topology, gpus, global_batch, micro, precision, device=device, require_fit=False)


def _registered(name: str):
    entry = StrategyRegistry[name]
    return entry["strategy"], dict(entry["init_params"])


def _option(options, dotted: str):
    """An option by its dotted name (``tuning.bucket_mb``)."""
    for part in dotted.split("."):
        options = getattr(options, part)
    return options


def _assert_is_row(strategy, row, res) -> None:
    """The built strategy is the row: class, stage, policy and every option of its kwargs (a group's fields
    included); its options are the row's own (``StrategyConfig.options()``), the topology aside."""
    cfg, kw = row.config, row.config.kwargs()
    assert type(strategy).__name__ == python_constructor(res, row)[1].split("(")[0]
    assert isinstance(strategy, _registered(cfg.registered)[0])
    opts = strategy.options
    assert opts.stage == STAGE_OF[cfg.strategy] == cfg.stage
    assert opts.accumulation == cfg.policy and cfg.policy in type(strategy).OPTIONS.choices("accumulation")
    for k, v in flatten(kw).items():
        assert _option(opts, k) == v, (row.label, k)
    assert dataclasses.replace(opts, topology=None) == dataclasses.replace(cfg.options(), topology=None), row.label
    if cfg.shard_size:
        assert opts.shard_size == cfg.shard_size
        assert opts.topology == res.topology_spec


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_every_row_builds_its_strategy(setting):
    res = planned(*setting)
    assert len(res.rows) >= 5
    for row in res.rows:
        cls, init = _registered(row.config.registered)
        _assert_is_row(cls(**{**init, **strategy_kwargs(res, row)}), row, res)
        imp, ctor = python_constructor(res, row)  # the printed constructor, run as printed
        scope: dict = {}
        exec(imp, scope)
        _assert_is_row(eval(ctor, scope), row, res)
    if res.context.placement.topology.num_nodes > 1:
        assert any(r.config.shard_size for r in res.rows), "a job over several nodes plans hybrid rows"


def test_stage3_rows_use_the_strategies_policy_names():
    res = planned("gpt_7b", "hgx_h100_8", None, 64, 1, "bf16-true")
    policies = {r.config.policy for r in res.rows if r.config.stage == 3}
    assert policies == {"per_micro_batch", "keep_unsharded_grads", "keep_params"}
    out = json.loads(_cli(["plan", "gpt_7b", "--preset", "hgx_h100_8", "--global-batch", "64", "--micro-batch", "1",
                           "--json"]))
    for row in out[0]["rows"]:
        cls, _ = _registered(row["strategy"])
        assert row["kwargs"]["accumulation"] in cls.OPTIONS.choices("accumulation"), row["label"]
    with pytest.raises(ValueError, match="stage 3 calls deferring 'keep_unsharded_grads'"):
        type(res.best.config)("zero3", 3, "defer")


# ------------------------------------------------------------------------------------------------ Hydra
def _compose(overrides: list[str]):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="train", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def _runnable(overrides: list[str]) -> list[str]:
    """The printed overrides with the placeholder recipe replaced by a shipped one."""
    return [("recipe=gpt_tiny" if o == f"recipe={RECIPE_PLACEHOLDER}" else o) for o in overrides]


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple):
    cfg = _compose(list(overrides))
    return cfg, check_config(cfg)  # the app's pre-launch checks: schema, choices, batch arithmetic


def _check_hydra(res, row, recipe: str) -> None:
    how = reproduce(res, row, recipe=recipe)
    cfg, accumulate = _composed(tuple(_runnable(how.overrides)))
    assert accumulate == res.context.job.accumulation, row.label
    assert cfg.trainer.devices * cfg.trainer.num_nodes == res.context.job.world, row.label
    assert cfg.trainer.precision == res.context.job.precision
    node = flatten(OmegaConf.to_container(cfg.strategy, resolve=True))  # a group's fields as dotted keys
    for k, v in flatten(strategy_kwargs(res, row)).items():
        assert node[k] == v, (row.label, k, node[k], v)
    _assert_is_row(instantiate(cfg.strategy, _convert_="all"), row, res)


# a Hydra composition costs ~0.15 s: every row on one setting per topology (the one with the most rows: hybrid
# across nodes where the preset is one node), the recommended and the runner-up rows on every setting
HYDRA_SETTINGS = list({s[1]: s for s in SETTINGS[:-2]}.values()) + SETTINGS[-2:]


@pytest.mark.slow
@pytest.mark.parametrize("setting", HYDRA_SETTINGS, ids=[IDS[SETTINGS.index(s)] for s in HYDRA_SETTINGS])
def test_every_row_hydra_overrides_compose_and_build(setting):
    res = planned(*setting)
    for row in res.rows:
        _check_hydra(res, row, setting[0])


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_recommended_hydra_overrides_compose_and_build(setting):
    res = planned(*setting)
    for row in (res.best, res.runner_up):
        _check_hydra(res, row, setting[0])


def test_a_rows_group_options_print_as_dotted_hydra_keys_and_as_dicts():
    """A row's options of a group: ``strategy.tuning.prefetch_depth=1`` for Hydra, ``tuning={"prefetch_depth": 1}``
    in the constructor; both build the row (composed, checked and instantiated; run as printed)."""
    from lightning_shard.planner.advice import strategy_overrides
    from lightning_shard.planner.config import StrategyConfig

    rows = [StrategyConfig("zero3", 3, "per_micro_batch", prefetch_depth=1, quant_block=64, gather_quant="int8"),
            StrategyConfig("fsdp_shard", 3, "keep_unsharded_grads", reshard_after_forward=False)]
    res = plan(_model("gpt_1b"), "hgx_h100_8", None, 64, 1, "bf16-true", configs=rows, require_fit=False)
    printed = {r.config.strategy: (strategy_overrides(res, r), python_constructor(res, r)[1]) for r in res.rows}
    hydra, ctor = printed["zero3"]
    assert {"strategy.tuning.prefetch_depth=1", "strategy.compression.gather_quant=int8",
            "strategy.compression.block=64"} <= set(hydra), hydra
    assert 'tuning={"prefetch_depth": 1}' in ctor and '"block": 64' in ctor, ctor
    hydra, ctor = printed["fsdp_shard"]
    assert "strategy.tuning.reshard_after_forward=false" in hydra and \
        'tuning={"reshard_after_forward": False}' in ctor, (hydra, ctor)
    assert not any(o.split("=")[0].count(".") == 1 and o.split("=")[0].split(".")[1] in
                   ("prefetch_depth", "reshard_after_forward", "block", "gather_quant") for o in hydra)
    for row in res.rows:
        _check_hydra(res, row, "gpt_1b")
        imp, ctor = python_constructor(res, row)
        scope: dict = {}
        exec(imp, scope)
        _assert_is_row(eval(ctor, scope), row, res)


def test_subset_of_a_node_gets_its_devices():
    res = planned("gpt_1b", "dgx1_v100", 4, 64, 1, "bf16-true")  # hybrid cube-mesh: the best 4 ring as 0,3,2,1
    how = reproduce(res)
    local = [res.context.placement.topology.devices[d].local_index for d in res.context.placement.devices]
    assert "trainer.devices=4" in how.overrides and local != list(range(4))
    assert how.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, local))
    assert how.command.startswith(f"CUDA_VISIBLE_DEVICES={how.env['CUDA_VISIBLE_DEVICES']} python -m")
    assert any("CUDA_VISIBLE_DEVICES" in n for n in how.notes)


# ------------------------------------------------------------------------------------------------ output
def _cli(argv: list[str]) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return buf.getvalue()


@pytest.mark.parametrize("argv", [["gpt_7b", "--preset", "hgx_h100_8"],
                                  ["gpt_7b", "--preset", "hgx_h100_8", "--gpus", "16"]], ids=["8", "16-hybrid"])
def test_printed_recommendation_runs_as_printed(argv):
    out = _cli(["plan", *argv, "--global-batch", "64", "--micro-batch", "1"])
    res = plan(_model("gpt_7b"), "hgx_h100_8", int(argv[-1]) if "--gpus" in argv else None, 64, 1, "bf16-true")
    lines = out.splitlines()
    starred = [ln for ln in lines if ln.startswith("│") and " * " in ln.split("│")[1] + " "]
    assert len(starred) == 1 and res.best.label in starred[0]
    second = [ln for ln in lines if ln.startswith("│") and " 2nd" in ln.split("│")[1]]
    assert len(second) == 1 and res.runner_up.label in second[0]
    legend = next(ln for ln in lines if "* = recommended" in ln)
    assert "2nd = runner-up" in legend + out
    assert f"recommended: {res.best.label}" in out
    hydra = next(ln for ln in lines if ln.strip().startswith("hydra:")).split("hydra:", 1)[1].strip()
    words = shlex.split(hydra)
    assert words[:3] == ["python", "-m", "lightning_shard.train"]
    overrides = words[3:]
    assert f"strategy={res.best.config.registered}" in overrides
    assert f"strategy.accumulation={res.best.config.policy}" in overrides
    cfg, accumulate = _composed(tuple(_runnable(overrides)))
    assert accumulate == res.context.job.accumulation
    _assert_is_row(instantiate(cfg.strategy, _convert_="all"), res.best, res)
    py = [ln.strip() for ln in lines[lines.index(next(ln for ln in lines if "python:" in ln)):][:2]]
    imports, trainer = py[0].split("python:", 1)[1].strip(), py[1]
    scope: dict = {}
    exec(imports.replace("; ", "\n"), scope)
    assert trainer.startswith("Trainer(strategy=")
    ctor = python_constructor(res, res.best)[1]
    assert trainer[len("Trainer(strategy="):].startswith(ctor)
    _assert_is_row(eval(ctor, scope), res.best, res)
    assert f"accumulate_grad_batches={res.context.job.accumulation}" in trainer


def test_json_carries_the_reproduction():
    out = json.loads(_cli(["plan", "gpt_7b", "--preset", "hgx_h100_8", "--gpus", "16", "--global-batch", "64",
                           "--micro-batch", "1", "--json"]))[0]
    best = next(r for r in out["rows"] if r["label"] == out["recommended"])
    assert out["reproduce"]["hydra_overrides"][: len(best["hydra_strategy_overrides"])] == \
        best["hydra_strategy_overrides"]
    assert best["python"]["strategy"] in out["reproduce"]["python"]
    assert best["strategy"].endswith("_hybrid") and best["kwargs"]["shard_size"] == 8


# ------------------------------------------------------------------------------------------------ plot
def test_plot_two_presets_limits_and_hybrid_rows(tmp_path):
    results = [plan(_model("gpt_1b"), t, None, 64, 1, "bf16-true") for t in ("hgx_h100_8", "h100_nvl_8")]
    png = tmp_path / "plan.png"
    fig = plot(results, str(png))
    assert png.stat().st_size > 1000
    time_ax, mem_ax = fig.axes[:2]
    lines = {ln.get_label(): ln for ln in mem_ax.get_lines()}
    assert len(lines) == 2
    for res in results:
        name = res.context.placement.topology.name
        label = next(lb for lb in lines if lb.startswith(f"{name} limit"))
        usable = 0.9 * res.context.device.memory_bytes / 2**30
        assert lines[label].get_xdata()[0] == pytest.approx(usable)
        assert f"{usable:.1f} GiB" in label
    legend = [t.get_text() for t in mem_ax.get_legend().get_texts()]
    assert set(lines) <= set(legend)
    assert len({ln.get_xdata()[0] for ln in lines.values()}) == 2  # 80 GB vs 94 GB devices
    ticks = [t.get_text() for t in time_ax.get_yticklabels()]
    every = {r.label for res in results for r in res.rows}
    assert set(ticks) == every and any("_hybrid" in t for t in ticks)
    assert not any(r.config.shard_size for r in results[0].rows)  # hybrid rows come from the second preset only


# ------------------------------------------------------------------------------------------------ auto
class _Wrapped(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model


AGREE = [("gpt_7b", "hgx_h100_8", None, 64, 1, "bf16-true"), ("gpt_7b", "hgx_h100_8", 16, 64, 1, "bf16-true"),
         ("gpt_1b", "h100_nvl_8", None, 64, 1, "bf16-true"), ("gpt_1b", "pcie_8", None, 64, 1, "bf16-true"),
         ("gpt_1b", "dgx1_v100", None, 64, 1, "bf16-true"), ("gpt_tiny", "cpu_2x2", None, 8, 1, "32-true")]


@pytest.mark.parametrize("model,topology,gpus,global_batch,micro,precision", AGREE,
                         ids=[f"{a[0]}-{a[1]}-{a[2] or 'all'}" for a in AGREE])
def test_auto_strategy_agrees_with_the_cli(model, topology, gpus, global_batch, micro, precision):
    argv = ["plan", model, "--preset", topology, "--global-batch", str(global_batch), "--micro-batch", str(micro),
            "--precision", precision, "--json"] + (["--gpus", str(gpus)] if gpus else [])
    out = json.loads(_cli(argv))[0]
    cli = next(r for r in out["rows"] if r["label"] == out["recommended"])

    per_node = len(load_preset(topology).devices) if topology != "cpu" else gpus
    world = gpus or per_node
    auto = AutoStrategy(topology=topology, global_batch_size=global_batch, micro_batch_size=micro,
                        parallel_devices=[torch.device("cpu")] * min(world, per_node))
    auto.num_nodes = world // min(world, per_node)
    env = LightningEnvironment()
    env.set_world_size(world)
    auto.cluster_environment = env
    auto.precision_plugin = HalfPrecision(precision) if precision.endswith("-true") and precision != "32-true" \
        else Precision()
    auto.connect(_Wrapped(_model(model)))
    rec = auto.recommend(global_batch // (micro * world))
    assert (rec.strategy_name, rec.kwargs) == (cli["strategy"], cli["kwargs"])

    auto.apply(rec)  # what setup builds: the same stage, granularity and options as the row's registered class
    cls, init = _registered(rec.strategy_name)
    built = cls(**{**init, **rec.kwargs})
    assert type(auto.options) is type(built.options) and auto.options.stage == built.options.stage
    if built.options.stage == 3:  # which modules become units (zero3: every module; fsdp_shard: the wrap policy)
        assert auto.options.granularity == built.options.granularity
    assert auto.recommendation is rec
    for k in ["accumulation", *flatten(rec.kwargs)]:
        assert _option(auto.options, k) == _option(built.options, k), k
    mine = {k: v for k, v in auto.options.changed().items() if k != "topology"}
    assert mine == {k: v for k, v in built.options.changed().items() if k != "topology"}
    assert strategies.REGISTERED[rec.strategy_name][0] is cls


# ------------------------------------------------------------------------------------------------ docs
ROOT = Path(__file__).resolve().parents[2]
_SHOWN = ("│", "rows by step time", "recommended:", "hydra:", "python:", "Trainer(", "note:")


@pytest.mark.parametrize("doc,argv", [("README.md", ["gpt_7b", "--preset", "h100_nvl_8"]),
                                      ("docs/planner.md", ["gpt_7b", "--preset", "hgx_h100_8"])])
def test_docs_show_the_real_output(doc, argv):
    """The printed-output examples of README.md and docs/planner.md are what the command prints."""
    flat = " ".join(_cli(["plan", *argv, "--global-batch", "64", "--micro-batch", "1"]).split())
    text = (ROOT / doc).read_text()
    blocks = text.split("```")[1::2]  # inside fenced blocks
    shown = [ln for b in blocks for ln in b.splitlines() if ln.strip().startswith(_SHOWN)]
    assert any("hydra:" in ln for ln in shown) and any("recommended:" in ln for ln in shown)
    for ln in shown:
        assert " ".join(ln.split()) in flat, f"{doc}: {ln.strip()[:100]}"


# ----------------------------------------------------------------------------------- the recipe as it trains
def test_plan_of_a_recipe_uses_its_batch_and_precision_unless_told(capsys):
    """``plan gpt_tiny`` plans the main job's own settings (global 32, micro 8, 32-true), says so, and prints a
    command with them; flags win; a planning size keeps the planner's defaults (64, 1, bf16-true)."""
    from lightning_shard.planner.models import UNSHIPPED_JOB, recipe_job

    assert recipe_job("gpt_tiny")[0] == {"global_batch": 32, "micro_batch": 8, "precision": "32-true"}
    assert recipe_job("gpt_7b")[0] == UNSHIPPED_JOB and recipe_job(None)[0] == UNSHIPPED_JOB
    assert main(["plan", "gpt_tiny", "--preset", "cpu", "--gpus", "2"]) == 0
    out, err = capsys.readouterr()
    assert "planning with global batch 32, micro-batch 8, precision 32-true: recipe gpt_tiny" in err
    assert "recipe.global_batch_size=32 recipe.micro_batch_size=8 trainer.precision=32-true" in " ".join(out.split())
    assert main(["plan", "gpt_tiny", "--preset", "cpu", "--gpus", "2", "--global-batch", "64", "--micro-batch", "4",
                 "--precision", "bf16-mixed"]) == 0
    out, err = capsys.readouterr()
    assert "planning with" not in err
    assert "recipe.global_batch_size=64 recipe.micro_batch_size=4 trainer.precision=bf16-mixed" in " ".join(out.split())
