"""Worker-side scenarios for the checkpoint tests: any strategy (ours or Lightning DDP) at any world size on the
zoo model, with the same global batches whatever the world size (accumulation x world is kept constant)."""

from __future__ import annotations

import os
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_shard.engine.comm import collectives as C
from lightning_shard.strategies import FSDPShardStrategy, ShardedCheckpointIO, Zero3Strategy, ZeroStrategy
from tests.scenarios import ResumePoint, full_optimizer_state, merge_options
from tests.zoo import MICRO, RankMicroBatches, ZooModule, dataset

GLOBAL_MICRO = 4  # micro-batches per optimizer step, over all ranks


def make(kind: str, **kw: Any):
    if kind == "ddp":
        return DDPStrategy(checkpoint_io=ShardedCheckpointIO())
    if kind == "zero3":
        return Zero3Strategy(**kw)
    if kind == "fsdp":
        return FSDPShardStrategy(wrap_classes=["Linear"], **kw)
    return ZeroStrategy(stage=int(kind[-1]), **merge_options({"tuning": {"bucket_mb": 0.0005}}, kw))


def _full_state(trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
    getter = getattr(trainer.strategy, "full_state_dict", None)
    state = getter() if getter is not None else module.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def fit_ckpt(kind: str, steps: int, ckpt_dir: Optional[str] = None, resume_from: Optional[str] = None,
             optimizer: str = "sgd", kill_rank_at: Optional[int] = None, unused: bool = False,
             **strategy_kw: Any) -> dict[str, Any]:
    """``unused``: the zoo's parameter used on even optimizer steps only (its Adam step count lags behind)."""
    world, rank = C.get_world_size(), C.get_rank()
    acc = GLOBAL_MICRO // world
    L.seed_everything(0, verbose=False)
    module = ZooModule(optimizer, unused=unused)
    point = ResumePoint()
    callbacks: list[L.Callback] = [point]
    if ckpt_dir:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1,
                                                             save_last=True))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=make(kind, **strategy_kw), max_steps=steps,
                        accumulate_grad_batches=acc, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    data = dataset(3, acc, world)  # one epoch = 3 optimizer steps; same samples for every world size
    trainer.fit(module, DataLoader(data, batch_sampler=RankMicroBatches(len(data), acc, world, rank)),
                ckpt_path=resume_from)
    opt = full_optimizer_state(trainer.strategy, trainer.optimizers[0])
    steps_per_param = {i: float(st["step"]) for i, st in opt["state"].items() if "step" in st}
    return {"state": _full_state(trainer, module), "first": point.first, "steps_taken": point.steps_taken,
            "steps_per_param": steps_per_param}


def plain_fit(steps: int, resume_from: Optional[str] = None) -> dict[str, torch.Tensor]:
    """Single process, plain Lightning Trainer (no lightning_shard strategy), reading our checkpoints through
    ShardedCheckpointIO."""
    L.seed_everything(0, verbose=False)
    module = ZooModule("sgd", unused=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=GLOBAL_MICRO,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        plugins=[ShardedCheckpointIO(world_size=1, accumulate_grad_batches=GLOBAL_MICRO)])
    trainer.fit(module, DataLoader(dataset(3, GLOBAL_MICRO, 1), batch_size=MICRO), ckpt_path=resume_from)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def save_then_crash(path: str, crash_rank: int) -> str:
    """A sharded save during which ``crash_rank`` dies (SIGKILL-like ``os._exit``) while writing its file."""
    import lightning_shard.checkpoint.save_load as ck

    real = ck.write_rank_file

    def dying(tmp, rank, pieces):
        if rank == crash_rank:
            with open(tmp / f"rank{rank:05d}.pt", "wb") as f:
                f.write(b"PK\x03\x04 half a file")
                f.flush()
            os._exit(9)
        real(tmp, rank, pieces)

    ck.write_rank_file = dying
    module = ZooModule("sgd", unused=False)
    trainer = L.Trainer(accelerator="cpu", devices=C.get_world_size(), strategy=make("zero2"), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    data = dataset(1, 2, 2)
    trainer.fit(module, DataLoader(data, batch_sampler=RankMicroBatches(len(data), 2, 2, C.get_rank())))
    trainer.save_checkpoint(path)
    return "saved"


def state_dict_seen_by_callbacks(kind: str, path: str) -> dict[str, Any]:
    """What a callback reading ``strategy.lightning_module_state_dict()`` (the sharded placeholder) and
    ``strategy.full_state_dict()`` at the end of an epoch gets, and what an ``on_save_checkpoint`` hook reading
    ``checkpoint["state_dict"]`` gets during a sharded save."""
    seen: dict[str, Any] = {}

    class Averager(L.Callback):
        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            sd = trainer.strategy.lightning_module_state_dict()  # sharded: what Lightning's save gets
            try:
                list(sd.keys())
                seen["placeholder_error"] = "no error"
            except RuntimeError as err:
                seen["placeholder_error"] = str(err)
            full = trainer.strategy.full_state_dict()  # the full weights, on demand (collective)
            seen["keys"] = sorted(full)
            seen["module_keys"] = sorted(module.state_dict())
            seen["equal"] = all(full[k].numel() > 0 for k in full)
            opt = full_optimizer_state(trainer.strategy, trainer.optimizers[0])
            seen["optimizer_steps"] = len(opt["state"])
            trainer.save_checkpoint(path)  # during training: the engine holds the shards (stage 3 too)

    class Reads(ZooModule):
        def on_save_checkpoint(self, checkpoint: dict) -> None:
            try:
                list(checkpoint["state_dict"].keys())
                seen["hook_error"] = "no error"
            except RuntimeError as err:
                seen["hook_error"] = str(err)

    world, rank = C.get_world_size(), C.get_rank()
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=make(kind), max_steps=3, logger=False,
                        accumulate_grad_batches=2, use_distributed_sampler=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Averager()], enable_checkpointing=False)
    data = dataset(3, 2, world)
    trainer.fit(Reads("sgd", unused=False), DataLoader(data, batch_sampler=RankMicroBatches(len(data), 2, world, rank)))
    return seen
