"""Pure planning: which optimizer owns each parameter, and which parameters share a flat bucket.

Used by the engine to build its buckets and by the planner (:mod:`lightning_shard.planner.layout`) to predict
them without building an engine: one set of rules, so the planner's bytes are the ledger's bytes. Nothing here
communicates or copies; parameters may live on the meta device (only identities, shapes and dtypes are read).

* stages 0-2: trainable parameters that an optimizer holds, in REVERSE registration order (roughly the order
  backward produces gradients, as DDP), fill one open bucket per (optimizer, dtype, device); a bucket closes before
  a parameter that would take it past ``bucket_bytes`` (so it never holds more, unless one parameter alone does),
  once its bytes reach ``bucket_bytes``, or once ``bucket_bytes`` of the model have been walked since it opened;
  buckets are ordered by where they complete (:func:`flat_buckets`).
* stage 3: inside each unit, one bucket per (optimizer, or frozen; dtype; device) in first-seen order. The engine
  orders the buckets in reverse unit order (the reduction launch order).

A bucket holds the parameters of every param group of its optimizer (a weight-decay group and a no-decay group
share it, as in DDP's buckets): one collective per bucket, not one per group. Inside a bucket the parameters are
ordered by param group (stable), so each group is one contiguous run of the flat buffer and the optimizer's views
(:mod:`.chunks`) are cut once per group, not once per parameter. Each bucket is returned with the optimizer that
owns it; each parameter's param group is ``owner[id(p)][1]``.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..zero3.plan import UnitSpec

# per optimizer, per param group, the parameters (the shape of ``[g["params"] for g in opt.param_groups]``)
OptimizerGroups = Sequence[Sequence[Sequence[nn.Parameter]]]
Owner = tuple[int, int]  # (optimizer index, param group index)
DtypeOf = Callable[[nn.Parameter], torch.dtype]


def _own_dtype(p: nn.Parameter) -> torch.dtype:
    return p.dtype


def param_owners(module: nn.Module, groups: OptimizerGroups) -> dict[int, Owner]:
    """``id(param) -> (optimizer index, param group index)``, refusing a tensor that is not a parameter of
    ``module`` and a parameter held by two optimizers or param groups."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}
    owner: dict[int, Owner] = {}
    for oi, opt in enumerate(groups):
        for gi, group in enumerate(opt):
            for p in group:
                if id(p) not in names:
                    raise ValueError(f"optimizer {oi}, param group {gi} holds a tensor of shape {tuple(p.shape)} "
                                     "that is not a parameter of the LightningModule; build optimizers from "
                                     "self.parameters().")
                if id(p) in owner:
                    raise ValueError(f"parameter {names[id(p)]} appears in two optimizers or param groups")
                owner[id(p)] = (oi, gi)
    return owner


def bucketed_trainable(module: nn.Module, owner: dict[int, Owner]) -> list[nn.Parameter]:
    """Stages 0-2: the parameters that go into buckets (trainable and held by an optimizer), module order."""
    return [p for p in module.parameters() if p.requires_grad and id(p) in owner]


def group_of(p: nn.Parameter, owner: dict[int, Owner]) -> int:
    """The param group of ``p`` in its optimizer (-1: no optimizer holds it)."""
    return owner[id(p)][1] if id(p) in owner else -1


def by_group(params: Sequence[nn.Parameter], owner: dict[int, Owner]) -> list[nn.Parameter]:
    """``params`` ordered by param group, stable: each group one contiguous run of the bucket."""
    return sorted(params, key=lambda p: group_of(p, owner))


def flat_buckets(module: nn.Module, owner: dict[int, Owner], bucket_bytes: int,
                 dtype_of: DtypeOf = _own_dtype) -> list[tuple[int, list[nn.Parameter]]]:
    """Stages 0-2: the buckets in launch order, each ``(optimizer index, parameters)``.

    Walking the parameters in reverse registration order (about the order backward produces their gradients), a
    bucket closes before a parameter that would take its bytes past ``bucket_bytes`` (that parameter opens the next
    one, alone if it is larger than ``bucket_bytes``), when its own bytes reach ``bucket_bytes``, **or** when
    ``bucket_bytes`` of parameters (of any optimizer or dtype) have been walked since it opened: so parameters spread
    thinly over the whole model (a second optimizer's, or another dtype's) are cut into buckets that fill as backward
    goes, instead of one bucket that is complete only at the end of backward. The cap keeps zero2's per-window
    gradient buffers (and every bucket's all-to-all pieces) at ``bucket_bytes`` (+ padding): glibc maps an allocation
    above its mmap threshold (at most 32 MiB) fresh, page by page, every time, and can serve smaller ones from its
    heap; the default 25 MiB stays below (the overshoot made Hugging Face GPT-2's second bucket
    39.4 MiB). Buckets are returned in the order they complete in that walk (the position of
    their last parameter), which is the order they are launched in: a bucket never waits for one that completes
    later. Inside a bucket the parameters are ordered by param group (:func:`by_group`)."""
    params: dict[tuple, list[nn.Parameter]] = {}  # the open buckets
    opened: dict[tuple, int] = {}  # bytes walked when each opened
    last: dict[tuple, int] = {}  # walk position of its last parameter
    sizes: dict[tuple, int] = {}
    done: list[tuple[int, int, list[nn.Parameter]]] = []  # (position of the last parameter, optimizer, params)
    walked = 0
    for pos, p in enumerate(reversed(bucketed_trainable(module, owner))):
        dtype = dtype_of(p)
        key = (owner[id(p)][0], dtype, p.device)
        nbytes = p.numel() * dtype.itemsize
        if key in params and sizes[key] + nbytes > bucket_bytes:  # p would take it past the cap: it closes first
            done.append((last[key], key[0], params.pop(key)))
        if key not in params:
            params[key], opened[key], sizes[key] = [], walked, 0
        params[key].append(p)
        last[key] = pos
        sizes[key] += nbytes
        walked += nbytes
        for k in [k for k in params if sizes[k] >= bucket_bytes or walked - opened[k] >= bucket_bytes]:
            done.append((last[k], k[0], params.pop(k)))
    done += [(last[k], k[0], ps) for k, ps in params.items()]
    return [(oi, by_group(ps, owner)) for _, oi, ps in sorted(done, key=lambda d: d[0])]


def unit_buckets(spec: UnitSpec, owner: dict[int, Owner],
                 dtype_of: DtypeOf = _own_dtype) -> list[tuple[Optional[int], list[int]]]:
    """Stage 3: the buckets of one unit, each ``(optimizer index, or None for frozen parameters; indices into
    spec.params)``, the indices ordered by param group (:func:`by_group`)."""
    keyed: dict[tuple, list[int]] = {}
    for i, p in enumerate(spec.params):
        oi = owner[id(p)][0] if p.requires_grad and id(p) in owner else None
        keyed.setdefault((oi, dtype_of(p), p.device), []).append(i)
    return [(key[0], sorted(idx, key=lambda i: group_of(spec.params[i], owner))) for key, idx in keyed.items()]
