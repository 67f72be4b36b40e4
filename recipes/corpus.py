"""A byte-level text corpus that exists on every machine: the Python standard library's own sources.

The ``.py`` files next to ``os.__file__`` are read as bytes in sorted relative-path order, so every run on
the same Python version sees the same tokens without a download. Tokens are raw bytes (vocabulary 256).

The train/validation split is by file: a file goes to validation when the SHA-1 of its relative path
falls below ``val_fraction`` (stable under reordering, never shares a file between splits). Each split is
capped at its share of ``max_bytes`` so the recipe stays fast.

The DataModule builds plain ``DataLoader``s; Lightning injects the ``DistributedSampler`` itself.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from .resumable import ResumableData

VOCAB_SIZE = 256
# Directories of the standard library that hold no library source (or someone else's packages).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_FILE_SEPARATOR = b"\n"


def stdlib_dir() -> Path:
    """Directory of the running interpreter's standard library (the parent of ``os.py``)."""
    return Path(os.__file__).resolve().parent


def list_source_files(root: Optional[Path] = None) -> list[str]:
    """Relative paths (POSIX form) of every ``.py`` file under ``root``, sorted, skipping test/site dirs."""
    root = stdlib_dir() if root is None else Path(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                out.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(out)


def is_validation_file(rel_path: str, val_fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of SHA-1(path), read as a fraction of 2**64, below ``val_fraction``."""
    h = int.from_bytes(hashlib.sha1(rel_path.encode()).digest()[:8], "big")
    return h / 2.0**64 < val_fraction


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8 byte tokens
    val: torch.Tensor
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]


def load_stdlib_corpus(max_bytes: int = 3_000_000, val_fraction: float = 0.1,
                       root: Optional[Path] = None) -> Corpus:
    """Read the standard library into a train and a validation byte stream of at most ``max_bytes`` in all."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction}; "
                         f"e.g. val_fraction=0.1 keeps 10% of the bytes for validation")
    if max_bytes < 10_000:
        raise ValueError(f"max_bytes={max_bytes} is too small for a train and a validation split; "
                         f"use at least 10_000 (the default 3_000_000 reads ~3 MB)")
    root = stdlib_dir() if root is None else Path(root)
    budget = {"val": int(max_bytes * val_fraction)}
    budget["train"] = max_bytes - budget["val"]
    chunks: dict[str, list[bytes]] = {"train": [], "val": []}
    files: dict[str, list[str]] = {"train": [], "val": []}
    used = {"train": 0, "val": 0}
    for rel in list_source_files(root):
        split = "val" if is_validation_file(rel, val_fraction) else "train"
        room = budget[split] - used[split]
        if room <= 0:
            if all(used[s] >= budget[s] for s in used):
                break
            continue
        data = (root / rel).read_bytes()[:room - len(_FILE_SEPARATOR)] + _FILE_SEPARATOR
        chunks[split].append(data)
        files[split].append(rel)
        used[split] += len(data)
    streams = {s: torch.frombuffer(bytearray(b"".join(chunks[s])), dtype=torch.uint8) for s in chunks}
    return Corpus(streams["train"], streams["val"], tuple(files["train"]), tuple(files["val"]))


class WindowDataset(Dataset):
    """Fixed windows of ``block_size + 1`` tokens from a 1-D token tensor: ``x = w[:-1]``, ``y = w[1:]``.

    ``stride`` defaults to ``block_size`` (windows do not overlap in ``x``).
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: Optional[int] = None) -> None:
        stride = block_size if stride is None else stride
        if block_size < 1 or stride < 1:
            raise ValueError(f"block_size and stride must be >= 1, got block_size={block_size}, stride={stride}")
        if tokens.numel() < block_size + 1:
            raise ValueError(f"a window needs block_size + 1 = {block_size + 1} tokens but the stream has "
                             f"{tokens.numel()}; raise max_bytes or lower block_size")
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride
        self._len = (tokens.numel() - (block_size + 1)) // stride + 1

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= idx < self._len:
            raise IndexError(f"window {idx} out of range [0, {self._len})")
        start = idx * self.stride
        w = self.tokens[start:start + self.block_size + 1].long()
        return w[:-1], w[1:]


class StdlibTextDataModule(ResumableData, pl.LightningDataModule):
    """Byte-level language modelling on the standard library sources.

    ``micro_batch_size`` is the per-rank batch of one forward/backward; the global batch and the
    accumulation steps are derived by the training entry point (``lightning_shard.batching``).
    """

    def __init__(self, block_size: int = 128, micro_batch_size: int = 8, max_bytes: int = 3_000_000,
                 val_fraction: float = 0.1, num_workers: int = 0, seed: int = 0,
                 max_val_windows: Optional[int] = None) -> None:
        super().__init__()
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.block_size = block_size
        self.micro_batch_size = micro_batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.seed = seed
        self.max_val_windows = max_val_windows
        self.corpus: Optional[Corpus] = None
        self.train_set: Optional[WindowDataset] = None
        self.val_set: Optional[Dataset] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.corpus is not None:
            return
        self.corpus = load_stdlib_corpus(self.max_bytes, self.val_fraction)
        self.train_set = WindowDataset(self.corpus.train, self.block_size)
        val = WindowDataset(self.corpus.val, self.block_size)
        if self.max_val_windows is not None and len(val) > self.max_val_windows:
            # Evenly spaced windows, so a short validation still covers the whole split.
            step = len(val) / self.max_val_windows
            val = torch.utils.data.Subset(val, [int(i * step) for i in range(self.max_val_windows)])
        self.val_set = val

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(self.seed)
        return self.train_loader(self.train_set, batch_size=self.micro_batch_size, shuffle=True, drop_last=True,
                                 num_workers=self.num_workers, generator=gen,
                                 persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.micro_batch_size, shuffle=False, drop_last=False,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)
