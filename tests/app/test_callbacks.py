"""CommSummary reads the collective ledger per optimizer step and logs comm/* figures (one process)."""

from __future__ import annotations

import csv

import lightning as L
import torch

from lightning_shard.callbacks import CommSummary
from lightning_shard.engine.comm.collectives import LEDGER
from lightning_shard.recipes.corpus import StdlibTextDataModule
from lightning_shard.recipes.gpt import GPTLightningModule


class _RecordingModule(GPTLightningModule):
    """Records one fake collective per micro-batch and one per optimizer step into the ledger."""

    def training_step(self, batch, batch_idx):
        LEDGER.record("reduce_scatter", None, torch.zeros(100), tag="test_micro")  # 400 bytes
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        LEDGER.record("all_gather", None, torch.zeros(50), tag="test_step")  # 200 bytes


def _fit(tmp_path, callback, steps: int, acc: int, name: str) -> L.Trainer:
    """A one-process fit of the recording GPT with ``callback``, logging every step to CSV under ``name``."""
    torch.set_num_threads(1)
    L.seed_everything(0)
    dm = StdlibTextDataModule(block_size=16, micro_batch_size=4, max_bytes=50_000, max_val_windows=8)
    module = _RecordingModule(block_size=16, n_layer=1, n_head=2, n_embd=16)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=acc,
                        limit_val_batches=0, log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                        logger=L.pytorch.loggers.CSVLogger(tmp_path, name=name))
    trainer.fit(module, datamodule=dm)
    return trainer


def test_comm_summary_counts_ledger_entries_per_optimizer_step(tmp_path):
    comm = CommSummary()
    trainer = _fit(tmp_path, comm, steps=6, acc=3, name="t")
    assert comm.step_counts == [4] * 6  # 3 micro-batches + 1 step-time collective per optimizer step
    assert comm.step_bytes == [3 * 400 + 200] * 6
    s = comm.summary(trainer)
    assert s["optimizer_steps"] == 6 and s["accumulate_grad_batches"] == 3
    assert s["collectives_per_step"] == 4
    assert set(s["wire_bytes_per_step_by_op"]) == {"reduce_scatter[world]", "all_gather[world]"}
    rows = list(csv.DictReader(open(tmp_path / "t" / "version_0" / "metrics.csv")))
    logged = [float(r["comm/bytes_step"]) for r in rows if r.get("comm/bytes_step")]
    assert logged and all(b == 1400.0 for b in logged)


def test_shard_metrics_logs_bytes_by_op_and_group_and_memory(tmp_path):
    from lightning_shard.callbacks import ShardMetrics

    metrics = ShardMetrics()
    _fit(tmp_path, metrics, steps=4, acc=2, name="m")
    # one step: 2 micro-batches x 400 B reduce-scatter + 200 B all-gather, in the world group (ring of 1: wire 0)
    assert set(k for k in metrics.last if k.startswith("comm/")) == {
        "comm/reduce_scatter[world]", "comm/all_gather[world]", "comm/total"}
    assert "mem/gathered_params_peak" in metrics.last and "mem/rss" in metrics.last
    rows = list(csv.DictReader(open(tmp_path / "m" / "version_0" / "metrics.csv")))
    assert sum(1 for r in rows if r.get("comm/total") not in (None, "")) == 4  # one row per optimizer step
