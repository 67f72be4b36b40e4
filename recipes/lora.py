"""A small LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

``LoRALinear`` wraps a linear layer ``base`` (``nn.Linear``, or Hugging Face's GPT-2 ``Conv1D`` whose weight is
stored transposed) and adds a trainable low-rank update: ``y = base(x) + (alpha / r) * B(A(dropout(x)))`` with
``A: in -> r`` initialised like a linear layer and ``B: r -> out`` at zero, so training starts from the base
model exactly. :func:`apply_lora` freezes every parameter of a model, then wraps the chosen linear layers.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
from torch import nn

# attention projections by model family: Llama/Mistral/Qwen, GPT-2, GPT-NeoX/Falcon, MPT
AUTO_TARGETS = ("q_proj", "v_proj", "c_attn", "query_key_value", "Wqkv")


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a linear-like module, or a ValueError naming what it is."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        rows, cols = module.weight.shape  # transformers' Conv1D: y = x @ W + b, W is (in, out)
        return int(rows), int(cols)
    raise ValueError(f"LoRA wraps nn.Linear (or transformers' Conv1D), not {type(module).__name__}")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0) -> None:
        super().__init__()
        if not isinstance(r, int) or r < 1:
            raise ValueError(f"LoRA rank r must be a positive integer, got {r!r}")
        in_features, out_features = linear_shape(base)
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.r, self.alpha, self.scale = r, alpha, alpha / r
        weight = next(base.parameters())
        self.lora_a = nn.Parameter(torch.empty(r, in_features, dtype=weight.dtype, device=weight.device))
        self.lora_b = nn.Parameter(torch.zeros(out_features, r, dtype=weight.dtype, device=weight.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # as nn.Linear initialises its weight
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = (self.drop(x) @ self.lora_a.t()) @ self.lora_b.t()
        return self.base(x) + self.scale * update

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}"


def _matches(name: str, targets: Sequence[str]) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last in targets or name in targets


def apply_lora(model: nn.Module, targets: Iterable[str] | str = "auto", r: int = 8, alpha: float = 16.0,
               dropout: float = 0.0, train_also: Iterable[str] = ()) -> list[str]:
    """Freeze ``model`` and wrap every linear layer named in ``targets`` (last name component or full name).

    ``targets="auto"`` uses :data:`AUTO_TARGETS`. ``train_also``: names of parameters to keep trainable (e.g. a
    new classification head). Returns the wrapped module names; raises when nothing matched.
    """
    targets = AUTO_TARGETS if targets == "auto" else tuple(targets)
    for p in model.parameters():
        p.requires_grad_(False)
    chosen = [(n, m) for n, m in model.named_modules() if n and _matches(n, targets)]
    linear_names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]
    if not chosen:
        sample = sorted({n.rsplit(".", 1)[-1] for n in linear_names})
        raise ValueError(f"LoRA targets {list(targets)} match no module; linear layers here are named {sample}: set "
                         f"recipe.model.lora.targets to some of them")
    for name, module in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, LoRALinear(module, r=r, alpha=alpha, dropout=dropout))
    keep = set(train_also)
    for n, p in model.named_parameters():
        if n in keep or any(n.startswith(k + ".") for k in keep):
            p.requires_grad_(True)
    return [n for n, _ in chosen]
