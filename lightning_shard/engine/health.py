"""Desync and health checks: every rank built the same model and issued the same collectives; where a
non-finite gradient is. Each check raises (or answers) identically on every rank."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .buckets.bucket import Bucket
from .comm import collectives as C
from .zero3.deferred import DeferredInit


def agree(what: str, mine: list, hint: str) -> None:
    """Every rank must hold the same ``mine``; otherwise raise on every rank, naming the first difference."""
    if C.get_world_size() == 1:
        return
    everyone = C.all_gather_object(mine)
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == everyone[0]:
            continue
        i = next((k for k, (a, b) in enumerate(zip(everyone[0], theirs)) if a != b), min(len(theirs), len(everyone[0])))
        a = everyone[0][i] if i < len(everyone[0]) else "<nothing>"
        b = theirs[i] if i < len(theirs) else "<nothing>"
        raise ValueError(f"rank desync in the {what}: entry {i} differs between ranks 0 and {rank}: rank 0 has {a}, "
                         f"rank {rank} has {b} ({len(everyone[0])} vs {len(theirs)} entries). Every rank must build "
                         f"the same model; check the {hint}.")


def check_same_model(module: nn.Module, deferred: Optional[DeferredInit]) -> None:
    sizes = deferred.shapes if deferred is not None else {}
    fp = [(n, tuple(sizes.get(id(p), p.shape)), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    agree("model parameters", fp, "parameter names, shapes, dtypes, order and requires_grad")


def check_collective_sequence(since: int) -> int:
    """All ranks issued the same collectives since ledger mark ``since``; returns the next mark."""
    mine = [(e.op, e.group, e.bytes, e.dtype, e.tag) for e in C.LEDGER.since(since)]
    agree("sequence of collectives since the last optimizer step", mine,
          "code paths that communicate on some ranks only (data-dependent branches, rank-specific logging)")
    return C.LEDGER.mark()


def find_nonfinite(buckets: list[Bucket], rank_label: int, total_world: int, device: torch.device) -> Optional[str]:
    """Name of the first parameter with a non-finite gradient shard on any rank (agreed on every rank), or None."""
    local = None
    for b in buckets:
        g = b.shard_param.grad
        if g is None or not g.numel() or bool(torch.isfinite(g).all()):
            continue
        bad = int((~torch.isfinite(g)).nonzero()[0]) + b.own_lo
        slot = next(s for s in b.layout.slots if s.offset <= bad < s.end)
        local = f"{slot.name} (rank {rank_label})"
        break
    flag = torch.tensor(0.0 if local is None else 1.0, device=device)
    if total_world > 1:
        C.all_reduce(flag, op="max", group=None, tag="nonfinite")
    if not flag.item():
        return None
    names = C.all_gather_object(local) if total_world > 1 else [local]
    return next(n for n in names if n is not None)
