"""A small GPT-style causal language model and its LightningModule.

Model: token + learned position embeddings, pre-LayerNorm transformer blocks (causal self-attention
through ``F.scaled_dot_product_attention(is_causal=True)``, MLP with 4x expansion), a final LayerNorm and
an LM head whose weight is the token embedding (tied, Press & Wolf 2017) unless ``tie_weights=False``.

LightningModule: cross-entropy training, validation loss and perplexity, AdamW with decay only on
2-D matmul weights, and a per-step linear-warmup + cosine learning-rate schedule. It counts the tokens it
trains on (``tokens_seen``, this rank only) so a callback can compute throughput.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

from lightning_shard.recipes.lm_steps import CausalLMSteps


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 256, block_size: int = 128, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0, tie_weights: bool = True) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd must be divisible by n_head: n_embd={n_embd}, n_head={n_head}, "
                             f"{n_embd} % {n_head} = {n_embd % n_head}; pick n_head among the divisors of n_embd")
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self._init_weights(n_layer)
        if tie_weights:
            self.lm_head.weight = self.wte.weight

    def _init_weights(self, n_layer: int) -> None:
        # GPT-2 style: N(0, 0.02) everywhere, residual output projections scaled by 1/sqrt(2 * n_layer)
        # (Radford et al. 2019, section 2.3), zero biases, LayerNorm at identity.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx``: (B, T) token ids with T <= block_size; returns logits (B, T, vocab_size)."""
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}; "
                             f"crop the input or build the model with block_size >= {t}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def num_parameters(self) -> int:
        """Unique parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup from 1/warmup to 1, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPTLightningModule(CausalLMSteps, pl.LightningModule):
    def __init__(self, vocab_size: int = 256, block_size: int = 128, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0, tie_weights: bool = True, lr: float = 1e-3,
                 weight_decay: float = 0.1, betas: Sequence[float] = (0.9, 0.95), eps: float = 1e-8,
                 warmup_steps: int = 20, min_lr_ratio: float = 0.1, total_steps: Optional[int] = None) -> None:
        super().__init__()
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        betas = tuple(float(b) for b in betas)
        if len(betas) != 2:
            raise ValueError(f"betas must be two numbers (beta1, beta2), got {betas}")
        self.save_hyperparameters()
        self.model = GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout, tie_weights)
        self.val_loss_mean = MeanMetric()
        self.tokens_seen = 0  # tokens this rank trained on (x.numel() summed over micro-batches)
        self.last_train_loss: Optional[torch.Tensor] = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def _total_steps(self) -> int:
        if self.hparams.total_steps is not None:
            return int(self.hparams.total_steps)
        trainer = self._trainer
        if trainer is None:
            return max(1, self.hparams.warmup_steps)
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return trainer.max_steps
        return int(trainer.estimated_stepping_batches)

    def param_groups(self) -> list[dict]:
        """Weight decay on the weights of ``nn.Linear`` only; none on biases, LayerNorm and embeddings.

        The LM head weight is the token embedding when tied: it is listed once, under the embedding.
        """
        decay, no_decay, seen = [], [], set()
        for module in self.model.modules():
            for name, p in module.named_parameters(recurse=False):
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                is_tied_head = module is self.model.lm_head and self.hparams.tie_weights
                if isinstance(module, nn.Linear) and name == "weight" and not is_tied_head:
                    decay.append(p)
                else:
                    no_decay.append(p)
        return [{"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.param_groups(), lr=hp.lr, betas=hp.betas, eps=hp.eps)
        total = self._total_steps()
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: warmup_cosine(step, hp.warmup_steps, total, hp.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}
