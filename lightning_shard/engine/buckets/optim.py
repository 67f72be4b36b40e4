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

import warnings
from typing import Any, Optional

import torch
from torch import nn

from ..comm import collectives as C
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
            group["params"] = [c for b in self.buckets for g, c in b.optimizer_view.grouped() if g == gi]

    def toggled_off(self) -> bool:
        """Lightning's ``toggle_optimizer`` switched this optimizer off: it sets ``requires_grad`` on what the param
        groups hold, the shard chunks, and none of this rank's requires a gradient (False on a rank that has none)."""
        chunks = [c for b in self.buckets for c in b.chunks]
        return bool(chunks) and not any(c.requires_grad for c in chunks)

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
            mine = b.optimizer_view.slot_state(self.optimizer.state)
            # which parameters have state, and the state's keys and scalars: from the owner of element 0
            ranges = b.optimizer_view.slot_ranges
            meta = {slot: {k: (None if _is_piece(v, b, slot) else v) for k, v in st.items()}
                    for slot, st in mine.items() if b.own_lo + ranges[slot][0] == b.layout.slots[slot].offset}
            merged: dict[int, dict[str, Any]] = {}
            for theirs in (C.all_gather_object(meta, b.group, tag="optimizer_state") if b.spec.reduce_scatters else
                           [meta]):
                merged.update(theirs)
            keys = sorted({k for st in merged.values() for k, v in st.items() if v is None})
            flats = {k: _gather_flat(b, _owned_flat(b, mine, k)) for k in keys}
            for slot, p in enumerate(b.params):
                if slot not in merged:
                    continue
                sl = b.layout.slots[slot]
                per = {k: (flats[k][sl.offset:sl.end].view(sl.shape).clone() if v is None else
                           (v.clone() if torch.is_tensor(v) else v)) for k, v in merged[slot].items()}
                state[index[id(p)]] = per
        groups = []
        for gi, g in enumerate(self.optimizer.param_groups):
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = [index[id(p)] for p in self.orig_groups[gi]]
            groups.append(entry)
        return {"state": state, "param_groups": groups}

    def load_full_state_dict(self, sd: dict[str, Any]) -> None:
        """Load torch's per-parameter format, keeping only this rank's piece of each state tensor."""
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
            states: dict[int, dict[str, Any]] = {}
            for slot, (lo, hi) in b.optimizer_view.slot_ranges.items():
                src = saved_state.get(index[id(b.params[slot])])
                if not src:
                    continue
                sl = b.layout.slots[slot]
                a = b.own_lo + lo - sl.offset  # this rank's piece, in the parameter's flat coordinates
                states[slot] = {k: (v.reshape(-1)[a:a + hi - lo].to(b.device) if torch.is_tensor(v) and
                                    v.numel() == sl.numel and v.dim() >= 1 else v) for k, v in src.items()}
            b.optimizer_view.set_slot_state(self.optimizer.state, states)
        self.rebind(self.buckets)  # chunks may have been split by the loaded step counts


def leave_out_unused(binding: "OptimizerBinding", find_unused: bool, total_world: int, warned: set[str]) -> bool:
    """Parameters that got no gradient on any rank in this window are left out of the step, exactly as torch
    leaves a parameter whose ``.grad`` is None (no momentum, weight decay or Adam step). Costs one all-reduce of one
    byte per parameter per optimizer step (``find_unused_parameters=True``, the default). True when chunks were split
    (the optimizer must be rebound).

    With ``find_unused_parameters=False`` the mask is not exchanged: every parameter steps, one without a gradient
    with zeros (as DDP's ``find_unused_parameters=False`` would, had it not raised); a parameter that got no
    gradient on this rank is named once in a warning (``warned``: the names already named)."""
    buckets = binding.buckets
    if not buckets:
        return False
    mask = torch.cat([b.used for b in buckets]).to(buckets[0].device)
    if not find_unused:
        for b in buckets:
            for i in range(len(b.params)):
                if not b.used[i] and b.names[i] not in warned:
                    warned.add(b.names[i])
                    warnings.warn(f"rank {C.get_rank()}: parameter {b.names[i]} got no gradient in this window; "
                                  "with find_unused_parameters=False it steps with a zero gradient (momentum and "
                                  "weight decay still move it). Leave find_unused_parameters at True (default) "
                                  "for the result of one process.", stacklevel=4)
        return False
    if total_world > 1:
        C.all_reduce(mask, op="max", group=None, tag="used_mask")
    unused = (mask == 0).tolist()
    off, split = 0, False
    for b in buckets:
        split |= b.leave_out([i for i in range(len(b.params)) if unused[off + i]], binding.optimizer.state)
        off += len(b.params)
    return split


def _is_piece(v: Any, b: Bucket, slot: int) -> bool:
    lo, hi = b.optimizer_view.slot_ranges[slot]
    return torch.is_tensor(v) and v.dim() == 1 and v.numel() == hi - lo


def _owned_flat(b: Bucket, mine: dict[int, dict[str, Any]], key: str) -> torch.Tensor:
    """This rank's owned elements of state ``key`` as one flat tensor (zeros where a parameter has none)."""
    sample = next((st[key] for st in mine.values() if key in st and torch.is_tensor(st[key])), None)
    dtype = sample.dtype if sample is not None else torch.float32
    out = torch.zeros(b.owned_numel, dtype=dtype, device=b.device)
    for slot, st in mine.items():
        if key in st and _is_piece(st[key], b, slot):
            lo, hi = b.optimizer_view.slot_ranges[slot]
            out[lo:hi].copy_(st[key])
    return out


def _gather_flat(b: Bucket, v: torch.Tensor) -> torch.Tensor:
    """Full padded flat tensor from each rank's owned slice ``v`` of one bucket."""
    if not b.spec.reduce_scatters:  # stage 0: every rank holds the whole bucket
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
