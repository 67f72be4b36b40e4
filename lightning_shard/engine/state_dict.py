"""Full weights by parameter name out of the buckets, and back in (consolidated checkpoints, ``state_dict()``
after fit, resuming fp32 masters). Sharded checkpoint pieces are :mod:`lightning_shard.checkpoint.pieces`'s job."""

from __future__ import annotations

import torch
from torch import nn

from .buckets.bucket import Bucket
from .comm import collectives as C


def param_aliases(module: nn.Module) -> dict[int, list[str]]:
    """``id(param) -> every name it has`` (a tied weight has several; the first is the one checkpoints use)."""
    out: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def gather_full(module: nn.Module, buckets: list[Bucket], group: C.Group) -> dict[str, torch.Tensor]:
    """Full weights by parameter name (every alias of a tied weight) that the module itself cannot show: fp32
    masters of half-precision parameters, and every stage-3 parameter. Collective over ``group``."""
    aliases, out = param_aliases(module), {}
    for b in buckets:
        master = b.store.master
        if master is None and not b.spec.shards_params:
            continue  # parameters replicated and no masters: the module's own parameters are full already
        own = master if master is not None else b.store.shard[: b.owned_numel]
        if b.spec.num_shards == 1:
            full = own
        else:
            shard = torch.zeros(b.layout.shard_numel, dtype=own.dtype, device=b.device)
            shard[: b.owned_numel].copy_(own)
            full = torch.empty(b.layout.padded_numel, dtype=own.dtype, device=b.device)
            C.all_gather(full, shard, group=group, tag="checkpoint")
        for slot, p in zip(b.layout.slots, b.params):
            value = full[slot.offset:slot.end].view(slot.shape).clone()
            for name in aliases[id(p)]:
                out[name] = value
    return out


def load_full(module: nn.Module, buckets: list[Bucket], state: dict[str, torch.Tensor],
              masters_only: bool = False) -> list[str]:
    """Load full tensors by name into shards (and fp32 masters). Returns the parameter names not found.

    ``masters_only``: the module already holds these weights (restored before setup, stages 0-2); only
    initialise fp32 masters from fp32 tensors so their precision survives a resume."""
    aliases, missing = param_aliases(module), []
    for b in buckets:
        b.drop_secondary()  # hpZ's island copies hold the values before the load
        master = b.store.master
        if masters_only and master is None:
            continue
        flat = torch.zeros(b.layout.padded_numel, dtype=torch.float32, device=b.device)
        all_fp32, found = True, 0
        for slot, p in zip(b.layout.slots, b.params):
            src = next((state[n] for n in aliases[id(p)] if n in state), None)
            if src is None or src.numel() != slot.numel:
                missing.append(aliases[id(p)][0])
                continue
            all_fp32 &= src.dtype == torch.float32
            flat[slot.offset:slot.end].copy_(src.reshape(-1))
            found += 1
        if found != len(b.params):
            continue
        with torch.no_grad():
            if master is not None and (all_fp32 or not masters_only):
                master.copy_(flat[b.own_lo:b.own_hi])
            if not masters_only and b.spec.shards_params:
                b.store.shard.copy_(flat[b.shard_start:b.shard_end])
    return missing
