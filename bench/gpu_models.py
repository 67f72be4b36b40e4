"""The GPU check's models, sizes and data (torch only: the world-2 ranks import this file without Lightning).

Two models for the correctness phases:

* ``small_tf``: a causal LM built from torch's own ``nn.TransformerEncoderLayer`` (pre-LN, its
  ``MultiheadAttention`` reads ``out_proj.weight`` itself), an odd vocabulary (a parameter count not divisible by 2)
  and an output head tied to the embedding; SGD with momentum and weight decay (updates linear in the gradient, so
  fp32 parity is tight: "Design rules" 8).
* ``gpt``: the recipe, ``lightning_shard.recipes.gpt.GPTLightningModule`` (tied GPT, AdamW, warmup + cosine
  schedule), with
  ``eps=1e-6`` ("Design rules" 8: Adam's default 1e-8 amplifies rounding noise of near-zero gradients).

``SIZES``: the sizes of each mode. ``--cpu`` runs everything at tiny sizes so that the whole check fits in about a
minute and a half on 2 cores; the CUDA sizes are small for correctness and ~1B parameters for memory and speed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SIZES: dict[str, dict[str, Any]] = {
    "cpu": {
        "small_tf": dict(vocab=67, seq=16, d=32, heads=2, layers=2),
        "gpt": dict(vocab=67, seq=16, n_embd=32, n_head=2, n_layer=2),
        "micro": 2,  # sequences per micro-batch
        # memory and speed: a tiny recipe GPT (the same code path as the ~1B one)
        "perf": dict(n_layer=2, n_embd=64, n_head=2, vocab=512, block_size=64, batch_size=2,
                     warmup=1, steps=3, profile_steps=1, rounds=1),
    },
    "cuda": {
        "small_tf": dict(vocab=1031, seq=128, d=256, heads=4, layers=4),
        "gpt": dict(vocab=1031, seq=128, n_embd=256, n_head=4, n_layer=4),
        "micro": 4,
        # ~1.01B parameters: 18 x 12 x 2048^2 (blocks) + 50304 x 2048 (tied embedding) + 1024 x 2048 (positions)
        "perf": dict(n_layer=18, n_embd=2048, n_head=16, vocab=50304, block_size=1024, batch_size=8,
                     warmup=3, steps=10, profile_steps=2, rounds=2),
    },
}

STEPS, ACC, CKPT_STEP = 5, 2, 3  # optimizer steps, micro-batches per step, the step whose checkpoint is resumed
STEPS_PER_EPOCH = 3  # the checkpoint at step 3 is at an epoch's end: the resumed run starts the next epoch whole


class SmallTransformerLM(nn.Module):
    """Token + position embeddings, ``nn.TransformerEncoder`` of pre-LN layers under a causal mask, final LayerNorm,
    a head tied to the token embedding."""

    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for emb in (self.wte, self.wpe):  # GPT-2's init (nn.Embedding's N(0, 1) would hold values bf16 rounds coarsely)
            nn.init.normal_(emb.weight, std=0.02)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        x = self.encoder(x, mask=self.mask[:t, :t].to(x.dtype), is_causal=True)
        return self.head(self.ln_f(x))


def build_small_tf(size: dict[str, Any], seed: int = 1234) -> SmallTransformerLM:
    torch.manual_seed(seed)
    return SmallTransformerLM(size["vocab"], size["seq"], size["d"], size["heads"], size["layers"])


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def sgd_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weight decay on matrices only (two parameter groups)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


def make_sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(sgd_groups(model), lr=0.05, momentum=0.9)


def tokens(n: int, seq: int, vocab: int, seed: int = 7) -> torch.Tensor:
    """``n`` sequences of ``seq + 1`` token ids (inputs are ``[:, :-1]``, targets ``[:, 1:]``)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, seq + 1), generator=g)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest ``|a - b|`` over the tensors both hold (compared in fp32) and where it is; the key sets must be
    equal (a missing weight is a wrong result, not a small one)."""
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b))[:3], sorted(set(b) - set(a))[:3]
        raise ValueError(f"different weights: only in the run {only_a}, only in the reference {only_b}")
    worst, where = -1.0, ""
    for k in sorted(a):
        d = float((a[k].detach().float().cpu() - b[k].detach().float().cpu()).abs().max()) if a[k].numel() else 0.0
        if d != d:  # nan
            return float("inf"), k
        if d > worst:
            worst, where = d, k
    return max(worst, 0.0), where


def cpu_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in state.items() if torch.is_tensor(v)}
