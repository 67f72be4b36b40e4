"""Every shipped config composes (DESIGN rule 6) and the batch arithmetic refuses bad shapes (rule 8)."""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from lightning_shard.batching import derive_accumulation
from lightning_shard.train import REQUIRED_KEYS, build_trainer_kwargs, check_config

CONF = Path(__file__).resolve().parents[1] / "conf"
STRATEGIES = sorted(p.stem for p in (CONF / "strategy").glob("*.yaml"))
RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))
TRAINERS = sorted(p.stem for p in (CONF / "trainer").glob("*.yaml"))
ZERO_KNOBS = {"accumulation", "bucket_mb", "reduce_dtype", "overlap", "broadcast_buffers", "start_method",
              "timeout_s"}


def _compose(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_config_groups_are_not_empty():
    assert {"zero0", "zero1", "zero2"} <= set(STRATEGIES)
    assert "gpt_tiny" in RECIPES and "cpu" in TRAINERS


def test_default_composition():
    cfg = _compose([])
    assert cfg.strategy._target_ == "lightning_shard.strategies.Zero2Strategy"
    assert cfg.recipe.name == "gpt_tiny"
    assert cfg.trainer.accelerator == "cpu"


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_combination_composes(strategy, recipe, trainer):
    cfg = _compose([f"strategy={strategy}", f"recipe={recipe}", f"trainer={trainer}"])
    OmegaConf.resolve(cfg)  # interpolations resolve
    for key in REQUIRED_KEYS:
        assert OmegaConf.select(cfg, key, default=None) is not None, key
    accumulate = check_config(cfg)
    assert accumulate >= 1
    kwargs = build_trainer_kwargs(cfg, accumulate)
    accepted = set(inspect.signature(L.Trainer.__init__).parameters)
    assert set(kwargs) <= accepted, set(kwargs) - accepted
    assert kwargs["accumulate_grad_batches"] == accumulate
    assert kwargs["val_check_interval"] % accumulate == 0  # validation lands on an optimizer step
    # the model's block size follows the data's
    assert cfg.recipe.model.block_size == cfg.recipe.data.block_size


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s.startswith("zero")])
def test_zero_strategy_knobs(strategy):
    cfg = _compose([f"strategy={strategy}"])
    stage = strategy[-1]
    assert cfg.strategy._target_ == f"lightning_shard.strategies.Zero{stage}Strategy"
    assert set(cfg.strategy) - {"_target_"} == ZERO_KNOBS
    assert cfg.strategy.accumulation in {"defer", "auto", "per_micro_batch"}
    if stage in "01":
        assert cfg.strategy.accumulation in {"defer", "auto"}
    assert cfg.strategy.start_method in {"popen", "fork", "spawn"}
    assert cfg.strategy.reduce_dtype in {None, "bf16", "fp16"}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_configs_instantiate(strategy):
    """The knobs map onto the strategy constructors (skipped while the strategies cannot be imported)."""
    target = _compose([f"strategy={strategy}"]).strategy._target_
    pytest.importorskip(target.rsplit(".", 1)[0])
    from hydra.utils import instantiate

    obj = instantiate(_compose([f"strategy={strategy}"]).strategy)
    assert type(obj).__name__ == target.rsplit(".", 1)[1]


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
    with pytest.raises(ValueError, match="positive integer"):
        derive_accumulation(bad, 1, 1)
    with pytest.raises(ValueError, match="positive integer"):
        derive_accumulation(8, bad, 1)
    with pytest.raises(ValueError, match="positive integer"):
        derive_accumulation(8, 1, bad)


def test_check_config_refuses_bad_batches_from_overrides():
    with pytest.raises(ValueError, match="recipe.global_batch_size"):
        check_config(_compose(["recipe.global_batch_size=30", "recipe.micro_batch_size=4"]))
    with pytest.raises(ValueError, match="recipe.micro_batch_size"):
        check_config(_compose(["recipe.global_batch_size=8", "recipe.micro_batch_size=8"]))
    # world size is devices * num_nodes: 32 / (8 * 2 * 2) = 1 works, 32 / (8 * 2 * 3) does not
    assert check_config(_compose(["trainer.num_nodes=2"])) == 1
    with pytest.raises(ValueError, match="8 \\* 6 = 48"):
        check_config(_compose(["trainer.num_nodes=3"]))


def test_check_config_refuses_typed_accumulation():
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        check_config(_compose(["+trainer.accumulate_grad_batches=4"]))
