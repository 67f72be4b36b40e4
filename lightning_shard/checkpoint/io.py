"""Lightning side of checkpoints: sharded save/load for the strategies, and a CheckpointIO for plain Trainers.

``state_dict_type="sharded"`` (default): ``trainer.save_checkpoint`` / ``ModelCheckpoint`` write a directory
(see ``checkpoint/format.py``) in which each rank stores only its shards, committed atomically.
``"full"``: one consolidated file written by rank 0, as Lightning's own strategies do. ``"dcp"``: a
``torch.distributed.checkpoint`` directory (``dcp.py``: each rank's ranges as chunks of the full tensors, keys
as Lightning's ``ModelParallelStrategy`` writes them), which DCP's own tools and FSDP2 read.

Loading accepts all three, from any strategy and world size: a full file (also one written by Lightning's
``DDPStrategy`` or a single device), a sharded directory, or a DCP directory (also one written by Lightning's
``ModelParallelStrategy`` / FSDP2, or one in the layout of ``FSDPStrategy(state_dict_type="sharded")``: ``model.``
keys). A plain ``Trainer`` (single device, DDP) reads sharded directories through
``Trainer(plugins=[ShardedCheckpointIO()])`` or after ``lightning-shard consolidate``.
"""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from ..engine.comm import collectives as C
from ..engine.state_dict import param_aliases
from . import dcp
from .consolidate import lightning_checkpoint, model_state
from .format import (
    CheckpointError,
    Reader,
    commit,
    data_dir_for,
    is_sharded_checkpoint,
    model_mismatch,
    rank_file,
    write_rank_file,
    write_trainer_state,
)
from .pieces import collect_pieces

MODEL_KEYS = ("state_dict", "optimizer_states")


def plain(obj: Any) -> Any:
    """Containers as plain dict/list/tuple so that ``torch.load(weights_only=True)`` accepts them."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj) if type(obj) in (list, tuple) else [plain(v) for v in obj]
    return obj


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


def save_sharded(engine: Any, checkpoint: dict[str, Any], filepath: Any, strategy_name: str,
                 accumulate: int = 1) -> None:
    """Every rank writes its pieces into a new version folder; rank 0 commits it as ``filepath`` (an overwrite
    swaps ``meta.json`` atomically, see checkpoint/format.py). Collective."""
    final = Path(filepath)
    suffix = C.broadcast_object(uuid.uuid4().hex[:8] if C.get_rank() == 0 else None, tag="checkpoint")
    data, root = data_dir_for(final, suffix) if C.get_rank() == 0 else (None, None)
    data, root = C.broadcast_object((data, root), tag="checkpoint")  # one decision for every rank
    if C.get_rank() == 0:
        data.mkdir(parents=True, exist_ok=False)
    C.barrier(tag="checkpoint")
    pieces, index, meta = collect_pieces(engine)
    write_rank_file(data, C.get_rank(), pieces)
    all_index = C.all_gather_object(index, tag="checkpoint")
    C.barrier(tag="checkpoint")  # every rank's file is on disk (fsync'd) before the commit
    if C.get_rank() == 0:
        merged: dict[str, list] = {}
        for rank, idx in enumerate(all_index):
            for key, (lo, hi) in idx.items():
                merged.setdefault(key, []).append([rank, lo, hi])
        write_trainer_state(data, plain({k: v for k, v in checkpoint.items() if k not in MODEL_KEYS}))
        meta.update(index=merged, world_size=C.get_world_size(), strategy=strategy_name,
                    accumulate_grad_batches=accumulate,
                    files=[rank_file(r) for r in range(C.get_world_size())],
                    versions=_versions())
        commit(root, final, meta, data.name)
    C.barrier(tag="checkpoint")


def save_dcp(engine: Any, checkpoint: dict[str, Any], filepath: Any, strategy_name: str, accumulate: int = 1) -> None:
    """``state_dict_type="dcp"``: the pieces through ``torch.distributed.checkpoint`` into a new folder beside
    ``filepath``, the rest of the checkpoint in its ``meta.pt`` (rank 0), then the folder swapped into place. A save
    that dies midway leaves only the hidden ``.tmp-`` folder. Collective."""
    final = Path(filepath)
    suffix = C.broadcast_object(uuid.uuid4().hex[:8] if C.get_rank() == 0 else None, tag="checkpoint")
    tmp = final.parent / f".{final.name}.tmp-{suffix}"
    if C.get_rank() == 0:
        tmp.mkdir(parents=True, exist_ok=False)
    C.barrier(tag="checkpoint")
    pieces, index, meta = collect_pieces(engine)
    tensors, objects = dcp.from_pieces(pieces, index, meta, C.get_rank() == 0)
    dcp.save(tmp, tensors, objects)  # collective; its .metadata is written last
    if C.get_rank() == 0:
        rest = plain({k: v for k, v in checkpoint.items() if k not in MODEL_KEYS})
        rest[dcp.OWN_META] = {"world_size": C.get_world_size(), "accumulate_grad_batches": accumulate,
                              "strategy": strategy_name, "versions": _versions()}
        torch.save(rest, tmp / dcp.META_PT)
        old = final.parent / f".{final.name}.old-{suffix}"
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            import shutil

            shutil.rmtree(old) if old.is_dir() else old.unlink()
    C.barrier(tag="checkpoint")


def open_reader(path: Any, module: Any = None) -> Any:
    """The reader of a checkpoint directory: ours (``meta.json``) or DCP's (``.metadata``); ``module`` names the
    parameters and their tied aliases for a DCP directory."""
    if dcp.is_dcp_checkpoint(path):
        aliases = None
        if module is not None:
            aliases = {names[0]: names for names in param_aliases(module).values()}
        return dcp.DCPReader(path, aliases)
    return Reader(path)


def _versions() -> dict[str, str]:
    """What wrote a checkpoint, recorded in it."""
    from .. import __version__

    return {"torch": str(torch.__version__), "lightning_shard": __version__}


def load_for_strategy(path: Any, module: Any = None) -> tuple[dict[str, Any], Optional[Reader]]:
    """(checkpoint dict, reader) for a sharded or DCP directory; (None, None) for a regular file."""
    p = Path(path)
    if p.is_dir():
        reader = open_reader(p, module)  # raises CheckpointError for folders that are not complete checkpoints
        ckpt = reader.trainer_state()
        ckpt["state_dict"] = {}
        ckpt["optimizer_states"] = [{} for _ in reader.meta["optimizers"]]
        return ckpt, reader
    return None, None


def full_model_state(reader: Reader) -> dict[str, torch.Tensor]:
    return model_state(reader, prefer_master=True)


class ShardedWeights(dict):
    """What ``checkpoint["state_dict"]`` and ``checkpoint["optimizer_states"][i]`` hold while Lightning builds a
    checkpoint in ``state_dict_type="sharded"`` mode: the weights are not gathered, each rank writes its own
    shards. Reading it (in an ``on_save_checkpoint`` hook) raises instead of silently giving nothing."""

    _MSG = ("lightning_shard: with state_dict_type='sharded' the checkpoint's weights are not gathered into the "
            "checkpoint dict; each rank writes its shards when the checkpoint is saved. For full weights call "
            "trainer.strategy.full_state_dict() (collective: on every rank), or use state_dict_type='full'.")

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(self._MSG)

    __getitem__ = __iter__ = __len__ = __contains__ = keys = values = items = get = _refuse
    __setitem__ = update = pop = _refuse

    def __repr__(self) -> str:
        return "ShardedWeights(<written per rank by save_checkpoint>)"

    def __reduce__(self) -> Any:
        return (dict, ())  # pickles as an empty dict: nothing of it is ever written


def _called_by_checkpoint_dump() -> bool:
    """True inside Lightning's ``_CheckpointConnector.dump_checkpoint`` (which calls us on every rank)."""
    import sys

    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code.co_name == "dump_checkpoint" and "checkpoint_connector" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def model_shapes(module: Any, engine: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``module``'s state dict with its full shape (stage 3 parameters hold no elements between
    steps: their shape comes from the engine's layout)."""
    full: dict[int, tuple[int, ...]] = {}
    if engine is not None:
        for b in engine.buckets:
            for p, slot in zip(b.params, b.layout.slots):
                full[id(p)] = tuple(slot.shape)
    return {k: full.get(id(t), tuple(t.shape)) for k, t in module.state_dict(keep_vars=True).items()
            if torch.is_tensor(t)}


def checkpoint_shapes(reader: Any) -> dict[str, tuple[int, ...]]:
    """Full shape of every module tensor a checkpoint directory holds, under each name of a tied weight."""
    there = {k: tuple(v) for k, v in reader.shapes.items()}
    for first, names in reader.meta.get("aliases", {}).items():
        for n in names:
            if first in there:
                there[n] = there[first]
    return there


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
        if is_sharded_checkpoint(path) or dcp.is_dcp_checkpoint(path):
            reader = open_reader(path)
            ckpt = lightning_checkpoint(reader)
            if self.world_size and self.accumulate_grad_batches:
                translate_loop_counters(ckpt, reader.meta, self.world_size, self.accumulate_grad_batches)
            return ckpt
        if Path(path).is_dir():
            Reader(path)  # raises the explanatory error
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)  # never unpickle code

    def remove_checkpoint(self, path: Any) -> None:
        p = Path(path)
        if p.is_dir():
            import shutil

            shutil.rmtree(p)
        else:
            super().remove_checkpoint(path)


class CheckpointMixin:
    """Checkpoint methods of the lightning_shard strategies (mixed into ZeroStrategy)."""

    engine: Any
    state_dict_type: str
    _reader: Optional[Reader]

    def _sharded(self) -> bool:
        return self.state_dict_type in ("sharded", "dcp") and self.engine is not None and not self._released()

    def _released(self) -> bool:
        return self.engine is not None and self.engine.controller is not None and self.engine.controller.released

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
        """Full weights, as the module's ``state_dict()`` names them (collective: every rank must call it; fp32
        masters for half-precision parameters). Lightning's own checkpoint save in ``"sharded"`` mode gets a
        :class:`ShardedWeights` placeholder instead, since ``save_checkpoint`` writes each rank's shards itself."""
        if self._sharded() and _called_by_checkpoint_dump():
            return ShardedWeights()
        return self.full_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Torch's per-parameter optimizer state, gathered (collective), except inside Lightning's sharded save."""
        if self.engine is None:
            return optimizer.state_dict()
        if self._sharded() and _called_by_checkpoint_dump():
            return ShardedWeights()
        return self.engine.binding_for(getattr(optimizer, "_optimizer", optimizer)).full_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not self._sharded():
            if Path(filepath).is_dir():  # Lightning would leave a temp file inside it and the folder unreadable
                raise CheckpointError(f"{filepath} is a sharded checkpoint folder; a full checkpoint file cannot "
                                      "replace it. Save to another path (after fit the module is whole and saves "
                                      "as one file), or save during fit to keep the sharded format.")
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        trainer = getattr(self.lightning_module, "_trainer", None)
        save = save_dcp if self.state_dict_type == "dcp" else save_sharded
        save(self.engine, checkpoint, filepath, type(self).strategy_name,
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
        self._ckpt_path = checkpoint_path
        ckpt, self._reader = load_for_strategy(checkpoint_path, self.lightning_module)
        if ckpt is not None:
            trainer = getattr(self.lightning_module, "_trainer", None)
            translate_loop_counters(ckpt, self._reader.meta, self.world_size,
                                    getattr(trainer, "accumulate_grad_batches", 1))
            return ckpt
        # weights_only=True whatever the caller asks: a checkpoint is data, never code to run (torch.load with
        # weights_only=False executes arbitrary pickles). Own classes in hparams: torch.serialization.add_safe_globals
        return super().load_checkpoint(checkpoint_path, weights_only=True)

    def _check_fits(self, checkpoint: Any, strict: bool) -> None:
        """Refuse a checkpoint of another model before anything is loaded, naming the differences (rank 0: the
        other ranks raise too, with a one-line pointer, so the cause is printed once)."""
        if self._reader is not None:
            there = checkpoint_shapes(self._reader)
            where = str(self._reader.path)
        else:
            there = {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items() if torch.is_tensor(v)}
            where = str(getattr(self, "_ckpt_path", "the checkpoint"))
        problem = model_mismatch(model_shapes(self.lightning_module, self.engine), there, strict=strict)
        if problem is None:
            return
        if C.get_rank() == 0:
            raise CheckpointError(f"checkpoint {where} is for another model: {problem}")
        raise CheckpointError(f"checkpoint {where} does not fit this model (rank 0's error names the differences)")

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        module = self.lightning_module
        self._check_fits(checkpoint, strict)
        param_names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        if self._reader is not None:
            if self.engine is None or self.engine.controller is None:  # stages 0-2: the module takes full weights
                state = full_model_state(self._reader)
            else:  # after setup (stage 3): each rank reads the ranges of its own shards
                from .pieces import load_pieces

                load_pieces(self.engine, self._reader, params=True, optimizer=False)
                state = {k: v for k, v in model_state(self._reader).items() if k not in param_names}
                module.load_state_dict(state, strict=False)
                return
        else:
            state = checkpoint["state_dict"]
            if self.engine is not None and self.engine.controller is not None:  # stage 3, full file
                missing = self.engine.load_full(state)
                result = module.load_state_dict({k: v for k, v in state.items() if k not in param_names}, strict=False)
                problems = missing + [k for k in result.missing_keys if k not in param_names] + result.unexpected_keys
                if strict and problems:
                    raise CheckpointError(f"checkpoint does not match the model: {problems[:10]} missing or unexpected;"
                                          " was it written for another model?")
                return
        module.load_state_dict(state, strict=strict)
        if self.precision_plugin.precision in ("bf16-true", "16-true"):
            masters = {n: v for n, v in state.items() if n in param_names and v.dtype == torch.float32}
            if self.engine is not None:
                self.engine.load_full(masters, masters_only=True)
            else:
                self._masters_from_checkpoint = masters

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        from lightning.fabric.utilities.optimizer import _optimizer_to_device

        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise CheckpointError(f"checkpoint holds {len(states)} optimizer states, the model configured "
                                  f"{len(self.optimizers)} optimizers")
        if self._reader is not None and self.engine is not None:
            from .pieces import load_pieces

            load_pieces(self.engine, self._reader, params=False, optimizer=True)
            self._reader = None
            return
        for optimizer, state in zip(self.optimizers, states):
            if self.engine is None:
                optimizer.load_state_dict(state)
            else:
                self.engine.binding_for(optimizer).load_full_state_dict(state)
            # offload_optimizer: the state stays in host memory beside the fp32 master shards it updates
            _optimizer_to_device(optimizer, torch.device("cpu") if getattr(self, "offload_optimizer", False)
                                 else self.root_device)


__all__ = ["CheckpointError", "CheckpointMixin", "ShardedCheckpointIO", "ShardedWeights", "load_for_strategy",
           "open_reader", "save_dcp", "save_sharded"]
