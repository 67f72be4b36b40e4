"""Training/validation steps shared by the causal-LM recipes (GPT, Hugging Face): each defines ``_loss(batch)``
and ``val_loss_mean`` (a torchmetrics MeanMetric); this logs train/val loss, perplexity and counts tokens."""

from __future__ import annotations

import torch


class CausalLMSteps:
    tokens_seen: int
    last_train_loss: "torch.Tensor | None"

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.tokens_seen += batch[0].numel()
        self.last_train_loss = loss.detach()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.val_loss_mean.update(loss.detach(), weight=batch[1].numel())
        self.log("val_loss", loss, sync_dist=True, prog_bar=True, batch_size=batch[0].shape[0])
        return loss

    def on_validation_epoch_end(self) -> None:
        # MeanMetric.compute() already synchronizes across ranks, so every rank holds the same value;
        # sync_dist=True only tells Lightning so (its mean of equal values is that value).
        self.log("val_ppl", torch.exp(self.val_loss_mean.compute()), sync_dist=True)
        self.val_loss_mean.reset()
