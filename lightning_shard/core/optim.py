"""Sharded optimizers: re-point a user's ``torch.optim`` optimizer at the rank's flat shards.

The user's optimizer object is kept (so LR schedulers, Lightning's ``LightningOptimizer`` and hooks keep
working): each of its param groups keeps its hyperparameters, and its ``params`` list becomes the flat
shard tensors of the buckets built from that group. The optimizer then updates only the rank's shard.

This is exact for element-wise optimizers (each element's update depends only on that element's gradient
and state). Optimizers that look at whole tensors (LBFGS line search, LAMB/Adafactor trust ratios,
Shampoo/Muon) are refused unless the caller states that theirs is element-wise.

Checkpoints use the plain per-parameter ``torch.optim`` format (:func:`full_state_dict`), so a file saved
by a sharded run loads into an unsharded optimizer and the other way round.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from . import collectives as C
from .bucket import Bucket

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.RMSprop,
    torch.optim.Adagrad, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Adadelta,
)


def validate_optimizer(optimizer: torch.optim.Optimizer, allow_custom: bool) -> None:
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "LBFGS cannot be sharded: it re-evaluates the closure and runs a line search over whole tensors, "
            "so a rank holding a slice of each parameter would compute a different step. Use a first-order "
            "optimizer (SGD, Adam, AdamW, ...) with zero1/zero2, or train LBFGS without sharding."
        )
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) and not allow_custom:
        known = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise TypeError(
            f"optimizer {name} is not known to be element-wise, so stepping it on flat shards may change its "
            f"result. Known element-wise optimizers: {known}. If {name}'s update of each element depends only on "
            f"that element's gradient and state, pass allow_custom_optimizer=True to the strategy."
        )
    if optimizer.state:
        raise ValueError(
            f"optimizer {name} already holds state for {len(optimizer.state)} parameters before sharding; create "
            "it in configure_optimizers() and restore checkpoints through the Trainer (ckpt_path=...)."
        )


class OptimizerBinding:
    """The link between one user optimizer and the buckets that hold its parameters."""

    def __init__(self, index: int, optimizer: torch.optim.Optimizer) -> None:
        self.index = index
        self.optimizer = optimizer
        # original parameter order, as torch's state_dict numbers them (all groups, in order)
        self.orig_groups: list[list[nn.Parameter]] = [list(g["params"]) for g in optimizer.param_groups]
        self.buckets: list[Bucket] = []

    def rebind(self, buckets: list[Bucket]) -> None:
        self.buckets = [b for b in buckets if b.opt_index == self.index]
        for gi, group in enumerate(self.optimizer.param_groups):
            group["params"] = [c for b in self.buckets if b.group_index == gi for c in b.chunks]

    def orig_index(self) -> dict[int, int]:
        """``id(param) -> index`` in torch's state_dict numbering."""
        out, i = {}, 0
        for group in self.orig_groups:
            for p in group:
                out[id(p)] = i
                i += 1
        return out

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self) -> dict[str, Any]:
        """Gather the sharded state into torch's per-parameter format (collective: every rank must call)."""
        index = self.orig_index()
        state: dict[int, dict[str, Any]] = {}
        for b in self.buckets:
            shard_state = b.shard_state(self.optimizer.state)
            keys = sorted(C.all_gather_object(sorted(shard_state.keys()), b.group)[0]) if b.stage else sorted(shard_state)
            full: dict[str, Any] = {}
            for k in keys:
                v = shard_state.get(k)
                if torch.is_tensor(v) and v.dim() == 1:
                    full[k] = _gather_flat(b, v)
                else:
                    full[k] = C.broadcast_object(v, 0, b.group) if b.stage else v
            for slot, p in zip(b.layout.slots, b.params):
                per = {}
                for k, v in full.items():
                    per[k] = v[slot.offset:slot.end].view(slot.shape).clone() if torch.is_tensor(v) and v.dim() == 1 \
                        and v.numel() == b.layout.padded_numel else (v.clone() if torch.is_tensor(v) else v)
                if per:
                    state[index[id(p)]] = per
        groups = []
        for gi, g in enumerate(self.optimizer.param_groups):
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = [index[id(p)] for p in self.orig_groups[gi]]
            groups.append(entry)
        return {"state": state, "param_groups": groups}

    def load_full_state_dict(self, sd: dict[str, Any]) -> None:
        """Load torch's per-parameter format, keeping only this rank's shard of each state tensor."""
        groups = sd.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.optimizer.param_groups):
            have = len(groups) if isinstance(groups, list) else "no"
            raise ValueError(f"optimizer state has {have} param groups but the optimizer has "
                             f"{len(self.optimizer.param_groups)}; was the checkpoint written for another model?")
        for gi, (saved, group) in enumerate(zip(groups, self.orig_groups)):
            if len(saved["params"]) != len(group):
                raise ValueError(f"param group {gi}: checkpoint has {len(saved['params'])} parameters, the model has "
                                 f"{len(group)}; was the checkpoint written for another model?")
        for g, saved in zip(self.optimizer.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        saved_state = {int(k): v for k, v in sd.get("state", {}).items()}
        index = self.orig_index()
        self.optimizer.state.clear()
        for b in self.buckets:
            per_param = [saved_state.get(index[id(p)], {}) for p in b.params]
            keys = sorted({k for s in per_param for k in s})
            if not keys:
                continue
            new: dict[str, Any] = {}
            for k in keys:
                sample = next(s[k] for s in per_param if k in s)
                if torch.is_tensor(sample) and sample.dim() >= 1:
                    flat = torch.zeros(b.layout.padded_numel, dtype=sample.dtype, device=b.device)
                    for slot, s in zip(b.layout.slots, per_param):
                        if k in s:
                            flat[slot.offset:slot.end].copy_(s[k].reshape(-1))
                    new[k] = flat[b.own_lo:b.own_hi].clone()
                else:
                    new[k] = sample.clone().to(b.device) if torch.is_tensor(sample) else sample
            b.set_shard_state(self.optimizer.state, new)


def _gather_flat(b: Bucket, v: torch.Tensor) -> torch.Tensor:
    """Full padded flat tensor from each rank's owned slice ``v`` of one bucket."""
    if b.stage == 0:
        out = torch.zeros(b.layout.padded_numel, dtype=v.dtype, device=v.device)
        out[: v.numel()].copy_(v)
        return out
    padded = torch.zeros(b.layout.shard_numel, dtype=v.dtype, device=v.device)
    padded[: v.numel()].copy_(v)
    out = torch.empty(b.layout.padded_numel, dtype=v.dtype, device=v.device)
    C.all_gather(out, padded, group=b.group, tag="checkpoint")
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, params: Optional[list] = None) -> int:
    total = 0
    for p, st in optimizer.state.items():
        if params is not None and not any(p is q for q in params):
            continue
        for v in st.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total
