"""Writing and reading a checkpoint for the strategies: the one implementation that both hosts call, the Trainer's
(``CheckpointMixin`` in ``checkpoint/io.py``, mixed into ``strategies/zero.py``) and Fabric's
(``strategies/fabric.py``). A change to how a checkpoint is written or read is made here.

``state_dict_type``:

- ``"sharded"`` (default): a directory (``checkpoint/format.py``) in which each rank writes only its own pieces,
  committed atomically (:func:`save_sharded`);
- ``"dcp"``: a ``torch.distributed.checkpoint`` directory, the same pieces as chunks of the full tensors
  (``checkpoint/dcp.py``, :func:`save_dcp`);
- ``"full"``: one file, written by the host's own code (Lightning's or Fabric's) from the gathered weights.

Loading takes any of them, from any strategy at any world size (also a DCP directory of Lightning's
``ModelParallelStrategy`` / FSDP2, and full files of Lightning's ``DDPStrategy`` or a single device):
:func:`open_directory` gives the reader of a directory (a full file is the host's to read), then
:func:`load_model` and :func:`load_optimizers` restore from that reader or from full tensors.

What each host keeps: the shape of what it hands over and returns (Lightning's checkpoint dict with
``state_dict`` / ``optimizer_states``; Fabric's state of named objects), reading and writing full files, the
Trainer's loop counters and its fp32 masters kept until ``setup`` builds the engine.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

import torch

from ..engine.comm import collectives as C
from ..engine.state_dict import param_aliases
from . import dcp
from .consolidate import model_state
from .format import (
    CheckpointError,
    Reader,
    commit,
    data_dir_for,
    model_mismatch,
    rank_file,
    write_rank_file,
    write_trainer_state,
)
from .pieces import collect_pieces, load_pieces

# the entries of a Lightning checkpoint dict that the pieces replace (each rank writes its own)
MODEL_KEYS = ("state_dict", "optimizer_states")


# ---------------------------------------------------------------------------------------------------- save
def released(engine: Any) -> bool:
    """Stage 3 after ``release_to_module()``: the module holds full parameters again, the engine no shards."""
    return engine is not None and engine.controller is not None and engine.controller.released


def writes_pieces(state_dict_type: str, engine: Any) -> bool:
    """Whether a save writes each rank's pieces (``"sharded"``, ``"dcp"``) rather than one full file: only while
    an engine holds the shards (before set-up and after fit the module is whole, and saves as one file)."""
    return state_dict_type in ("sharded", "dcp") and engine is not None and not released(engine)


def refuse_file_over_folder(path: Any, advice: str = "") -> None:
    """A full (one-file) save must not target a checkpoint folder: it would leave a file inside it and the folder
    unreadable."""
    if Path(path).is_dir():
        raise CheckpointError(f"{path} is a sharded checkpoint folder; a full checkpoint file cannot replace it"
                              + (f". {advice}" if advice else ""))


def save(engine: Any, state_dict_type: str, checkpoint: dict[str, Any], path: Any, strategy_name: str,
         accumulate: int = 1) -> None:
    """Write ``checkpoint`` (its entries besides :data:`MODEL_KEYS`) and the engine's pieces to ``path`` in the
    ``state_dict_type`` format (``"sharded"`` or ``"dcp"``). Collective."""
    writer = save_dcp if state_dict_type == "dcp" else save_sharded
    writer(engine, checkpoint, path, strategy_name, accumulate)


def plain(obj: Any) -> Any:
    """Containers as plain dict/list/tuple so that ``torch.load(weights_only=True)`` accepts them."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj) if type(obj) in (list, tuple) else [plain(v) for v in obj]
    return obj


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
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    C.barrier(tag="checkpoint")


def _versions() -> dict[str, str]:
    """What wrote a checkpoint, recorded in it."""
    from ..version import __version__

    return {"torch": str(torch.__version__), "lightning_shard": __version__}


# ---------------------------------------------------------------------------------------------------- load
def open_reader(path: Any, module: Any = None) -> Any:
    """The reader of a checkpoint directory: ours (``meta.json``) or DCP's (``.metadata``); ``module`` names the
    parameters and their tied aliases for a DCP directory."""
    if dcp.is_dcp_checkpoint(path):
        aliases = None
        if module is not None:
            aliases = {names[0]: names for names in param_aliases(module).values()}
        return dcp.DCPReader(path, aliases)
    return Reader(path)


def open_directory(path: Any, module: Any = None) -> Optional[Any]:
    """The reader of a checkpoint directory, or None when ``path`` is not a directory (a full file, which the host
    reads). A directory that is not a complete checkpoint raises :class:`CheckpointError` naming the problem."""
    return open_reader(path, module) if Path(path).is_dir() else None


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


def check_fits(module: Any, engine: Any, there: dict[str, tuple[int, ...]], where: Any, strict: bool) -> None:
    """Refuse a checkpoint of another model before anything is loaded, naming the differences (rank 0: the
    other ranks raise too, with a one-line pointer, so the cause is printed once)."""
    problem = model_mismatch(model_shapes(module, engine), there, strict=strict)
    if problem is None:
        return
    if C.get_rank() == 0:
        raise CheckpointError(f"{_named(where)} is for another model: {problem}")
    raise CheckpointError(f"{_named(where)} does not fit this model (rank 0's error names the differences)")


def _named(where: Any) -> str:
    """How errors name the checkpoint: its path, or "the state dict" for tensors handed over in memory."""
    return "the state dict" if where is None else f"checkpoint {where}"


def load_model(module: Any, engine: Any, strict: bool, where: Any, reader: Any = None,
               weights: Optional[dict[str, torch.Tensor]] = None) -> Optional[dict[str, torch.Tensor]]:
    """Restore ``module``'s weights from ``reader`` (a checkpoint directory) or ``weights`` (full tensors by name),
    after checking that they fit it (``where``: the checkpoint's path for errors; None for tensors in memory).

    Stage 3 (``engine.controller``): the parameters go into this rank's shards, fp32 masters included (from a
    directory each rank reads only its own ranges), buffers into the module; returns None. Otherwise the module
    takes the full weights (the fp32 masters where the checkpoint has them) and the fp32 values of its parameters
    are returned: the host makes them the engine's fp32 masters (``engine.load_full(..., masters_only=True)``) or
    keeps them until its engine is built, so that their precision survives a resume in half precision."""
    there = checkpoint_shapes(reader) if reader is not None else \
        {k: tuple(v.shape) for k, v in weights.items() if torch.is_tensor(v)}
    check_fits(module, engine, there, where, strict)
    param_names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    if engine is not None and engine.controller is not None:
        if reader is not None:
            load_pieces(engine, reader, params=True, optimizer=False)
            rest = {k: v for k, v in model_state(reader).items() if k not in param_names}
            module.load_state_dict(rest, strict=False)
            return None
        missing = engine.load_full(weights)
        result = module.load_state_dict({k: v for k, v in weights.items() if k not in param_names}, strict=False)
        problems = missing + [k for k in result.missing_keys if k not in param_names] + result.unexpected_keys
        if strict and problems:
            raise CheckpointError(f"checkpoint does not match the model: {problems[:10]} missing or unexpected; "
                                  "was it written for another model?")
        return None
    state = model_state(reader, prefer_master=True) if reader is not None else weights
    if engine is not None:
        engine.wait_params()  # a post-step all-gather may still be writing the parameters
    module.load_state_dict(state, strict=strict)
    return {n: v for n, v in state.items() if n in param_names and v.dtype == torch.float32}


def load_optimizers(engine: Any, optimizers: list[Any], where: Any, reader: Any = None,
                    states: Optional[list[dict[str, Any]]] = None) -> None:
    """Restore the optimizers' state from ``reader`` (each rank reads the ranges of its own shards; needs the
    engine) or from ``states`` (torch's full per-parameter format, one per optimizer, in order)."""
    saved = len(reader.meta["optimizers"]) if reader is not None else len(states)
    if saved != len(optimizers):
        raise CheckpointError(f"{_named(where)} holds {saved} optimizer state(s), {len(optimizers)} "
                              "optimizer(s) are set up to take them")
    if reader is not None:
        load_pieces(engine, reader, params=False, optimizer=True)
        return
    for optimizer, state in zip(optimizers, states):
        if engine is None:
            optimizer.load_state_dict(state)
        else:
            engine.binding_for(optimizer).load_full_state_dict(state)


__all__ = ["MODEL_KEYS", "check_fits", "checkpoint_shapes", "load_model", "load_optimizers", "model_shapes",
           "open_directory", "open_reader", "plain", "refuse_file_over_folder", "released", "save", "save_dcp",
           "save_sharded", "writes_pieces"]
