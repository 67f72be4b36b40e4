"""Worker-side scenarios for test_hardening.py."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import lightning as L
import psutil
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard.engine.comm import collectives as C
from lightning_shard.strategies import FSDPShardStrategy, Zero3Strategy, ZeroStrategy
from tests.zoo import TinyLMModule


def _trainer(strategy: Any, steps: int, acc: int = 1, callbacks: Optional[list] = None) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=C.get_world_size(), strategy=strategy, max_steps=steps,
                     accumulate_grad_batches=acc, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks or [])


class _Widths(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(4, width)
        self.b = nn.Linear(width, 2)

    def training_step(self, batch, i):
        return self.b(self.a(batch[0])).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def desync_model() -> str:
    """Rank 1 builds a wider layer than rank 0."""
    module = _Widths(8 if C.get_rank() == 0 else 9)
    try:
        _trainer(ZeroStrategy(stage=2), 1).fit(module, DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
    except ValueError as err:
        return str(err)
    return "no error"


def desync_wrap_policy() -> str:
    strategy = FSDPShardStrategy(wrap_classes=["Block"]) if C.get_rank() == 0 else Zero3Strategy()
    tokens = torch.randint(0, 11, (8, TinyLMModule.SEQ + 1))
    try:
        _trainer(strategy, 1).fit(TinyLMModule(), DataLoader(TensorDataset(tokens), batch_size=2))
    except ValueError as err:
        return str(err)
    return "no error"


def rogue_collective() -> str:
    """safety.debug_collectives on a real desync the backend does not notice: at step 1 rank 0 reduces a float32 metric
    and rank 1 an int32 one of the same byte size (gloo pairs the bytes and sums garbage, silently)."""

    class Rogue(_Widths):
        def training_step(self, batch, i):
            loss = super().training_step(batch, i)
            if self.trainer.global_step == 1:
                value = torch.ones(3) if C.get_rank() == 0 else torch.ones(3, dtype=torch.int32)
                self.trainer.strategy.reduce(value, reduce_op="sum")
            return loss

    try:
        _trainer(ZeroStrategy(stage=1, safety={"debug_collectives": True}), 4).fit(
            Rogue(8), DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=2))
    except ValueError as err:
        return str(err)
    return "no error"


class _NaNAtStep(_Widths):
    def training_step(self, batch, i):
        loss = super().training_step(batch, i)
        if self.trainer.global_step == 2 and C.get_rank() == 1:
            loss = loss * float("nan")
        return loss


def nonfinite(skip: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    module = _NaNAtStep(8)
    trainer = _trainer(ZeroStrategy(stage=2, safety={"skip_nonfinite": skip}), 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=2))
        except FloatingPointError as err:
            return {"error": str(err)}
    return {"warnings": [str(w.message) for w in caught if "non-finite" in str(w.message)],
            "skipped": trainer.strategy.precision_plugin.skipped_steps,
            "weights": torch.cat([p.detach().reshape(-1) for p in module.parameters()]),
            "finite": all(bool(torch.isfinite(p).all()) for p in module.parameters())}


class ManyParams(L.LightningModule):
    """2,000 one-element parameters, one parameter larger than the bucket, 8 param groups."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.small = nn.ParameterList([nn.Parameter(torch.randn(1)) for _ in range(2000)])
        self.big = nn.Parameter(torch.randn(400_000) * 0.01)  # 1.6 MB > bucket_mb=1

    def training_step(self, batch, i):
        (x,) = batch
        smalls = torch.cat(list(self.small))
        return ((x @ smalls.view(-1, 1)).pow(2).mean() + (self.big * x.mean()).pow(2).sum())

    def configure_optimizers(self):
        params = list(self.small) + [self.big]
        groups = [{"params": params[g::8], "lr": 0.001 * (g + 1)} for g in range(8)]
        return torch.optim.SGD(groups, lr=0.001, momentum=0.9)


def many_params_data() -> TensorDataset:
    return TensorDataset(torch.randn(32, 2000, generator=torch.Generator().manual_seed(2)) / 45.0)


def many_params(stage: int) -> dict[str, Any]:
    from tests.scenarios import Recorder

    module = ManyParams()
    rec = Recorder()
    kw = {"tuning": {"bucket_mb": 1.0}} if stage < 3 else {}
    strategy = ZeroStrategy(stage=stage, **kw) if stage < 3 else Zero3Strategy()
    from tests.zoo import RankMicroBatches

    data = many_params_data()  # rank r takes global micro-batch 4*step + r (MICRO=4 samples), as the reference
    trainer = L.Trainer(accelerator="cpu", devices=C.get_world_size(), strategy=strategy, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[rec], use_distributed_sampler=False)
    trainer.fit(module, DataLoader(data, batch_sampler=RankMicroBatches(len(data), 1, 4, C.get_rank())))
    return {"state": {k: v.detach().clone() for k, v in trainer_state(module, strategy).items()},
            "per_batch": rec.per_batch}


def trainer_state(module: L.LightningModule, strategy: Any) -> dict[str, torch.Tensor]:
    return strategy.full_state_dict() if hasattr(strategy, "full_state_dict") else module.state_dict()


class _Soak(L.Callback):
    def __init__(self) -> None:
        self.rss: dict[int, int] = {}
        self.gathered_after_step: list[int] = []
        self.pending: list[int] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        engine = trainer.strategy.engine
        step = trainer.global_step
        if (args[-1] + 1) % trainer.accumulate_grad_batches == 0:  # right after an optimizer step
            self.gathered_after_step.append(engine.controller.gathered_bytes())
            self.pending.append(sum(b.gather.work is not None or b.grads.in_flight is not None for b in engine.buckets))
        if step in (300, 1000):
            self.rss[step] = psutil.Process().memory_info().rss


class _MLP(_Widths):
    """8 -> 1024 -> 2 -> 2: 11,272 parameters, 45 KB in fp32, so that one copy of the model leaked per step grows the
    soak's resident set by ~30 MiB over the 700 steps it watches (TinyLMModule, the fsdp case: 27.6 KB)."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__(width)
        self.a = nn.Linear(8, width)
        self.c = nn.Linear(2, 2)

    def training_step(self, batch, i):
        return self.c(self.b(torch.tanh(self.a(batch[0])))).pow(2).mean()


def soak(kind: str, steps: int = 1000) -> dict[str, Any]:
    torch.manual_seed(0)
    strategy = Zero3Strategy(accumulation="per_micro_batch") if kind == "zero3" else \
        FSDPShardStrategy(wrap_classes=["Block"], accumulation="keep_params")
    cb = _Soak()
    tokens = torch.randint(0, 11, (64, TinyLMModule.SEQ + 1), generator=torch.Generator().manual_seed(1))
    trainer = _trainer(strategy, steps, acc=2, callbacks=[cb])
    C.LEDGER.set_max_entries(2_000)  # the bounded ledger is full long before step 300: what grows after is a leak
    module = _MLP() if kind == "zero3" else TinyLMModule()
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    data = TensorDataset(torch.randn(64, 8)) if kind == "zero3" else TensorDataset(tokens)
    try:
        trainer.fit(module, DataLoader(data, batch_size=2))
    finally:
        C.LEDGER.set_max_entries(20_000)
    return {"rss": cb.rss, "gathered": cb.gathered_after_step, "pending": cb.pending,
            "peak_gathered": strategy.engine.controller.peak_gathered_bytes, "model_bytes": model_bytes}
