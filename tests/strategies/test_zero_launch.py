"""Launchers, sampler injection, sync_dist logging and the hand-back to the parent after a fork launch."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard.strategies import Zero1Strategy, Zero2Strategy, Zero3Strategy
from tests.harness import fresh_world


class _Probe(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l = nn.Linear(4, 3)
        self.seen: list[int] = []

    def training_step(self, batch, i):
        self.seen.extend(batch[1].tolist())
        self.log("rank_value", float(self.global_rank), sync_dist=True, on_step=True)
        return self.l(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(16, 4), torch.arange(16)), batch_size=2)


def injected_sampler() -> dict:
    module = _Probe()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=Zero2Strategy(), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _data())
    sampler = trainer.train_dataloader.sampler
    return {"type": type(sampler).__name__, "replicas": getattr(sampler, "num_replicas", None),
            "rank": getattr(sampler, "rank", None), "seen": module.seen,
            "logged": float(trainer.callback_metrics["rank_value"])}


def test_distributed_sampler_is_injected_and_logs_reduce():
    with fresh_world(2) as w:
        res = w.run(injected_sampler)
    assert [r["type"] for r in res] == ["DistributedSampler", "DistributedSampler"]
    assert [(r["replicas"], r["rank"]) for r in res] == [(2, 0), (2, 1)]
    assert not set(res[0]["seen"]) & set(res[1]["seen"])  # each rank reads its own part of the data
    assert [r["logged"] for r in res] == [0.5, 0.5]  # sync_dist=True really averaged over ranks


def test_sampler_kwargs_count_every_node():
    s = Zero1Strategy(parallel_devices=[torch.device("cpu")] * 4)
    s.num_nodes = 3
    assert s.distributed_sampler_kwargs["num_replicas"] == 12
    assert s.is_distributed


def test_fork_launch_hands_weights_back_to_parent():
    """The default-process parent forks 2 ranks; after fit the parent's module holds the trained weights."""
    module = _Probe()
    before = module.l.weight.detach().clone()
    strategy = Zero2Strategy(launch={"start_method": "fork"})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, _data())
    assert not torch.equal(before, module.l.weight)
    assert trainer.state.finished


def _fork_fit(strategy) -> dict:
    module = _Probe()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _data())
    assert trainer.state.finished
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_fork_launch_hands_full_weights_back_at_stage_3():
    """zero3 ranks hold empty parameter shards between steps; the strategy's teardown makes the module whole
    (release_to_module), so the weights Lightning's launcher hands back to the parent are the trained ones,
    the same as zero2's (same seed, same data)."""
    zero2 = _fork_fit(Zero2Strategy(launch={"start_method": "fork"}))
    zero3 = _fork_fit(Zero3Strategy(launch={"start_method": "fork"}))
    assert zero3.keys() == zero2.keys() and not torch.equal(zero2["l.weight"], _Probe().l.weight)
    for k in zero2:
        torch.testing.assert_close(zero3[k], zero2[k], rtol=0, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_nccl_two_gpus():
    module = _Probe().to(torch.float32)
    strategy = Zero2Strategy(launch={"start_method": "spawn"})
    trainer = L.Trainer(accelerator="cuda", devices=2, strategy=strategy, max_steps=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module, _data())
    assert trainer.state.finished
