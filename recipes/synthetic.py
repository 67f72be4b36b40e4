"""Synthetic tokens at a fixed size: a throughput workload with no data loading cost and no download.

Sample ``i`` is ``block_size + 1`` uniform random token ids drawn from a generator seeded with ``seed + i``,
so every run, rank and epoch sees the same tokens for the same index. The loss says nothing about
learning (the best achievable is ln(vocab_size)); the figure of interest is tokens/s.
"""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset


class SyntheticTokens(Dataset):
    def __init__(self, num_samples: int, block_size: int, vocab_size: int, seed: int = 0) -> None:
        for name, v in (("num_samples", num_samples), ("block_size", block_size), ("vocab_size", vocab_size)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.num_samples, self.block_size, self.vocab_size, self.seed = num_samples, block_size, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range [0, {self.num_samples})")
        gen = torch.Generator().manual_seed(self.seed + idx)
        w = torch.randint(0, self.vocab_size, (self.block_size + 1,), generator=gen)
        return w[:-1], w[1:]


class SyntheticTokensDataModule(pl.LightningDataModule):
    def __init__(self, block_size: int = 128, vocab_size: int = 256, num_samples: int = 4096,
                 num_val_samples: int = 64, micro_batch_size: int = 8, seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        self.block_size, self.vocab_size = block_size, vocab_size
        self.num_samples, self.num_val_samples = num_samples, num_val_samples
        self.micro_batch_size, self.seed, self.num_workers = micro_batch_size, seed, num_workers
        self.train_set: Optional[SyntheticTokens] = None
        self.val_set: Optional[SyntheticTokens] = None

    def setup(self, stage: Optional[str] = None) -> None:
        self.train_set = SyntheticTokens(self.num_samples, self.block_size, self.vocab_size, self.seed)
        self.val_set = SyntheticTokens(self.num_val_samples, self.block_size, self.vocab_size, self.seed + 10**9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.micro_batch_size, shuffle=False, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.micro_batch_size, num_workers=self.num_workers)
