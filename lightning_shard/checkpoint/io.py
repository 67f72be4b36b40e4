"""The Trainer's side of checkpoints: the checkpoint methods of the Trainer strategies (:class:`CheckpointMixin`,
mixed into ``ZeroStrategy``) and a CheckpointIO for plain Trainers (:class:`ShardedCheckpointIO`).

How a checkpoint is written and read is ``checkpoint/save_load.py``, which the Fabric strategies call too; this
file turns Lightning's calls into those functions. ``state_dict_type="sharded"`` (default):
``trainer.save_checkpoint`` / ``ModelCheckpoint`` write a directory in which each rank stores only its shards.
``"dcp"``: a ``torch.distributed.checkpoint`` directory. ``"full"``: one consolidated file written by rank 0,
as Lightning's own strategies do. Loading accepts all three, from any strategy and world size. A plain
``Trainer`` (single device, DDP) reads sharded directories through ``Trainer(plugins=[ShardedCheckpointIO()])``
or after ``lightning-shard consolidate``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from ..engine.comm import collectives as C
from .consolidate import lightning_checkpoint
from .format import CheckpointError, Reader
from .save_load import (
    load_model,
    load_optimizers,
    open_directory,
    refuse_file_over_folder,
    released,
    save,
    writes_pieces,
)


def translate_loop_counters(ckpt: dict[str, Any], saved: dict[str, Any], world: int, accumulate: int) -> None:
    """Lightning counts batches per rank. Resuming at another world size with the same global batch
    (world x accumulation constant), rescale those counters so the epoch position means the same thing."""
    old_world, old_acc = saved.get("world_size"), saved.get("accumulate_grad_batches")
    if not old_world or not old_acc or (old_world, old_acc) == (world, accumulate):
        return
    if old_world * old_acc != world * accumulate:
        warnings.warn(f"the global batch changed from {old_world}x{old_acc} to {world}x{accumulate} micro-batches per "
                      "step: Lightning's per-rank batch counters are kept as saved", stacklevel=2)
        return
    progress = ckpt.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if not progress:
        return
    for part in ("total", "current"):
        counts = progress.get(part, {})
        done = counts.get("processed")
        if not isinstance(done, int):
            continue
        if (done * accumulate) % old_acc:
            warnings.warn("resuming at another world size from the middle of an accumulation window: Lightning's "
                          "batch counters cannot be translated exactly", stacklevel=2)
            return
        scaled = done * accumulate // old_acc
        for k, v in counts.items():  # keep each counter's lag behind "processed" (the batch in flight at save)
            if isinstance(v, int):
                counts[k] = scaled - (done - v)


class ShardedWeights(dict):
    """What ``checkpoint["state_dict"]`` and ``checkpoint["optimizer_states"][i]`` hold while Lightning builds a
    checkpoint in ``state_dict_type="sharded"`` mode: the weights are not gathered, each rank writes its own
    shards. Reading it (in an ``on_save_checkpoint`` hook) raises instead of silently giving nothing."""

    _MSG = ("lightning_shard: with state_dict_type='sharded' the checkpoint's weights are not gathered into the "
            "checkpoint dict; each rank writes its shards when the checkpoint is saved. For full weights call "
            "trainer.strategy.full_state_dict() (optimizer state: trainer.strategy.full_optimizer_state(opt); "
            "collective: on every rank), or use state_dict_type='full'.")

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(self._MSG)

    __getitem__ = __iter__ = __len__ = __contains__ = keys = values = items = get = _refuse
    __setitem__ = update = pop = _refuse

    def __repr__(self) -> str:
        return "ShardedWeights(<written per rank by save_checkpoint>)"

    def __reduce__(self) -> Any:
        return (dict, ())  # pickles as an empty dict: nothing of it is ever written


class ShardedCheckpointIO(TorchCheckpointIO):
    """For any Trainer: reads lightning_shard sharded directories (consolidated in memory) and regular files;
    removes checkpoint directories. ``Trainer(strategy="ddp", plugins=[ShardedCheckpointIO()])``.

    ``world_size`` / ``accumulate_grad_batches``: the resuming job's, when it differs from the saving job's
    (same global batch); Lightning's per-rank batch counters are then translated."""

    def __init__(self, world_size: Optional[int] = None, accumulate_grad_batches: Optional[int] = None) -> None:
        super().__init__()
        self.world_size, self.accumulate_grad_batches = world_size, accumulate_grad_batches

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> dict:
        """Sharded directories and regular files, always with ``weights_only=True`` (the argument is ignored)."""
        reader = open_directory(path)  # a directory that is not a complete checkpoint raises, naming the problem
        if reader is not None:
            ckpt = lightning_checkpoint(reader)
            if self.world_size and self.accumulate_grad_batches:
                translate_loop_counters(ckpt, reader.meta, self.world_size, self.accumulate_grad_batches)
            return ckpt
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)  # never unpickle code

    def remove_checkpoint(self, path: Any) -> None:
        p = Path(path)
        if p.is_dir():
            import shutil

            shutil.rmtree(p)
        else:
            super().remove_checkpoint(path)


class CheckpointMixin:
    """Checkpoint methods of the lightning_shard Trainer strategies (mixed into ZeroStrategy): Lightning's calls
    turned into ``checkpoint/save_load.py``'s functions."""

    engine: Any
    options: Any  # the strategy's options (lightning_shard/options): state_dict_type, offload_optimizer
    _reader: Optional[Reader]

    def _sharded(self) -> bool:
        return writes_pieces(self.options.state_dict_type, self.engine)

    def _released(self) -> bool:
        return released(self.engine)

    # ------------------------------------------------------------------ save
    def full_state_dict(self) -> dict[str, Any]:
        """Full weights on every rank (collective); fp32 masters in place of half-precision parameters."""
        if self.engine is not None:
            self.engine.wait_params()  # a post-step all-gather may still be in flight
        state = self.lightning_module.state_dict()
        if self.engine is not None and not self._released():
            state.update(self.engine.gather_full())
        return state

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """What Lightning puts under ``checkpoint["state_dict"]``. ``state_dict_type="full"``: the full weights, as
        the module's ``state_dict()`` names them (collective). ``"sharded"``/``"dcp"`` while the engine holds the
        shards: a :class:`ShardedWeights` placeholder, since ``save_checkpoint`` writes each rank's shards itself (as
        Lightning's own sharded strategies do); :meth:`full_state_dict` gives the full weights on demand."""
        if self._sharded():
            return ShardedWeights()
        return self.full_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """What Lightning puts under ``checkpoint["optimizer_states"]``: as :meth:`lightning_module_state_dict`, a
        placeholder in the sharded formats, else :meth:`full_optimizer_state`."""
        if self._sharded():
            return ShardedWeights()
        return self.full_optimizer_state(optimizer)

    def full_optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Torch's per-parameter optimizer state of ``optimizer``, gathered (collective: every rank must call it)."""
        if self.engine is None:
            return optimizer.state_dict()
        return self.engine.binding_for(getattr(optimizer, "_optimizer", optimizer)).full_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not self._sharded():
            refuse_file_over_folder(filepath, "Save to another path (after fit the module is whole and saves as "
                                              "one file), or save during fit to keep the sharded format.")
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        trainer = getattr(self.lightning_module, "_trainer", None)
        save(self.engine, self.options.state_dict_type, checkpoint, filepath, type(self).strategy_name,
             getattr(trainer, "accumulate_grad_batches", 1))

    def remove_checkpoint(self, filepath: Any) -> None:
        if Path(filepath).is_dir():
            if C.get_rank() == 0:
                import shutil

                shutil.rmtree(filepath, ignore_errors=True)
            return
        super().remove_checkpoint(filepath)

    # ------------------------------------------------------------------ load
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A checkpoint directory: its trainer state, the weights and optimizer states left for
        ``load_model_state_dict`` / ``load_optimizer_state_dict`` to read from it (each rank its own ranges). A file:
        read by Lightning's CheckpointIO."""
        self._ckpt_path = checkpoint_path
        self._reader = open_directory(checkpoint_path, self.lightning_module)
        if self._reader is not None:
            ckpt = self._reader.trainer_state()
            ckpt["state_dict"] = {}
            ckpt["optimizer_states"] = [{} for _ in self._reader.meta["optimizers"]]
            trainer = getattr(self.lightning_module, "_trainer", None)
            translate_loop_counters(ckpt, self._reader.meta, self.world_size,
                                    getattr(trainer, "accumulate_grad_batches", 1))
            return ckpt
        # weights_only=True whatever the caller asks: a checkpoint is data, never code to run (torch.load with
        # weights_only=False executes arbitrary pickles). Own classes in hparams: torch.serialization.add_safe_globals
        return super().load_checkpoint(checkpoint_path, weights_only=True)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        reader = self._reader
        where = reader.path if reader is not None else getattr(self, "_ckpt_path", None)
        masters = load_model(self.lightning_module, self.engine, strict, where, reader=reader,
                             weights=None if reader is not None else checkpoint["state_dict"])
        # stages 0-2 in bf16-true / 16-true: the checkpoint's fp32 values become the fp32 masters, in the engine or
        # kept until setup builds it (these stages restore before setup)
        if masters is not None and self.precision_plugin.precision in ("bf16-true", "16-true"):
            if self.engine is not None:
                self.engine.load_full(masters, masters_only=True)
            else:
                self._masters_from_checkpoint = masters

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        from lightning.fabric.utilities.optimizer import _optimizer_to_device

        reader = self._reader if self.engine is not None else None
        where = reader.path if reader is not None else getattr(self, "_ckpt_path", None)
        load_optimizers(self.engine, self.optimizers, where, reader=reader, states=checkpoint["optimizer_states"])
        if reader is not None:
            self._reader = None
            return
        for optimizer in self.optimizers:
            # offload_optimizer: the state stays in host memory beside the fp32 master shards it updates
            _optimizer_to_device(optimizer, torch.device("cpu") if self.options.offload_optimizer else self.root_device)


__all__ = ["CheckpointError", "CheckpointMixin", "ShardedCheckpointIO", "ShardedWeights",
           "translate_loop_counters"]
