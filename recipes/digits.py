"""Image classification on scikit-learn's bundled digits (1,797 8x8 grey images, 10 classes; no download).

Needs the ``digits`` extra (``pip install 'lightning-shard[digits]'`` = scikit-learn). The split is a seeded,
stratified 80/20 permutation, identical on every rank and run. Pixels (0..16) are scaled to [0, 1] and
normalised with the training mean/std. Model: a small CNN (two 3x3 conv blocks, max-pool, linear head).
Validation accuracy through torchmetrics (synchronised across ranks).
"""

from __future__ import annotations

from typing import Optional, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - exercised when the extra is missing
        raise ImportError("the digits recipe needs scikit-learn: pip install 'lightning-shard[digits]'") from err
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    y = torch.tensor(data.target, dtype=torch.long)
    return x, y


def stratified_split(y: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (train, val): per class, a seeded permutation, the first ``val_fraction`` to validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction}")
    gen = torch.Generator().manual_seed(seed)
    train, val = [], []
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(idx.numel(), generator=gen)]
        k = max(1, round(idx.numel() * val_fraction))
        val.append(idx[:k])
        train.append(idx[k:])
    return torch.sort(torch.cat(train)).values, torch.sort(torch.cat(val)).values


class DigitsDataModule(pl.LightningDataModule):
    def __init__(self, micro_batch_size: int = 32, val_fraction: float = 0.2, split_seed: int = 0,
                 seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        self.micro_batch_size, self.val_fraction, self.split_seed = micro_batch_size, val_fraction, split_seed
        self.seed, self.num_workers = seed, num_workers
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        x, y = load_digits_tensors()
        tr, va = stratified_split(y, self.val_fraction, self.split_seed)
        mean, std = x[tr].mean(), x[tr].std()
        x = (x - mean) / std
        self.train_set, self.val_set = TensorDataset(x[tr], y[tr]), TensorDataset(x[va], y[va])

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.micro_batch_size, shuffle=True, drop_last=True,
                          generator=gen, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.micro_batch_size, shuffle=False,
                          num_workers=self.num_workers)


class SmallCNN(nn.Module):
    """conv(1->c1) ReLU conv(c1->c1) ReLU maxpool -> conv(c1->c2) ReLU maxpool -> linear(c2*2*2 -> 10)."""

    def __init__(self, channels: Sequence[int] = (16, 32), num_classes: int = 10, dropout: float = 0.1) -> None:
        super().__init__()
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.Conv2d(c1, c1, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))  # -> 2x2
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(c2 * 4, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class DigitsClassifier(pl.LightningModule):
    throughput_unit = "samples"

    def __init__(self, channels: Sequence[int] = (16, 32), dropout: float = 0.1, lr: float = 3e-3,
                 weight_decay: float = 1e-4, momentum: float = 0.9) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = SmallCNN(tuple(channels), 10, dropout)
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.tokens_seen = 0  # samples, for the run summary's throughput
        self.last_train_loss: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.tokens_seen += x.shape[0]
        self.last_train_loss = loss.detach()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True, prog_bar=True, batch_size=x.shape[0])
        self.val_acc.update(logits, y)

    def on_validation_epoch_end(self) -> None:
        self.log("val_acc", self.val_acc.compute(), sync_dist=True, prog_bar=True)  # compute() syncs ranks
        self.val_acc.reset()

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        return opt
