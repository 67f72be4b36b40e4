"""``CommSummary``: per-step communication, memory and throughput figures for a training run.

Per optimizer step it reads the collective ledger (``lightning_shard.engine.comm.collectives.LEDGER``) and logs,
rank-local and unsynchronized, ``comm/wire_bytes_step``, ``comm/bytes_step`` and ``comm/collectives_step``
through ``pl_module.log`` (so the CSV logger records them). At the end it holds the figures the summary
table of ``lightning_shard.train`` prints (see :meth:`CommSummary.summary`).

It works with any strategy: attributes of the sharding strategies (``strategy_name``,
``accumulation_policy``, ``engine.memory_report()``) are read with fallbacks, and with a strategy that
bypasses the ledger (e.g. Lightning's DDP) the communication figures read 0.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar

try:
    from lightning_shard.engine.comm.collectives import LEDGER
    from lightning_shard.engine.comm.ledger import Ledger
except ImportError:  # the core is optional for this callback
    LEDGER, Ledger = None, None


def module_state_bytes(module: torch.nn.Module, optimizers: list[Any]) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (unsharded fallback estimate)."""
    params = {id(p): p for p in module.parameters()}.values()
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    g_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    o_bytes = 0
    for opt in optimizers:
        for state in getattr(opt, "state", {}).values():
            o_bytes += sum(t.numel() * t.element_size() for t in state.values()
                           if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"params": p_bytes, "grads": g_bytes, "optimizer": o_bytes, "total": p_bytes + g_bytes + o_bytes}


class CommSummary(Callback):
    """Collect ledger bytes per optimizer step, model-state memory, tokens/s and losses."""

    def __init__(self, log_per_step: bool = True, on_fit_end_fn: Optional[Any] = None) -> None:
        self.log_per_step = log_per_step
        # Called as ``fn(self.summary(trainer))`` on global rank 0 at the end of fit. Used with fork/spawn
        # launchers, whose worker processes hold the figures while the launching process gets none back.
        self.on_fit_end_fn = on_fit_end_fn
        self._mark: Optional[int] = None
        self._step_at_batch_start = 0
        self._window_losses: list[float] = []
        self.step_wire_bytes: list[float] = []
        self.step_bytes: list[int] = []
        self.step_counts: list[int] = []
        self.step_summaries: list[dict] = []
        self.step_losses: list[float] = []  # mean train loss of each optimizer step's micro-batches (this rank)
        self.val_losses: list[tuple[int, float]] = []  # (global_step, synchronized val_loss)
        self.memory: dict[str, int] = {}
        self.memory_source = "n/a"
        self._train_time = 0.0
        self._t_resume: Optional[float] = None
        self._tokens_start = 0
        self.tokens = 0
        self.world_size = 1

    # ------------------------------------------------------------------ timing (validation excluded)
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.world_size = trainer.world_size
        self._tokens_start = getattr(pl_module, "tokens_seen", 0)
        self._t_resume = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training and self._t_resume is not None:
            self._train_time += time.perf_counter() - self._t_resume
            self._t_resume = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        val = trainer.callback_metrics.get("val_loss")
        if val is not None:
            self.val_losses.append((trainer.global_step, float(val)))
        if trainer.state.fn == "fit" and self._t_resume is None:
            self._t_resume = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._t_resume is not None:
            self._train_time += time.perf_counter() - self._t_resume
            self._t_resume = None
        self.tokens = getattr(pl_module, "tokens_seen", 0) - self._tokens_start
        self._read_memory(trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on_fit_end_fn is not None and trainer.is_global_zero:
            self.on_fit_end_fn(self.summary(trainer))

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._mark is None and LEDGER is not None:
            self._mark = LEDGER.mark()
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = getattr(pl_module, "last_train_loss", None)
        if loss is not None:
            self._window_losses.append(float(loss))
        if trainer.global_step == self._step_at_batch_start:
            return  # not an accumulation boundary: the optimizer did not step
        if self._window_losses:
            self.step_losses.append(sum(self._window_losses) / len(self._window_losses))
            self._window_losses = []
        entries = LEDGER.since(self._mark) if LEDGER is not None and self._mark is not None else []
        self._mark = None
        wire = float(sum(e.wire_bytes for e in entries))
        nbytes = int(sum(e.bytes for e in entries))
        self.step_wire_bytes.append(wire)
        self.step_bytes.append(nbytes)
        self.step_counts.append(len(entries))
        self.step_summaries.append(Ledger.summarize(entries) if Ledger is not None else {})
        if len(self.step_wire_bytes) == 1:
            self._read_memory(trainer, pl_module)
        if self.log_per_step:
            pl_module.log_dict({"comm/wire_bytes_step": wire, "comm/bytes_step": float(nbytes),
                                "comm/collectives_step": float(len(entries))},
                               on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=False)

    def _read_memory(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        report = getattr(engine, "memory_report", None)
        if callable(report):
            mem = {k: int(v) for k, v in report().items()}
            self.memory_source = "engine.memory_report()"
        else:
            mem = module_state_bytes(pl_module, trainer.optimizers)
            self.memory_source = "module tensors (unsharded estimate)"
        if mem.get("total", 0) >= self.memory.get("total", 0):
            self.memory = mem

    # ------------------------------------------------------------------ results
    def summary(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Figures for the final table (rank-local except val_loss, which is synchronized by the module)."""
        strategy = trainer.strategy
        steps = len(self.step_wire_bytes)
        by_op: dict[str, float] = {}
        for s in self.step_summaries:
            for (op, group), row in s.items():
                key = f"{op}[{group}]"
                by_op[key] = by_op.get(key, 0.0) + row["wire_bytes"] / max(1, steps)
        tokens_per_s = self.tokens * self.world_size / self._train_time if self._train_time > 0 else math.nan
        return {
            "strategy": getattr(strategy, "strategy_name", None) or type(strategy).__name__,
            "accumulation_policy": getattr(strategy, "accumulation_policy", None) or "-",
            "world_size": trainer.world_size,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "optimizer_steps": trainer.global_step,
            "wire_bytes_per_step": sum(self.step_wire_bytes) / steps if steps else 0.0,
            "wire_bytes_per_step_by_op": by_op,
            "collectives_per_step": sum(self.step_counts) / steps if steps else 0.0,
            "ledger_available": LEDGER is not None,
            "memory": dict(self.memory),
            "memory_source": self.memory_source,
            "train_time_s": self._train_time,
            "tokens_per_s": tokens_per_s,
            "first_train_loss": self.step_losses[0] if self.step_losses else math.nan,
            "last_train_loss": self.step_losses[-1] if self.step_losses else math.nan,
            "final_val_loss": self.val_losses[-1][1] if self.val_losses else math.nan,
            "final_val_step": self.val_losses[-1][0] if self.val_losses else -1,
        }


def _memory_report(trainer: pl.Trainer) -> Optional[dict[str, int]]:
    report = getattr(getattr(trainer.strategy, "engine", None), "memory_report", None)
    return {k: int(v) for k, v in report().items()} if callable(report) else None


class ShardMetrics(Callback):
    """Per optimizer step, to every Lightning logger (CSV, TensorBoard ...), rank 0's view:

    - ``comm/<op>[<group>]``: ledger wire bytes of that collective and process group in the step
      (e.g. ``comm/reduce_scatter[shard]``, ``comm/all_reduce[replicate]``), and ``comm/total``;
    - ``mem/<key>``: ``engine.memory_report()`` bytes (params, grads, master, optimizer_state ...), read at
      the end of the step; ``mem/gathered_params_peak`` is the largest ``gathered_params`` sampled after
      forward, before the optimizer step and at the end of the step (full parameters held by ZeRO-3/FSDP units);
    - ``mem/cuda_max_allocated`` (CUDA) or ``mem/rss`` (CPU, needs psutil): process memory.

    ``every_n_steps`` thins the logging on long runs; the ledger is read whatever the interval.
    """

    def __init__(self, every_n_steps: int = 1, process_memory: bool = True) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive integer, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.process_memory = process_memory
        self._mark: Optional[int] = None
        self._step_at_start = 0
        self._gathered_peak = 0
        self.last: dict[str, float] = {}

    def _sample_gathered(self, trainer: pl.Trainer) -> None:
        mem = _memory_report(trainer)
        if mem is not None:
            self._gathered_peak = max(self._gathered_peak, mem.get("gathered_params", 0))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._mark is None and LEDGER is not None:
            self._mark = LEDGER.mark()
        self._step_at_start = trainer.global_step

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._sample_gathered(trainer)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._sample_gathered(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._step_at_start:
            return  # inside an accumulation window
        entries = LEDGER.since(self._mark) if LEDGER is not None and self._mark is not None else []
        self._mark = None
        self._sample_gathered(trainer)
        peak, self._gathered_peak = self._gathered_peak, 0
        if trainer.global_step % self.every_n_steps:
            return
        metrics: dict[str, float] = {}
        total = 0.0
        for (op, group), row in (Ledger.summarize(entries) if Ledger is not None else {}).items():
            metrics[f"comm/{op}[{group}]"] = float(row["wire_bytes"])
            total += float(row["wire_bytes"])
        metrics["comm/total"] = total
        mem = _memory_report(trainer)
        if mem is not None:
            metrics.update({f"mem/{k}": float(v) for k, v in mem.items() if not k.endswith("_elements")})
        metrics["mem/gathered_params_peak"] = float(peak)
        if self.process_memory:
            metrics.update(self._process_memory(pl_module))
        self.last = metrics
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=True)

    @staticmethod
    def _process_memory(pl_module: pl.LightningModule) -> dict[str, float]:
        if pl_module.device.type == "cuda":
            return {"mem/cuda_max_allocated": float(torch.cuda.max_memory_allocated(pl_module.device))}
        try:
            import psutil
        except ImportError:
            return {}
        return {"mem/rss": float(psutil.Process().memory_info().rss)}


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar counting optimizer steps against ``max_steps``.

    Lightning's bar counts micro-batches of the current epoch against the epoch's length and shows the
    logger's version (``Epoch 0/-2 ... 600/300 v_num: 0.000`` on a step-bounded run with accumulation).
    This one shows one bar for the whole fit: optimizer steps done / ``max_steps`` (or the steps the epochs
    give when ``max_steps`` is unset), the micro-batches seen so far and per step as ``micro_batches: 12
    (2/step)``, and no ``v_num``.
    """

    @property
    def total_train_batches(self) -> float:
        t = self.trainer
        if t.max_steps is not None and t.max_steps > 0:
            return t.max_steps
        per_epoch = t.num_training_batches
        if t.max_epochs is not None and t.max_epochs > 0 and math.isfinite(per_epoch):
            return math.ceil(per_epoch / t.accumulate_grad_batches) * t.max_epochs
        return float("inf")

    def _get_train_description(self, current_epoch: int) -> str:
        return f"{'steps':{len(self.validation_description)}}"

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.train_progress_bar_id is not None and self.progress is not None:
            return  # one bar for the whole fit, not one per epoch
        super().on_train_epoch_start(trainer, pl_module)
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, completed=trainer.global_step)  # a resumed run

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        done = trainer.fit_loop.epoch_loop.batch_progress.total.completed
        items["micro_batches"] = f"{done} ({trainer.accumulate_grad_batches}/step)"
        return items
