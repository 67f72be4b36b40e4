"""Checkpoints in ``torch.distributed.checkpoint`` (DCP) format, from and into the engine's pieces.

A rank's piece of a parameter is a range ``[lo, hi)`` of its flattened elements. DCP describes a tensor's saved
parts as n-dimensional boxes (offsets and sizes per dimension) of the full shape, so each range is cut into the
boxes it covers (:func:`boxes`: a partial first row, whole rows, a partial last row, recursively; each box is
contiguous in the flat layout) and written as one ``SHARD`` item per box. The metadata then holds the full shapes
and every chunk, which is what DCP's own tools need: ``format_utils.dcp_to_torch_save`` consolidates the directory,
and any DCP loader (FSDP2, Lightning's ``ModelParallelStrategy`` / ``FSDPStrategy``) reads it, re-cut to its own
layout by DCP's resharding. Reading goes the other way: :class:`DCPReader` answers ``read(key, lo, hi)`` with a
DCP load of exactly those elements (``no_dist``: each rank reads on its own), behind the interface of
:class:`.checkpoint.Reader`, so everything that loads our directories loads DCP ones.

Keys follow Lightning's ``ModelParallelStrategy``: ``state_dict.<name>`` (module state; fp32 masters where the run
kept them), ``optimizer_<i>.state.<name>.<key>`` and ``optimizer_<i>.param_groups`` (torch's FQN-keyed optimizer
format, ``torch.distributed.checkpoint.state_dict``); Lightning's ``FSDPStrategy`` writes ``model.<name>`` instead,
which the reader accepts too. The rest of the checkpoint (loops, callbacks, hparams) is ``meta.pt``, as Lightning
writes it.
"""

from __future__ import annotations

import io
import math
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .format import CheckpointError, KeyedReader

META_PT = "meta.pt"  # Lightning's name for the non-tensor rest of a DCP checkpoint
OWN_META = "lightning_shard"  # our entry in meta.pt: the saving job's world size, accumulation, strategy
DCP_METADATA = ".metadata"
MODEL_PREFIXES = ("state_dict.", "model.")  # ModelParallelStrategy / ours, FSDPStrategy


def is_dcp_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a ``torch.distributed.checkpoint`` directory (it holds DCP's metadata file)."""
    return Path(path).is_dir() and (Path(path) / DCP_METADATA).is_file()


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat range ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes ``(offsets, sizes, flat_start)``, in
    order; each box is contiguous in the flat layout, and together they cover the range exactly."""
    if hi <= lo:
        return []
    if len(shape) == 0:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((lo,), (hi - lo,), lo)]
    row = math.prod(shape[1:])
    first, last = lo // row, (hi - 1) // row
    if first == last:  # inside one row
        return [((first, *o), (1, *s), first * row + f) for o, s, f in boxes(shape[1:], lo - first * row,
                                                                              hi - first * row)]
    out = []
    start = first
    if lo % row:  # the partial first row
        out += [((first, *o), (1, *s), first * row + f) for o, s, f in boxes(shape[1:], lo % row, row)]
        start = first + 1
    end = last + 1 if hi % row == 0 else last
    if end > start:  # whole rows
        out.append(((start, *([0] * (len(shape) - 1))), (end - start, *shape[1:]), start * row))
    if hi % row:  # the partial last row
        out += [((last, *o), (1, *s), last * row + f) for o, s, f in boxes(shape[1:], 0, hi % row)]
    return out


class _PieceSavePlanner(DefaultSavePlanner):
    """Writes this rank's ranges as box chunks of the full tensors, and picklable objects as bytes; DCP's global
    plan (metadata from every rank's chunks, the check that they tile each tensor) is the default one."""

    def __init__(self, tensors: dict[str, tuple[tuple[int, ...], int, torch.Tensor]], objects: dict[str, Any]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.tensors, self.objects = tensors, objects
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, (shape, lo, flat) in self.tensors.items():
            props = TensorProperties.create_from_tensor(flat)
            for offsets, sizes, start in boxes(shape, lo, lo + flat.numel()) if shape else [((), (), 0)]:
                view = flat.reshape(()) if not shape else flat[start - lo:start - lo + math.prod(sizes)].view(sizes)
                self._views[(fqn, offsets)] = view
                items.append(WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)),
                                       type=WriteItemType.SHARD if shape else WriteItemType.TENSOR,
                                       tensor_data=TensorWriteData(
                                           chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                           properties=props, size=torch.Size(shape))))
        items += [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.objects[write_item.index.fqn], buf)
            buf.seek(0)
            return buf
        return self._views[(write_item.index.fqn, tuple(write_item.index.offset))]


def from_pieces(pieces: dict[str, torch.Tensor], index: dict[str, list], meta: dict[str, Any],
                first_rank: bool) -> tuple[dict[str, tuple[tuple[int, ...], int, torch.Tensor]], dict[str, Any]]:
    """This rank's pieces (``pieces.collect_pieces``) as DCP ranges under the module's and torch's
    optimizer names: the fp32 master where the run kept one, every alias of a tied weight; ``first_rank``: the
    rank that adds the optimizers' param groups (torch's format: parameter names in ``params``)."""
    shapes, aliases = meta["shapes"], meta.get("aliases", {})
    tensors: dict[str, tuple[tuple[int, ...], int, torch.Tensor]] = {}
    for key, t in pieces.items():
        kind, rest = key.split("/", 1)
        lo = index[key][0]
        if kind in ("param", "master"):
            if kind == "param" and f"master/{rest}" in pieces:
                continue  # the fp32 master stands for the parameter
            for name in aliases.get(rest, [rest]):
                tensors[f"state_dict.{name}"] = (tuple(shapes[rest]), lo, t.reshape(-1))
        elif kind == "buffer":
            tensors[f"state_dict.{rest}"] = (tuple(shapes[rest]), 0, t.reshape(-1) if t.dim() else t)
        elif kind == "optim":
            oi, name, state_key = rest.split("/")
            shape = tuple(shapes[name]) if t.dim() else ()
            tensors[f"optimizer_{oi}.state.{name}.{state_key}"] = (shape, lo, t.reshape(-1) if t.dim() else t)
    objects = {}
    if first_rank:  # as DCP flattens torch's optimizer state dict: one item per group and hyperparameter
        for oi, opt in enumerate(meta["optimizers"]):
            for gi, g in enumerate(opt["groups"]):
                for k, v in g.items():
                    objects[f"optimizer_{oi}.param_groups.{gi}.{'params' if k == 'param_names' else k}"] = \
                        list(v) if k == "param_names" else v
    return tensors, objects


def save(path: Any, tensors: dict[str, tuple[tuple[int, ...], int, torch.Tensor]], objects: dict[str, Any]) -> None:
    """Collective: every rank passes its ranges ``fqn -> (full shape, flat lo, flat tensor)``; together they must
    tile every tensor (DCP checks it). ``objects``: pickled as bytes items (pass them on one rank only)."""
    dcp.save({}, checkpoint_id=str(path), planner=_PieceSavePlanner(tensors, objects))


class _RangeLoadPlanner(DefaultLoadPlanner):
    """Reads ``fqn -> (flat lo, destination flat tensor)`` ranges (boxes of the saved full tensors) and bytes."""

    def __init__(self, wants: dict[str, tuple[int, torch.Tensor]], objects: list[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.wants, self.objects, self.loaded = wants, objects, {}
        self._dest: dict[str, list[torch.Tensor]] = {}

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        reads = []
        for fqn, (lo, dest) in self.wants.items():
            md = self.metadata.state_dict_metadata[fqn]
            shape = tuple(md.size)
            bx = boxes(shape, lo, lo + dest.numel()) if shape else [((), (), 0)]
            self._dest[fqn] = [dest.reshape(()) if not shape else dest[f - lo:f - lo + math.prod(s)].view(s)
                               for _, s, f in bx]
            reads += create_read_items_for_chunk_list(
                fqn, md, [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in bx])
        for key in self.objects:
            reads.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                  dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(key),
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(reads)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.loaded[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self._dest[read_item.dest_index.fqn][read_item.dest_index.index]
        for dim, (off, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, off, n)
        return t


class _OnceReader(dcp.FileSystemReader):
    """A DCP file-system reader that reads and unpickles the ``.metadata`` file once: :class:`DCPReader` issues one
    DCP load per tensor range, and each load asks for the metadata again (for many tensors x many ranks' chunks,
    the same file unpickled hundreds of times)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.metadata_reads = 0
        self._metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._metadata is None:
            self.metadata_reads += 1
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class DCPReader(KeyedReader):
    """:class:`.checkpoint.Reader`'s interface over a DCP directory (ours, FSDP2's, Lightning's). Keys as the
    reader's: ``param/<name>``, ``buffer/<name>`` (``param_names``: which module tensors are parameters; without it
    every module tensor counts as a parameter), ``optim/<i>/<name>/<key>``. Each read is a DCP load of those elements
    by this rank alone."""

    def __init__(self, path: Any, aliases: Optional[dict[str, list[str]]] = None) -> None:
        """``aliases``: the module's parameters, ``first name -> every name`` (tied weights); given, the other names
        of a tied weight are aliases (as in our own format) and module tensors that are no parameter are buffers."""
        self.path = Path(path)
        if not is_dcp_checkpoint(self.path):
            raise CheckpointError(f"{self.path} is not a torch.distributed.checkpoint directory (no {DCP_METADATA})")
        self._fs = _OnceReader(str(self.path))
        md = self._fs.read_metadata().state_dict_metadata
        prefix = next((p for p in MODEL_PREFIXES if any(k.startswith(p) for k in md)), None)
        if prefix is None:
            raise CheckpointError(f"{self.path}: a DCP checkpoint without module state (no key starts with "
                                  f"{' or '.join(MODEL_PREFIXES)}; keys look like {sorted(md)[:3]})")
        self._md, self._table = md, {}
        self.shapes: dict[str, list[int]] = {}
        second = {n: first for first, names in (aliases or {}).items() for n in names if n != first}
        found_aliases: dict[str, list[str]] = {}
        n_opt = 0
        for fqn, m in md.items():
            if fqn.startswith(prefix) and isinstance(m, TensorStorageMetadata):
                name = fqn[len(prefix):]
                self.shapes[name] = list(m.size)
                if name in second:  # written under each name of the tied weight: read it under the first
                    found_aliases.setdefault(second[name], [second[name]]).append(name)
                    continue
                kind = "param" if aliases is None or name in aliases else "buffer"
                self._table[f"{kind}/{name}"] = fqn
            elif fqn.startswith("optimizer_") and ".state." in fqn and isinstance(m, TensorStorageMetadata):
                head, rest = fqn.split(".state.", 1)
                oi = int(head[len("optimizer_"):])
                name, key = rest.rsplit(".", 1)
                self._table[f"optim/{oi}/{name}/{key}"] = fqn
                n_opt = max(n_opt, oi + 1)
        # param groups: flattened by DCP into optimizer_<i>.param_groups.<g>.<key> (or one item, unflattened)
        group_keys = [k for k in md if k.startswith("optimizer_") and ".param_groups" in k]
        values = self._objects([k for k in group_keys if isinstance(md[k], BytesStorageMetadata)])
        for k in group_keys:
            if isinstance(md[k], TensorStorageMetadata):  # a hyperparameter saved as a tensor
                values[k] = self._read_fqn(k, 0, None)
        self.meta: dict[str, Any] = {"shapes": self.shapes, "aliases": found_aliases, "optimizers": []}
        self.meta.update(self.trainer_state().get(OWN_META, {}))  # world size and accumulation of the saving job
        for i in range(max([n_opt] + [int(k.split(".")[0][len("optimizer_"):]) + 1 for k in group_keys])):
            groups: dict[int, dict[str, Any]] = {}
            whole = values.get(f"optimizer_{i}.param_groups")
            for gi, g in enumerate(whole or []):
                groups[gi] = dict(g)
            head = f"optimizer_{i}.param_groups."
            for k, v in values.items():
                if k.startswith(head):
                    gi, key = k[len(head):].split(".", 1)
                    groups.setdefault(int(gi), {})[key] = v
            self.meta["optimizers"].append({"class": None, "groups": [
                {**{k: v for k, v in g.items() if k != "params"}, "param_names": list(g.get("params", []))}
                for _, g in sorted(groups.items())]})

    def _objects(self, keys: list[str]) -> dict[str, Any]:
        if not keys:
            return {}
        planner = _RangeLoadPlanner({}, keys)
        self._load(planner)
        return planner.loaded

    def _load(self, planner: "_RangeLoadPlanner") -> None:
        with warnings.catch_warnings():  # no_dist on purpose: this rank reads its own ranges, nobody else's
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load({}, storage_reader=self._fs, planner=planner, no_dist=True)

    def read(self, key: str, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        return self._read_fqn(self._where(key), lo, hi)

    def _read_fqn(self, fqn: str, lo: int, hi: Optional[int]) -> torch.Tensor:
        md = self._md[fqn]
        numel = math.prod(md.size)
        if len(md.size) == 0:
            dest = torch.empty((), dtype=md.properties.dtype)
            self._load(_RangeLoadPlanner({fqn: (0, dest)}, []))
            return dest
        hi = numel if hi is None else hi
        dest = torch.empty(hi - lo, dtype=md.properties.dtype)
        self._load(_RangeLoadPlanner({fqn: (lo, dest)}, []))
        return dest

    def full(self, key: str) -> torch.Tensor:
        t = self.read(key)
        shape = self.shapes.get(key.split("/", 1)[1])
        return t.view(shape) if shape is not None and t.dim() == 1 else t

    def trainer_state(self) -> dict[str, Any]:
        path = self.path / META_PT
        if not path.is_file():
            return {}
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"{path} cannot be loaded safely with weights_only=True ({type(err).__name__}: "
                                  f"{err})") from err


__all__ = ["DCP_METADATA", "META_PT", "OWN_META", "DCPReader", "boxes", "from_pieces", "is_dcp_checkpoint", "save"]
