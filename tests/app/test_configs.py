"""Every shipped config composes and instantiates ("Design rules" 11); the batch arithmetic refuses bad shapes (7).

Hydra composition costs ~0.25 s here, so the strategy x topology x recipe product (9 x 8 x 7) is covered as:
Hydra composes every strategy x topology pair (with its machine/ and specialize/ groups), and each of those is
checked with every recipe node (each recipe composed once by Hydra, then swapped in): the pre-launch check
either passes or refuses the combination with a message naming the key. Each group option is instantiated once.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

from lightning_shard.app.checks import ConfigError, check_all
from lightning_shard.app.launch import topology_fact, topology_from_node
from lightning_shard.batching import derive_accumulation
from lightning_shard.strategies import REGISTERED
from lightning_shard.train import REQUIRED_KEYS, build_callbacks, build_loggers, build_trainer_kwargs, check_config
from tests.optional import require

CONF = Path(__file__).resolve().parents[2] / "conf"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


STRATEGIES, TOPOLOGIES, RECIPES = _options("strategy"), _options("topology"), _options("recipe")
TRAINERS, LOGGERS, CALLBACKS, EXPERIMENTS = (_options(g) for g in ("trainer", "logger", "callbacks", "experiment"))
HYBRID = {s for s in STRATEGIES if s.endswith("_hybrid")}


def _compose(overrides: list[str], hydra_config: bool = False):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides, return_hydra_config=hydra_config)


@pytest.fixture(scope="module")
def recipe_nodes():
    """Each recipe composed once by Hydra, resolved to plain data."""
    return {r: OmegaConf.to_container(_compose([f"recipe={r}"]).recipe, resolve=True) for r in RECIPES}


def test_every_registered_strategy_has_a_config():
    # Lightning owns the name "auto": the registered "zero_auto" is the Hydra option strategy=auto
    assert {"auto" if name == "zero_auto" else name for name in REGISTERED} <= set(STRATEGIES)
    assert {"gpt_tiny", "gpt_test", "gpt_1b", "hf_causal_lm", "hf_causal_lm_lora", "digits",
            "synthetic"} <= set(RECIPES)
    assert {"csv", "tensorboard"} <= set(LOGGERS)


def test_default_composition_is_the_main_job():
    cfg = _compose([])
    assert cfg.strategy._target_ == "lightning_shard.strategies.Zero2Strategy"
    assert cfg.recipe.name == "gpt_tiny" and cfg.topology.name == "cpu"
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.num_nodes) == ("cpu", 2, 1)
    assert check_config(cfg) == 2


@pytest.mark.parametrize("topology,accelerator,devices,nodes", [
    ("cpu", "cpu", 2, 1), ("cpu_2x2", "cpu", 4, 1), ("hgx_h100_8", "gpu", 8, 1), ("hgx_h100_2nodes_ib", "gpu", 8, 2),
    ("a100_pcie_4_pairs", "gpu", 4, 1)])
def test_devices_and_nodes_come_from_the_topology(topology, accelerator, devices, nodes):
    cfg = _compose([f"topology={topology}"])
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.num_nodes) == (accelerator, devices, nodes)
    cfg = _compose([f"topology={topology}", "trainer.devices=1"])  # an explicit value still wins
    assert cfg.trainer.devices == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_combination_composes_and_checks(strategy, recipe_nodes):
    accepted = set(inspect.signature(L.Trainer.__init__).parameters)
    ok = 0
    for topology in TOPOLOGIES:
        cfg = _compose([f"strategy={strategy}", f"topology={topology}"])  # with machine/ and specialize/
        for key in REQUIRED_KEYS:
            assert OmegaConf.select(cfg, key, default=None) is not None, key
        plain = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("strategy", "topology", "trainer")}
        islands = topology_fact(plain["topology"], "islands_per_node")
        for recipe, node in recipe_nodes.items():
            runnable_here = (topology == "cpu" and strategy not in HYBRID) or \
                (topology == "cpu_2x2" and strategy in HYBRID and recipe in ("gpt_tiny", "gpt_test", "synthetic"))
            try:
                accumulate = check_all({**plain, "recipe": node}, islands)
            except ConfigError as err:  # an impossible combination, refused with the key that makes it so
                assert not runnable_here, f"{strategy} x {topology} x {recipe}: {err}"
                assert "recipe.micro_batch_size" in str(err) or "strategy.shard_size" in str(err), str(err)
                assert strategy in HYBRID or "recipe.micro_batch_size" in str(err), str(err)
                continue
            ok += 1
            trainer = plain["trainer"]
            assert trainer["devices"] * trainer["num_nodes"] * node["micro_batch_size"] * accumulate == \
                node["global_batch_size"]
        if topology == "cpu" and strategy not in HYBRID:
            kwargs = build_trainer_kwargs(cfg, check_config(cfg))
            assert set(kwargs) <= accepted, set(kwargs) - accepted
            assert kwargs["val_check_interval"] % kwargs["accumulate_grad_batches"] == 0  # lands on a step
    assert ok > 0  # every strategy has runnable combinations


def test_specialization_group_applies():
    assert _compose(["strategy=zero3", "topology=pcie_8"]).strategy.tuning.reshard_after_forward is False
    assert _compose(["strategy=zero3", "topology=hgx_h100_8"]).strategy.tuning.reshard_after_forward is True
    # a specialization sets one field of a group: the group's other fields keep their defaults
    assert _compose(["strategy=zero3", "topology=pcie_8"]).strategy.tuning.bucket_mb == 25.0


# ------------------------------------------------------------------------------------------ instantiation
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_configs_instantiate(strategy):
    cfg = _compose([f"strategy={strategy}", "topology=cpu_2x2"])
    obj = instantiate(cfg.strategy, _convert_="all")
    assert type(obj).__name__ == cfg.strategy._target_.rsplit(".", 1)[1]
    if strategy in HYBRID:
        assert obj.options.shard_size == "auto" and obj.options.topology == "cpu_2x2"


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "fsdp_shard", "auto"])
def test_group_overrides_reach_the_strategy(strategy):
    """``strategy.<group>.<field>=...`` composes into the group's node and the instantiated strategy holds it in
    ``options.<group>``; the group's other fields keep their defaults."""
    cfg = _compose([f"strategy={strategy}", "strategy.tuning.bucket_mb=5", "strategy.launch.start_method=fork",
                    "strategy.compression.error_feedback=false", "strategy.safety.timeout_s=60"])
    obj = instantiate(cfg.strategy, _convert_="all")
    opts = obj.options
    assert (opts.tuning.bucket_mb, opts.launch.start_method, opts.compression.error_feedback,
            opts.safety.timeout_s) == (5.0, "fork", False, 60.0)
    assert opts.tuning.overlap is True and opts.changed()["tuning"] == {"bucket_mb": 5.0}


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_topology_presets_build(topology):
    cfg = _compose([f"topology={topology}"])
    topo = topology_from_node(OmegaConf.to_container(cfg.topology, resolve=True))
    assert topo.devices_per_node == cfg.trainer.devices and topo.num_nodes == cfg.trainer.num_nodes
    assert len(topo.islands) >= 1


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_instantiate_and_state_hardware_and_result(recipe):
    if recipe.startswith("hf_"):
        require("transformers", "hf")
    if recipe == "digits":
        require("sklearn", "digits")
    cfg = _compose([f"recipe={recipe}"])
    assert cfg.recipe.hardware != "?" and cfg.recipe.expected != "?", "a recipe states its hardware and result"
    assert cfg.recipe.name == recipe
    dm = instantiate(cfg.recipe.data, micro_batch_size=cfg.recipe.micro_batch_size, seed=0, _convert_="all")
    assert isinstance(dm, L.LightningDataModule)
    if recipe == "gpt_1b":  # 1B parameters: built on the meta device, counted, never allocated
        with torch.device("meta"):
            module = instantiate(cfg.recipe.model, _convert_="all")
        assert 0.95e9 < module.model.num_parameters() < 1.1e9
        return
    module = instantiate(cfg.recipe.model, _convert_="all")
    assert isinstance(module, L.LightningModule)
    if recipe == "hf_causal_lm_lora":
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        assert 0 < trainable < sum(p.numel() for p in module.parameters()) / 4


def _with_output_dir(tmp_path, overrides):
    cfg = _compose(overrides, hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path)
    HydraConfig.instance().set_config(cfg)
    return cfg


@pytest.mark.parametrize("logger", LOGGERS)
def test_logger_configs_instantiate(logger, tmp_path):
    if logger == "tensorboard":
        require("tensorboard", "tensorboard")
    cfg = _with_output_dir(tmp_path, [f"logger={logger}"])
    loggers = build_loggers(cfg)
    assert len(loggers) == {"none": 0, "csv": 1, "tensorboard": 2}[logger]
    assert all(str(tmp_path) in lg.save_dir for lg in loggers)


@pytest.mark.parametrize("callbacks", CALLBACKS)
@pytest.mark.parametrize("trainer", TRAINERS)
def test_callbacks_and_trainer_configs_instantiate(callbacks, trainer):
    cfg = _compose([f"callbacks={callbacks}", f"trainer={trainer}"])
    cbs = build_callbacks(cfg)
    names = {type(c).__name__ for c in cbs}
    assert "ShardMetrics" in names
    assert ("StepProgressBar" in names) == (callbacks == "default" and cfg.trainer.enable_progress_bar)
    assert ("ModelCheckpoint" in names) == (callbacks == "default" and cfg.trainer.enable_checkpointing)
    L.Trainer(**build_trainer_kwargs(cfg, check_config(cfg)), callbacks=cbs, logger=False,
              strategy=instantiate(cfg.strategy))  # the Trainer accepts every key


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiments_compose(experiment):
    cfg = _compose([f"experiment={experiment}"])
    accumulate = check_config(cfg)
    assert accumulate >= 1 and cfg.seed == 1234


def test_every_shipped_config_says_what_it_is():
    for path in CONF.rglob("*.yaml"):
        assert path.read_text().lstrip().startswith("#"), f"{path} has no header comment"


# ------------------------------------------------------------------------------------ batch arithmetic
@pytest.mark.parametrize("global_batch,micro,world,expected", [
    (32, 8, 2, 2), (32, 16, 2, 1), (32, 1, 1, 32), (64, 4, 4, 4), (6, 3, 2, 1)])
def test_derive_accumulation(global_batch, micro, world, expected):
    assert derive_accumulation(global_batch, micro, world) == expected


def test_micro_larger_than_global_is_refused():
    with pytest.raises(ValueError, match=r"recipe\.micro_batch_size \* world_size = 8 \* 2 = 16") as e:
        derive_accumulation(8, 8, 2)
    assert "recipe.global_batch_size" in str(e.value)


def test_not_divisible_is_refused_with_the_fix():
    with pytest.raises(ValueError) as e:
        derive_accumulation(30, 4, 2)
    msg = str(e.value)
    assert "recipe.global_batch_size = 30" in msg and "4 * 2 = 8" in msg
    assert "24 or 32" in msg  # nearest global batches that work
    assert "recipe.micro_batch_size to one of [1, 3]" in msg


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_non_positive_integers_are_refused(bad):
    for args in ((bad, 1, 1), (8, bad, 1), (8, 1, bad)):
        with pytest.raises(ValueError, match="positive integer"):
            derive_accumulation(*args)


def test_world_size_comes_from_the_topology():
    # gpt_tiny: 32 / (8 * 2) = 2 on topology=cpu; cpu_2x2 has 4 devices: 32 / (8 * 4) = 1
    assert check_config(_compose([])) == 2
    assert check_config(_compose(["topology=cpu_2x2"])) == 1
    assert check_config(_compose(["trainer.num_nodes=2"])) == 1
    with pytest.raises(ValueError, match="8 \\* 6 = 48"):
        check_config(_compose(["trainer.num_nodes=3"]))
    with pytest.raises(ValueError, match="8 \\* 8 = 64"):  # 8 GPUs: the tiny recipe's global batch is too small
        check_config(_compose(["topology=hgx_h100_8"]))
    assert check_config(_compose(["topology=hgx_h100_8", "recipe.global_batch_size=128"])) == 2
