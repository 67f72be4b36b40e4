"""Worker-side scenario for the ledger-vs-c10d test: a fit in which every collective the strategy issues, and
every call Lightning makes itself, is counted independently of the ledger (tests/c10d_counter.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_shard.engine.comm import collectives as C
from tests.c10d_counter import C10dCounter
from tests.zoo import RankMicroBatches, ZooModule, dataset

OURS = "lightning_shard.engine.comm.collectives"


class _Logging(ZooModule):
    """The zoo model, logging a metric with sync_dist and gathering a tensor every step (Strategy.reduce and
    Strategy.all_gather, which a user's LightningModule reaches through self.log/self.all_gather)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss, sync_dist=True)
        self.all_gather(torch.ones(2))
        return loss


class _Windows(L.Callback):
    def __init__(self, counter: C10dCounter) -> None:
        self.counter, self.windows = counter, []

    def on_train_batch_start(self, *args: Any) -> None:
        self._marks = (C.LEDGER.mark(), self.counter.mark())

    def on_train_batch_end(self, *args: Any) -> None:
        ledger = Counter(c for e in C.LEDGER.since(self._marks[0]) for c in e.calls)  # what ran in torch.distributed
        calls = self.counter.since(self._marks[1])
        self.windows.append({"ledger": ledger, "ours": Counter(op for op, who in calls if who == OURS),
                             "others": [(op, who) for op, who in calls if who != OURS]})


def counted_fit(strategy: str, acc: int) -> dict[str, Any]:
    world, rank = C.get_world_size(), C.get_rank()
    L.seed_everything(0, verbose=False)
    counter = C10dCounter()
    windows = _Windows(counter)
    with counter:
        mark = C.LEDGER.mark()
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=4,
                            accumulate_grad_batches=acc, use_distributed_sampler=False, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[windows])
        data = dataset(4, acc, world)
        trainer.fit(_Logging(), DataLoader(data, batch_sampler=RankMicroBatches(len(data), acc, world, rank)))
        total = Counter(c for e in C.LEDGER.since(mark) for c in e.calls)
    return {"windows": windows.windows, "total_ledger": total,
            "total_ours": Counter(op for op, who in counter.calls if who == OURS),
            "others": Counter(counter.calls[i] for i in range(len(counter.calls)) if counter.calls[i][1] != OURS)}
