"""Sharded checkpoint format: per-rank files of named 1-D pieces, an index, and an atomic commit.

Layout of a checkpoint directory::

    meta.json            format, version, world size, strategy, names/shapes/dtypes, the piece index,
                         optimizer param groups, and ``data``: the folder below that holds this version;
                         written last: its presence means "complete"
    data-<id>/rank00000.pt ...  torch.save({key: 1-D tensor}) of the pieces this rank owns
    data-<id>/trainer_state.pt  everything else of the Lightning checkpoint (loops, callbacks, schedulers, hparams)

A piece is a contiguous range ``[lo, hi)`` of one flattened tensor, keyed ``param/<name>``,
``master/<name>`` (fp32 masters), ``optim/<opt>/<name>/<state key>`` or ``buffer/<name>``. Pieces are
stored by parameter name, not by bucket, so any strategy at any world size can read them: a rank asks for
the ranges its own layout needs and the reader stitches them from whichever files hold them.

Why not ``torch.distributed.checkpoint``: its resharding works on DTensor/ShardedTensor layouts with
regular placements; our shards are flat slices across several parameters with strategy-specific padding,
which DCP could only express through the deprecated ShardedTensor API. Plain per-rank files with an index
load with ``torch.load(weights_only=True)`` and reshard by range intersection.

Atomicity: a new checkpoint is written into ``<path>.tmp-<id>``; after every rank's file is fsync'd (barrier),
rank 0 writes ``meta.json`` and renames the directory to ``<path>``. A crash leaves only a ``.tmp-`` folder,
which is never read; a directory without ``meta.json`` is refused with a clear error. Overwriting a checkpoint
(``last.ckpt`` at every save) never takes ``<path>`` away: the new version is written into ``<path>/data-<id>``
and ``meta.json`` is replaced atomically (``os.replace``) to point at it, so at every instant ``<path>`` is one
complete version, the old or the new; the old folder is deleted afterwards (or by the next save, after a crash).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

FORMAT = "lightning_shard.sharded"
VERSION = 2  # 2: the pieces live in the folder meta["data"] names (1: next to meta.json; still read)
META = "meta.json"
TRAINER_STATE = "trainer_state.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the path and the problem."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def is_sharded_checkpoint(path: Any) -> bool:
    return Path(path).is_dir() and (Path(path) / META).is_file()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_rank_file(data_dir: Path, rank: int, pieces: dict[str, torch.Tensor]) -> None:
    path = data_dir / rank_file(rank)
    torch.save({k: v.detach().contiguous().cpu().clone() for k, v in pieces.items()}, path)
    _fsync_file(path)


def write_trainer_state(data_dir: Path, state: dict[str, Any]) -> None:
    path = data_dir / TRAINER_STATE
    torch.save(state, path)
    _fsync_file(path)


def data_dir_for(final: Path, tag: str) -> tuple[Path, Path]:
    """(folder the ranks write into, folder that becomes ``final``) for a save with id ``tag``.

    Overwriting a complete checkpoint writes a new version inside it; otherwise a ``.tmp-`` folder is renamed
    into place at the commit. Every rank computes the same answer (rank 0 creates the folder before the others
    look, behind a barrier)."""
    if is_sharded_checkpoint(final):
        return final / f"data-{tag}", final
    tmp = final.with_name(f"{final.name}.tmp-{tag}")
    return tmp / f"data-{tag}", tmp


def commit(root: Path, final: Path, meta: dict[str, Any], data: str) -> None:
    """Rank 0, after every rank wrote its file into ``root / data``: point ``meta.json`` at it atomically.

    ``root`` is ``final`` itself (overwrite: ``meta.json`` is swapped with ``os.replace``, then the previous
    version's folder goes) or a ``.tmp-`` folder renamed to ``final`` (a new checkpoint)."""
    meta = dict(meta, format=FORMAT, version=VERSION, complete=True, data=data)
    staged = root / f"{META}.tmp-{data}"
    with open(staged, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staged, root / META)  # atomic: readers see the old index or the new one, never neither
    if root != final:
        if final.exists():  # a file (full format) or an incomplete folder with the same name: move it aside
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
            os.replace(final, old)
            os.replace(root, final)
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
        else:
            os.replace(root, final)
    remove_stale_versions(final)
    for sibling in final.parent.glob(f"{glob.escape(final.name)}.tmp-*"):  # fresh saves that crashed earlier
        shutil.rmtree(sibling, ignore_errors=True)


def remove_stale_versions(path: Path) -> None:
    """Delete what a committed checkpoint folder holds besides its current version (earlier versions, the
    leftovers of a save that crashed, version-1 files next to meta.json)."""
    try:
        current = json.loads((path / META).read_text()).get("data")
    except (OSError, json.JSONDecodeError):
        return
    if not current:
        return
    for child in path.iterdir():
        if child.name in (META, current):
            continue
        if child.is_dir() and child.name.startswith("data-"):
            shutil.rmtree(child, ignore_errors=True)
        elif child.is_file() and (child.name.startswith(("rank", f"{META}.tmp-")) or child.name == TRAINER_STATE):
            child.unlink(missing_ok=True)


@dataclass
class Piece:
    rank: int
    lo: int
    hi: int


class KeyedReader:
    """What every checkpoint reader answers from its table of keys (``_table``: key -> where its data is):
    ``has``, ``keys`` under a prefix, and the location of a key, or the error naming it."""

    path: Path
    _table: dict[str, Any]

    def has(self, key: str) -> bool:
        return key in self._table

    def keys(self, prefix: str) -> list[str]:
        return [k[len(prefix):] for k in self._table if k.startswith(prefix)]

    def _where(self, key: str) -> Any:
        if key not in self._table:
            raise CheckpointError(f"checkpoint {self.path} has no {key!r}")
        return self._table[key]


class Reader(KeyedReader):
    """Reads pieces back from a committed checkpoint directory, for any target layout."""

    def __init__(self, path: Any) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"checkpoint {self.path} does not exist")
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is a file, not a sharded checkpoint directory")
        meta_path = self.path / META
        if not meta_path.is_file():
            raise CheckpointError(
                f"{self.path} is not a complete lightning_shard checkpoint: it has no {META} (a save that did not "
                f"finish, e.g. a rank died while writing, or not a checkpoint folder at all)")
        try:
            self.meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{meta_path} is corrupted ({err})") from err
        if self.meta.get("format") != FORMAT or not self.meta.get("complete"):
            raise CheckpointError(f"{meta_path} is not a complete {FORMAT} index")
        if self.meta.get("version") not in (1, VERSION):
            raise CheckpointError(f"{self.path} has format version {self.meta.get('version')}; this lightning_shard "
                                  f"reads versions 1 to {VERSION}. Consolidate it with the version that wrote it.")
        self.data = self.path / self.meta.get("data", "")  # version 1: the files sit next to meta.json
        self.index: dict[str, list[Piece]] = {
            k: [Piece(*p) for p in pieces] for k, pieces in self.meta["index"].items()}
        self._table = self.index
        self.shapes: dict[str, list[int]] = self.meta["shapes"]
        self._files: dict[int, dict[str, torch.Tensor]] = {}

    def _file(self, rank: int) -> dict[str, torch.Tensor]:
        if rank not in self._files:
            path = self.data / rank_file(rank)
            if not path.is_file():
                raise CheckpointError(f"{path} is missing from checkpoint {self.path}")
            try:
                self._files[rank] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:  # truncated zip, bad pickle, refused global
                raise CheckpointError(f"{path} cannot be read safely ({type(err).__name__}: {err}); the file is "
                                      "truncated, corrupted or not written by lightning_shard") from err
        return self._files[rank]

    def read(self, key: str, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor ``key``, stitched from every file that holds part."""
        pieces = self._where(key)
        numel = max(p.hi for p in pieces)
        hi = numel if hi is None else hi
        out: Optional[torch.Tensor] = None
        covered = 0
        for p in pieces:
            a, b = max(lo, p.lo), min(hi, p.hi)
            if a >= b:
                continue
            data = self._file(p.rank)[key]
            if data.dim() == 0:  # scalars (optimizer step counters) are stored whole, indexed [0, 1)
                return data.clone()
            if out is None:
                out = torch.empty(hi - lo, dtype=data.dtype)
            out[a - lo:b - lo].copy_(data[a - p.lo:b - p.lo])
            covered += b - a
        if out is None or covered < hi - lo:
            raise CheckpointError(f"checkpoint {self.path}: elements [{lo}, {hi}) of {key!r} are not all present "
                                  f"({covered} of {hi - lo}); a rank file is missing or the index is corrupted")
        return out

    def full(self, key: str) -> torch.Tensor:
        shape = self.shapes.get(key.split("/", 1)[1] if key.startswith(("param/", "master/", "buffer/")) else key)
        t = self.read(key)
        return t.view(shape) if shape is not None and t.dim() == 1 else t

    def trainer_state(self) -> dict[str, Any]:
        path = self.data / TRAINER_STATE
        if not path.is_file():
            raise CheckpointError(f"{path} is missing from checkpoint {self.path}")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"{path} cannot be loaded safely with weights_only=True ({type(err).__name__}: "
                                  f"{err}). If it holds your own hyperparameter classes, register them with "
                                  "torch.serialization.add_safe_globals([...]).") from err


def model_mismatch(here: dict[str, tuple[int, ...]], there: dict[str, tuple[int, ...]], strict: bool = True,
                   limit: int = 5) -> Optional[str]:
    """What differs between a model's tensors (``name -> full shape``) and a checkpoint's, in words; None when
    the checkpoint fits. Shapes always count; missing and unexpected names only with ``strict``."""
    shape = [k for k in here if k in there and tuple(here[k]) != tuple(there[k])]
    missing = sorted(k for k in here if k not in there) if strict else []
    unexpected = sorted(k for k in there if k not in here) if strict else []
    if not (shape or missing or unexpected):
        return None
    parts = [f"{k} {list(here[k])} here vs {list(there[k])} in the checkpoint" for k in shape[:limit]]
    if len(shape) > limit:
        parts.append(f"{len(shape) - limit} more shapes differ")
    for what, names in (("not in the checkpoint", missing), ("in the checkpoint, not in this model", unexpected)):
        if names:
            parts.append(f"{what}: {', '.join(names[:limit])}" + (f" and {len(names) - limit} more"
                                                                    if len(names) > limit else ""))
    return "; ".join(parts)
