"""Worker-side scenarios shared by the Lightning test modules (run inside :class:`tests.harness.World` ranks)."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import lightning as L
from torch.utils.data import DataLoader

from lightning_shard.engine.comm import collectives as C
from lightning_shard.options import merge as merge_options
from lightning_shard.strategies import FSDPShardStrategy, Zero3Strategy, ZeroStrategy
from tests.zoo import RankMicroBatches, dataset, make_module


class _LateWork:
    """An async collective's handle that completes ``delay`` seconds after it was issued at the earliest."""

    def __init__(self, work: Any, ready_at: float) -> None:
        self._work, self._ready_at = work, ready_at

    def wait(self, timeout: Any = None) -> bool:
        self._work.wait() if timeout is None else self._work.wait(timeout)
        time.sleep(max(0.0, self._ready_at - time.monotonic()))
        return True

    def is_completed(self) -> bool:
        return time.monotonic() >= self._ready_at and self._work.is_completed()


@contextmanager
def slow_all_gather(seconds: float) -> Iterator[None]:
    """Every all-gather takes at least ``seconds`` from issue to completion (a slow link), so that a test can
    show prefetching hides it: wraps the torch function ``engine/comm/collectives.py`` calls, in this process only."""
    if not seconds:
        yield
        return
    real = C._ag_impl

    def late(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        work = real(*args, async_op=async_op, **kwargs)
        if async_op:
            return _LateWork(work, time.monotonic() + seconds)
        time.sleep(seconds)
        return work

    C._ag_impl = late
    try:
        yield
    finally:
        C._ag_impl = real

class _Deferred:
    """An all-gather that has not run yet: the real one runs when waited, so its data arrive at the wait."""

    def __init__(self, run: Any) -> None:
        self._run = run

    def wait(self, timeout: Any = None) -> bool:
        run, self._run = self._run, None
        if run is not None:
            run()
        return True

    def is_completed(self) -> bool:
        return self._run is None


@contextmanager
def late_all_gather() -> Iterator[None]:
    """Async all-gathers (either path: ``all_gather_single`` or N broadcasts) deliver nothing until they are waited
    (a link so slow that nothing overlapped them): code that reads a parameter before waiting for its gather reads
    the previous value, on every run, not by chance. Every rank waits its gathers in the same order (they are on a
    group of their own), so the deferred collectives pair up."""
    real = C.all_gather

    def late(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        if not async_op:
            return real(*args, **kwargs)
        return _Deferred(lambda: real(*args, async_op=False, **kwargs))

    C.all_gather = late
    try:
        yield
    finally:
        C.all_gather = real


STEPS = 5
SMALL_BUCKETS = 0.0003  # MiB: several buckets even for this tiny model (one optimizer, both param groups per bucket)


class Recorder(L.Callback):
    """Ledger entries per training micro-batch."""

    def __init__(self) -> None:
        self.per_batch: list[list[tuple[str, str, float]]] = []
        self.per_batch_groups: list[list[tuple[str, str, str, int]]] = []
        self.step_memory: list[dict[str, int]] = []
        self.gather_calls: Counter = Counter()  # the torch.distributed calls that ran the parameter all-gathers
        self.record_events = False
        self._mark = 0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._mark = C.LEDGER.mark()
        controller = trainer.strategy.engine.controller
        if controller is not None and self.record_events:
            controller.gathers.events.append(("batch", batch_idx))  # where each micro-batch's events start

    def on_train_batch_end(self, *args: Any) -> None:
        entries = C.LEDGER.since(self._mark)
        self.per_batch.append([(e.op, e.tag, e.wire_bytes) for e in entries])
        self.per_batch_groups.append([(e.op, e.tag, e.group, e.bytes) for e in entries])
        self.gather_calls.update(c for e in entries if e.op == "all_gather" for c in e.calls)

    def on_before_optimizer_step(self, trainer: Any, *args: Any) -> None:
        self.step_memory.append(trainer.strategy.engine.memory_report())

    def on_train_start(self, trainer: Any, *args: Any) -> None:
        controller = trainer.strategy.engine.controller
        if controller is not None and self.record_events:
            controller.gathers.record_events = True


class ResumePoint(L.Callback):
    """Where training (re)started: (global step, epoch, batch index) at the first batch this fit runs, and the
    number of optimizer steps it took. A run started again from scratch reports (0, 0, 0)."""

    def __init__(self) -> None:
        self.first: Optional[tuple[int, int, int]] = None
        self.steps_taken = 0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if self.first is None:
            self.first = (trainer.global_step, trainer.current_epoch, batch_idx)

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.steps_taken += 1


def full_optimizer_state(strategy: Any, optimizer: Any) -> dict:
    """The full optimizer state: ours gather it on demand (collective), Lightning's own strategies hold it."""
    return getattr(strategy, "full_optimizer_state", strategy.optimizer_state)(optimizer)


def with_comm(strategy: Any, comm: Optional[dict]) -> Any:
    """``comm``: how collectives run (``{"reduce_scatter": "all_reduce"}``, engine/comm/choices.py), set on the
    strategy as the benchmarks do (not an option); None: the engine's per-backend choice."""
    if comm is not None:
        from lightning_shard.engine.comm.choices import CommChoices

        strategy.comm = CommChoices(**comm)
    return strategy


def make_strategy(stage: Any, accumulation: str, bucket_mb: float, find_unused: Optional[bool], **extra: Any):
    """``find_unused=None``: the strategy's default (what a user gets without the option). ``comm``: see
    :func:`with_comm`."""
    comm = extra.pop("comm", None)
    return with_comm(_make_strategy(stage, accumulation, bucket_mb, find_unused, **extra), comm)


def _make_strategy(stage: Any, accumulation: str, bucket_mb: float, find_unused: Optional[bool], **extra: Any):
    if find_unused is not None:
        extra = merge_options(extra, tuning={"find_unused_parameters": find_unused})
    if stage == "auto":
        from lightning_shard.strategies import AutoStrategy

        return AutoStrategy(**extra)
    if stage < 3:
        return ZeroStrategy(stage=stage, accumulation=accumulation,
                            **merge_options({"tuning": {"bucket_mb": bucket_mb}}, extra))
    cls = FSDPShardStrategy if "wrap_classes" in extra or "min_params" in extra else Zero3Strategy
    return cls(accumulation=accumulation, **extra)


def fit_zero(stage: int, accumulation: str, acc: int, steps: int = STEPS, optimizer: str = "sgd",
             clip: Optional[float] = None, precision: str = "32-true", manual: bool = False,
             bucket_mb: float = SMALL_BUCKETS, bn: bool = True, find_unused: Optional[bool] = None,
             save_to: Optional[str] = None, resume_from: Optional[str] = None, unused: bool = True,
             data_steps: Optional[int] = None, ckpt_dir: Optional[str] = None,
             strategy_kwargs: Optional[dict] = None, model: str = "zoo", record_events: bool = False,
             delay_gather_s: float = 0.0, num_nodes: int = 1, activation_checkpointing: bool = False,
             clip_algorithm: str = "norm", first_step: int = 0) -> dict[str, Any]:
    """``first_step``: the loader starts at this optimizer step's micro-batches (resuming from a checkpoint
    that carries no loop state, e.g. one written by Fabric)."""
    world, rank = C.get_world_size(), C.get_rank()
    L.seed_everything(0, verbose=False)
    module = make_module(model, optimizer=optimizer, bn=bn, manual=manual, acc=acc, unused=unused,
                         activation_checkpointing=activation_checkpointing)
    recorder = Recorder()
    recorder.record_events = record_events
    point = ResumePoint()
    callbacks: list[L.Callback] = [recorder, point]
    if ckpt_dir:  # Lightning's default full checkpoint, every 3 optimizer steps
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1))
    strategy = make_strategy(stage, accumulation, bucket_mb, find_unused, **(strategy_kwargs or {}))
    trainer = L.Trainer(accelerator="cpu", devices=world // num_nodes, num_nodes=num_nodes, strategy=strategy,
                        max_steps=steps,
                        accumulate_grad_batches=1 if manual else acc, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=clip, gradient_clip_algorithm=clip_algorithm, precision=precision,
                        callbacks=callbacks)
    data = dataset(data_steps or steps, acc, world, model)
    loader = DataLoader(data, batch_sampler=RankMicroBatches(len(data), acc, world, rank, first_step))
    with slow_all_gather(delay_gather_s):
        trainer.fit(module, loader, ckpt_path=resume_from)
    if save_to:
        trainer.save_checkpoint(save_to)
    engine = trainer.strategy.engine
    opt = trainer.optimizers[0]
    module_state = trainer.strategy.full_state_dict()  # gathered where the module holds shards
    return {
        "state": {k: v.detach().clone() for k, v in module_state.items()},
        "norms": module.grad_norms,
        "per_batch": recorder.per_batch,
        "reduce_ops": {op for entries in recorder.per_batch for op, tag, _ in entries if tag.startswith("grad_bucket")},
        "gather_calls": dict(recorder.gather_calls),
        "gather_paths": sorted({b.gather.all_gather.name for b in engine.buckets if b.trainable}),
        "per_batch_groups": recorder.per_batch_groups,
        "bucket_padded": [b.layout.padded_numel for b in engine.buckets if b.trainable],
        "axes": trainer.strategy._groups.axes,
        "chosen": getattr(trainer.strategy, "recommendation", None) and trainer.strategy.recommendation.strategy_name,
        # strategy=auto's predicted vs measured step check (strategies/auto.py StepTimeCheck), where it ran
        "step_check": next(((c.predicted_s, c.measured_s, c.model) for c in trainer.callbacks
                            if type(c).__name__ == "StepTimeCheck"), None),
        "memory": engine.memory_report(),
        "buckets": [(b.layout.numel, b.layout.padded_numel, b.opt_index) for b in engine.buckets],
        "exp_avg_numel": sum(st["exp_avg"].numel() for st in opt.state.values() if "exp_avg" in st),
        "param_dtype": next(module.parameters()).dtype,
        "optimizer_tensors": sum(len(b.chunks) for b in engine.buckets if b.trainable),
        "policy": strategy.accumulation_policy,
        "opt_state": full_optimizer_state(trainer.strategy, opt) if save_to else None,
        "units": [u.name for u in engine.units],
        "step_units": [u.name for u in engine.controller.schedule.step_units] if engine.controller else [],
        "unit_buckets": [len(u.buckets) for u in engine.units],
        "unit_bytes": [u.full_bytes for u in engine.units],
        "peak_gathered": engine.controller.peak_gathered_bytes if engine.controller else 0,
        "root_bytes": engine.controller.root.full_bytes if engine.controller and engine.controller.root else 0,
        "events": engine.controller.gathers.events if engine.controller else [],
        "step_memory": recorder.step_memory,
        "bucket_trainable": [b.trainable for b in engine.buckets],
        "numel_trainable": sum(b.layout.numel for b in engine.buckets if b.trainable),
        "first": point.first,
        "steps_taken": point.steps_taken,
    }




def fit_lightning_ddp(acc: int, steps: int = STEPS, model: str = "zoo") -> dict[str, Any]:
    """The peer: Lightning's own DDPStrategy on the same ranks and data; the module's state_dict on each rank."""
    from lightning.pytorch.strategies import DDPStrategy

    world, rank = C.get_world_size(), C.get_rank()
    L.seed_everything(0, verbose=False)
    module = make_module(model)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(find_unused_parameters=True),
                        max_steps=steps, accumulate_grad_batches=acc, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = dataset(steps, acc, world, model)
    trainer.fit(module, DataLoader(data, batch_sampler=RankMicroBatches(len(data), acc, world, rank)))
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()}}
