"""Gradient utilities over the shards an optimizer steps on: the global norm, clipping, fp16 unscaling.

Each rank holds the averaged gradient of the elements it owns (no padding; stage 0: the whole bucket), so a
norm is one sum of owned elements and one all-reduce over the shard group (none when nothing is sharded)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .comm import collectives as C


def grad_norm(grads: list[torch.Tensor], device: torch.device, group: Optional[C.Group], sharded: bool,
              norm_type: float = 2.0) -> torch.Tensor:
    """Global gradient norm of ``grads`` (this rank's shards); ``sharded``: sum over the ranks of ``group``."""
    if math.isinf(norm_type):
        local = max((g.detach().abs().max().float() for g in grads if g.numel()),
                    default=torch.zeros((), device=device))
        total = torch.as_tensor(local, dtype=torch.float32, device=device).clone()
        if sharded:
            C.all_reduce(total, op="max", group=group, tag="grad_norm")
        return total
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        if g.numel():
            total += g.detach().float().abs().pow(norm_type).sum()
    if sharded:
        C.all_reduce(total, op="sum", group=group, tag="grad_norm")
    return total.pow(1.0 / norm_type)


def scale_to_norm(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Clip by norm: scale every shard by ``min(1, max_norm / total)`` (torch's ``clip_grad_norm_`` rule)."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(device=g.device, dtype=g.dtype))  # offload: the shards are in host memory


def clamp_values(grads: list[torch.Tensor], clip_value: float) -> None:
    for g in grads:
        g.clamp_(-clip_value, clip_value)


def unscale(grads: list[torch.Tensor], inv_scale: float, device: torch.device, world: int) -> bool:
    """Multiply by ``inv_scale``; True when any of ``world`` ranks saw inf/nan (agreed on every rank)."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        g.mul_(inv_scale)
        if g.numel() and not torch.isfinite(g).all():
            found.fill_(1.0)
    if world > 1:
        C.all_reduce(found, op="max", group=None, tag="found_inf")
    return bool(found.item())
