"""Bad input gets a ValueError/TypeError that names the fix (ZeRO-1/2 issue, "Bad input")."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_shard.engine.engine import ShardEngine
from lightning_shard.options import options_for
from lightning_shard.strategies import Zero1Strategy, Zero2Strategy, ZeroStrategy
from tests.harness import fresh_world


def test_unknown_option_names_the_close_match():
    with pytest.raises(TypeError, match=r"'acumulation'.*did you mean 'accumulation'"):
        Zero2Strategy(acumulation="defer")
    with pytest.raises(TypeError, match=r"tuning: unknown option\(s\) 'bucket_size'.*did you mean 'bucket_mb'"):
        Zero2Strategy(tuning={"bucket_size": 10})


def test_a_grouped_option_given_flat_names_its_group():
    with pytest.raises(TypeError, match=r"'bucket_mb'.*tuning=\{'bucket_mb'"):
        Zero2Strategy(bucket_mb=10)


@pytest.mark.parametrize("kwargs,match", [
    (dict(stage=3), "use Zero3Strategy or FSDPShardStrategy"),
    (dict(accumulation="sometimes"), "accumulation must be one of"),
    (dict(stage=1, accumulation="per_micro_batch"), "needs sharded gradients"),
    (dict(tuning={"bucket_mb": 0}), "bucket_mb must be a positive"),
    (dict(compression={"reduce_dtype": "int8"}), "reduce_dtype must be"),
    (dict(launch={"start_method": "thread"}), "start_method must be one of"),
    (dict(safety={"timeout_s": -1}), "timeout_s must be a positive"),
])
def test_bad_option_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


def test_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    for name in ("zero0", "zero1", "zero2"):
        assert name in StrategyRegistry


class _Custom(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        return None


@pytest.mark.parametrize("make,exc,match", [
    (lambda m: torch.optim.LBFGS(m.parameters()), TypeError, "LBFGS cannot be sharded"),
    (lambda m: _Custom(m.parameters()), TypeError, "allow_custom_optimizer=True"),
])
def test_unsupported_optimizers(make, exc, match):
    model = nn.Linear(3, 3)
    with pytest.raises(exc, match=match):
        ShardEngine(model, [make(model)], options_for("zero2", accumulation="defer"))


def test_no_trainable_parameters():
    model = nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        ShardEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], options_for("zero1", accumulation="defer"))


def test_optimizer_over_foreign_tensor():
    model = nn.Linear(3, 3)
    stray = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="not a parameter of the LightningModule"):
        ShardEngine(model, [torch.optim.SGD([stray, *model.parameters()], lr=0.1)],
                    options_for("zero1", accumulation="defer"))


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 2)

    def training_step(self, batch, i):
        return self.l(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_with_devices(devices: int) -> str:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=Zero1Strategy(), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(_Tiny(), data)
    except ValueError as err:
        return str(err)
    return "no error"


def test_mismatched_world_size():
    with fresh_world(2) as w:
        msgs = w.run(fit_with_devices, 4)
    for m in msgs:
        assert "2 ranks already exists" in m and "devices" in m, m
