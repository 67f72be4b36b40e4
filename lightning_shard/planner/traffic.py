"""Collectives per optimizer step, predicted from the engine's layout: op, group, bytes, wire bytes.

``step_collectives`` lists what the ledger (``engine/comm/collectives.py``) records over one optimizer step of
``accumulation`` micro-batches, with the same ``bytes`` (full padded tensor) and ``wire_bytes`` (ring bytes
per rank, nccl-tests busbw factors: RS/AG (N-1)/N, AR 2(N-1)/N, broadcast 1x;
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md). The rules are the engine's:

stages 0-2 (``engine/engine.py``): each trainable bucket is all-reduced (stage 0) or reduce-scattered on the
boundary micro-batch, or on every micro-batch with ``per_micro_batch``; stages 1/2 all-gather every bucket
after the step. Stage 3 (``engine/zero3/controller.py``): every unit's buckets (frozen ones too) are gathered in forward
and again in backward (``reshard_after_forward``; the root unit's not again: it stays gathered into backward), once
per micro-batch without it, once per step with ``keep_params``; trainable buckets are reduce-scattered per
micro-batch or at the boundary only. Hybrid:
one all-reduce of the rank's owned shard per trainable bucket on the replicate group at the boundary.
``secondary_shard`` (hpZ): a bucket's first gather of the step is on the gather group, its others on the island
group, from the kept copies (exact bytes). ``gather_quant`` / ``reduce_quant``: those gathers and reductions carry
the quantized pieces' bytes (engine/comm/quant.py: integers + 4 bytes per ``quant_block`` elements per piece; reductions
become all-to-alls). Step extras: used-mask all-reduce (``find_unused_parameters``), fp16 overflow flag, clipping
norm, buffer broadcast per dtype.

Link classes: each collective's wire bytes are attributed to the slowest hop of the ring its group runs
on (a ring runs at its slowest hop), classified as intra-island, inter-island or inter-node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..engine.comm.ledger import Ledger, ring_wire_bytes
from ..engine.comm.quant import piece_bytes
from .config import Job, StrategyConfig
from .layout import PlannedLayout

_ITEMSIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8, torch.int64: 8}
LINK_CLASSES = ("intra-island", "inter-island", "inter-node")


@dataclass(frozen=True)
class Collective:
    op: str  # all_reduce | reduce_scatter | all_gather | broadcast
    group: str  # world | shard | replicate
    world: int  # ranks in the group
    bytes: int
    kind: str  # grad | param | unshard | replicate | used_mask | found_inf | grad_norm | buffers
    phase: str  # forward | backward | boundary | step (for the overlap rules of time.py)
    micro_batch: int = 0
    bucket: int = -1  # the layout bucket a gather or reduction is of (-1: a step collective)

    @property
    def wire_bytes(self) -> float:
        return ring_wire_bytes(self.op, self.bytes, self.world)


def _reduce_dtype(cfg: StrategyConfig, dtype: torch.dtype) -> torch.dtype:
    if cfg.reduce_dtype is not None:
        return cfg.reduce_dtype
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def buffer_groups(module: nn.Module, param_dtype: Optional[torch.dtype] = None) -> list[int]:
    """Bytes of each coalesced buffer broadcast (one per dtype: float and long buffers, ``_broadcast_coalesced``)."""
    by_dtype: dict[torch.dtype, int] = {}
    for t in module.buffers():
        if not (t.is_floating_point() or t.dtype == torch.long):
            continue
        dt = param_dtype if (param_dtype is not None and t.is_floating_point()) else t.dtype
        by_dtype[dt] = by_dtype.get(dt, 0) + t.numel() * _ITEMSIZE.get(dt, t.element_size())
    return list(by_dtype.values())


def step_collectives(layout: PlannedLayout, cfg: StrategyConfig, job: Job, buffers: list[int],
                     num_optimizers: int = 1, shard_rank: int = 0) -> list[Collective]:
    """Every collective of one optimizer step on a rank that is member ``shard_rank`` of its shard group."""
    N = job.world
    S = cfg.shard_size or N
    if N % S:
        raise ValueError(f"shard_size={S} does not divide the world size {N}")
    hybrid = S < N
    R = N // S
    gname = "shard" if hybrid else "world"
    out: list[Collective] = []
    acc = job.accumulation
    # stage 3: the root unit stays gathered from its forward into backward (the loss's backward needs it first)
    root = {b.index for u in layout.units if u.is_root for b in u.buckets}
    for m in range(acc):
        boundary = m == acc - 1
        if layout.stage == 3:
            if cfg.policy == "keep_params":
                times = 1 if m == 0 else 0
            else:
                times = 2 if cfg.reshard_after_forward else 1
            for k in range(times):
                for b in layout.buckets:
                    phase = "forward" if k == 0 else "backward"
                    if k == 1 and b.index in root:
                        continue
                    if cfg.secondary_shard and (m, k) != (0, 0):  # hpZ: after the window's first gather, the island
                        out.append(Collective("all_gather", "island", cfg.secondary_shard, b.padded_numel * b.itemsize,
                                              "unshard", phase, m, b.index))
                        continue
                    # parameter gathers run on a copy of the shard group of their own (engine/engine.py: gather_group)
                    nbytes = (S * piece_bytes(cfg.gather_quant, cfg.quant_block, b.shard_numel)
                              if cfg.gather_quant != "none" and S > 1 else b.padded_numel * b.itemsize)
                    out.append(Collective("all_gather", "gather", S, nbytes, "unshard", phase, m, b.index))
        if boundary or cfg.per_micro_batch:
            for b in layout.trainable:
                rd = _reduce_dtype(cfg, b.dtype)
                op = "all_reduce" if layout.stage == 0 else cfg.reduce_scatter_via
                nbytes = b.padded_numel * _ITEMSIZE[rd]
                if cfg.reduce_quant != "none" and S > 1:  # quantized pieces in an all-to-all (engine/comm/quant.py)
                    op, nbytes = "all_to_all", S * piece_bytes(cfg.reduce_quant, cfg.quant_block, b.shard_numel)
                out.append(Collective(op, gname, S, nbytes, "grad", "backward", m, b.index))
        if boundary and hybrid:
            for b in layout.trainable:
                rd = torch.float32 if cfg.per_micro_batch else _reduce_dtype(cfg, b.dtype)
                out.append(Collective("all_reduce", "replicate", R, b.owned_numel(shard_rank) * _ITEMSIZE[rd],
                                      "replicate", "boundary", m))
    last = acc - 1
    for oi in range(num_optimizers):
        mine = [b for b in layout.trainable if b.opt_index == oi]
        if job.find_unused_parameters and N > 1:
            out.append(Collective("all_reduce", "world", N, sum(b.num_params for b in mine),
                                  "used_mask", "step", last))  # uint8
        if job.loss_scaling and N > 1:
            out.append(Collective("all_reduce", "world", N, 4, "found_inf", "step", last))
        if job.clip and layout.stage > 0 and S > 1:
            out.append(Collective("all_reduce", gname, S, 4, "grad_norm", "step", last))
        if layout.stage in (1, 2) and S > 1:  # a shard group of one rank has nothing to gather
            for b in mine:  # on the copy of the shard group, as stage 3's gathers (engine/engine.py: gather_group)
                out.append(Collective("all_gather", "gather", S, b.padded_numel * b.itemsize, "param", "step", last))
        if job.broadcast_buffers and N > 1:
            for nbytes in buffers:
                out.append(Collective("broadcast", "world", N, nbytes, "buffers", "step", last))
    return out


def summarize(colls: list[Collective]) -> dict[tuple[str, str], dict[str, float]]:
    """``{(op, group): {"count", "bytes", "wire_bytes"}}``: the ledger's own summary, applied to predictions."""
    return Ledger.summarize(colls)  # Collective has the fields it reads (op, group, bytes, wire_bytes)


def by_link_class(colls: list[Collective], group_class: dict[str, str]) -> dict[str, float]:
    """Wire bytes per rank per link class; ``group_class`` maps world/shard/replicate to a class."""
    out = {k: 0.0 for k in LINK_CLASSES}
    for c in colls:
        if c.world > 1:
            out[group_class.get(c.group, "intra-island")] += c.wire_bytes
    return out
