"""Memory per rank: model states (exact, from the engine's layout), the ZeRO paper's formulas, and the peak.

ZeRO paper (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC'20, section 3 and figure 1), mixed-precision Adam, K = 12 bytes of fp32 master + momentum + variance per
parameter, Ψ parameters, N ranks: DDP (2 + 2 + K)Ψ = 16Ψ; P_os (ZeRO-1) 4Ψ + KΨ/N; P_os+g (ZeRO-2)
2Ψ + (2 + K)Ψ/N; P_os+g+p (ZeRO-3) (4 + K)Ψ/N. fp32 training has no master copy (K = 8: momentum and
variance), SGD with momentum K = 4 (+4 master for half params), plain SGD K = 0.

:func:`state_bytes` follows this engine's tensors instead (``Bucket.tensor_bytes``): padded flat buffers,
fp32 masters of the owned elements for half-precision parameters, the reduced fp32 gradient shard the
optimizer reads, the fp32 accumulator of ``per_micro_batch`` and the optimizer's state of the owned shard.
:func:`peak_bytes` is the most bytes alive at any of three moments of a micro-batch, on top of the persistent
states (parameters, fp32 masters, optimizer state, and the shard accumulators when an accumulation window holds
them):

* the start of backward, where activations peak (``stats.activation_bytes``: every layer's saved tensors, the
  log-softmax output and the first two gradients of the loss); stages 0/1 hold their full gradient buffers here
  (kept across steps), stage 3 its step units (the root: embeddings, tied head) gathered again for backward (their
  gradient buffers appear with their first gradient; resharding frees a unit's storage itself, so the view of it
  that ``F.linear`` saved for backward holds no memory);
* the end of backward: full gradient buffers (stages 0/1 for the whole backward; stage 2 allocates a bucket's buffer
  at its first gradient and frees it once its reduce-scatter is done, so a communicating backward holds at most
  ``IN_FLIGHT + 1`` buckets, while an accumulating ``defer`` window holds them all; stage 3 keeps every unit's until
  ``post_backward``), fp32 copies of half gradients and reduce-scatter outputs in flight (with the all-to-all form
  of the reduce-scatter, gloo's default, the pieces too: a full-size buffer per reduction in flight, none on 2 ranks
  but stage 1's one piece), gathered
  stage-3 units (root and units enclosing others + the largest unit x (1 + prefetch depth), or every unit when
  parameters are kept);
* the optimizer step: the gradients it reads (and stages 0/1's full buffers), the accumulators, and the update's
  temporaries: torch's for-loop Adam(W) (the CPU default) allocates two tensors of one optimizer chunk
  (``OPTIM_CHUNK_BYTES``, the strategies' ``optim_chunk_mb``: sqrt of the second moment and its quotient by the bias
  correction); ``foreach`` (the CUDA default) allocates them for a whole param group at once, not modelled.

``peak_bytes(...)["at_setup"]`` is what already exists once the strategy is set up, before the first step
(parameters as the engine lays them out, masters): the peak above a process's memory at train start is ``total -
at_setup`` (the peak-memory benchmark compares it with the measured per-rank peak that way).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..engine.buckets.sync import IN_FLIGHT
from ..engine.comm.quant import piece_bytes
from .config import Job, StrategyConfig
from .layout import PlannedLayout

_SIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8}
STATE_KEYS = ("params", "gathered_params", "grads", "master", "accumulators", "optimizer_state")


def optimizer_elems(optimizer: str) -> int:
    """State tensors per element: Adam/AdamW exp_avg + exp_avg_sq; SGD momentum buffer; plain SGD none."""
    return {"adam": 2, "adamw": 2, "sgd": 1, "sgd_momentum": 1, "sgd_plain": 0}.get(optimizer, 2)


def zero_paper_bytes(psi: float, n: int, stage: int, precision: str = "bf16-true", optimizer: str = "adam") -> float:
    """Model-state bytes per rank from the ZeRO paper's formulas (see module docstring), generalised over K."""
    half = precision in ("bf16-true", "16-true", "bf16-mixed", "16-mixed")
    p = 2 if half else 4  # parameter and gradient bytes (fp16/bf16 in the paper's mixed precision)
    k = 4 * optimizer_elems(optimizer) + (4 if half else 0)  # fp32 optimizer state (+ fp32 master copy)
    if stage == 0:
        return (2 * p + k) * psi
    if stage == 1:
        return 2 * p * psi + k * psi / n
    if stage == 2:
        return p * psi + (p + k) * psi / n
    return (2 * p + k) * psi / n


def _shard_dtype(b, job: Job) -> torch.dtype:
    return torch.float32 if b.dtype in (torch.float16, torch.bfloat16) else b.dtype


def _reduce_dtype(cfg: StrategyConfig, b) -> torch.dtype:
    if cfg.reduce_dtype is not None:
        return cfg.reduce_dtype
    return torch.float32 if b.dtype in (torch.float16, torch.bfloat16) else b.dtype


def state_bytes(layout: PlannedLayout, cfg: StrategyConfig, job: Job, shard_rank: int = 0) -> dict[str, int]:
    """Model-state bytes of one rank right before the optimizer step (keys of ``engine.memory_report()``)."""
    rep = {k: 0 for k in STATE_KEYS}
    k_opt = optimizer_elems(job.optimizer)
    accumulate = cfg.per_micro_batch
    for b in layout.buckets:
        isz = b.itemsize
        own = b.owned_numel(shard_rank)
        if layout.stage == 3:
            rep["params"] += b.shard_numel * isz
        else:
            rep["params"] += b.padded_numel * isz
            if layout.stage < 2:
                rep["grads"] += b.padded_numel * isz  # full gradient buffer stays (stage >= 2 frees it)
        if not b.trainable:
            continue
        sd, rd = _shard_dtype(b, job), _reduce_dtype(cfg, b)
        half = b.dtype in (torch.float16, torch.bfloat16)
        # fp32 masters: of half parameters; with offload of fp32 ones too (a host copy), unless offload_params
        # makes the host shard the master itself
        if half or (cfg.offload_optimizer and not (cfg.offload_params and layout.stage == 3)):
            rep["master"] += own * 4
        if accumulate:
            rep["accumulators"] += own * 4  # the optimizer's gradient is the accumulator itself
        elif not (layout.stage < 2 and rd == b.dtype and sd == b.dtype):  # stages 0/1, same dtype: a view of grad_buf
            # (stage 0 all-reduces in place; stage 1 reduce-scatters in place, into its own range of the buffer)
            rep["grads"] += own * _SIZE[sd]
        if k_opt:
            rep["optimizer_state"] += k_opt * own * _SIZE[sd] + (4 if job.optimizer.startswith("adam") else 0)
    rep["params"] += layout.frozen_bytes
    rep["total"] = sum(rep[k] for k in STATE_KEYS)
    rep["on_host"] = host_bytes(layout, cfg, rep, shard_rank)
    return rep


def host_bytes(layout: PlannedLayout, cfg: StrategyConfig, rep: dict[str, int], shard_rank: int = 0) -> int:
    """``offload_optimizer``: the part of the states ``rep`` in host memory: the fp32 master shard, the gradient
    shard copied out, the optimizer state; with ``offload_params`` the stage-3 parameter shards too."""
    if not cfg.offload_optimizer:
        return 0
    owned = sum(b.owned_numel(shard_rank) for b in layout.trainable)
    host = rep["master"] + owned * 4 + rep["optimizer_state"]
    if cfg.offload_params and layout.stage == 3:
        host += sum(b.shard_numel * b.itemsize for b in layout.buckets)
    return host


def gathered_bytes(layout: PlannedLayout, cfg: StrategyConfig) -> int:
    """Stage 3: full parameters materialized at the worst moment of a micro-batch."""
    if layout.stage != 3 or not layout.units:
        return 0
    full = [u.full_bytes for u in layout.units]
    if cfg.policy == "keep_params" or not cfg.reshard_after_forward:
        return sum(full)  # every unit stays gathered from its forward to its backward (or the whole window)
    names = [u.name for u in layout.units if not u.is_root]
    # the root, and units enclosing others (zero3 merges small modules into an enclosing module's unit): gathered
    # while the units inside them run
    held = [u for u in layout.units if u.is_root or any(n.startswith(u.name + ".") for n in names)]
    rest = sorted((u.full_bytes for u in layout.units if u not in held), reverse=True)
    return sum(u.full_bytes for u in held) + sum(rest[: 1 + cfg.prefetch_depth])  # + current unit + prefetched


OPTIM_CHUNK_BYTES = 4 * 2**20  # the strategies' optim_chunk_mb default: the optimizer steps the shard in views of it


def optimizer_temporaries(layout: PlannedLayout, job: Job, shard_rank: int = 0) -> int:
    """Adam(W), torch's for-loop implementation: ``exp_avg_sq.sqrt()`` and its quotient by the bias correction, two
    fp32 tensors of one optimizer chunk (the engine's chunks: ``OPTIM_CHUNK_BYTES``, at most one bucket's shard);
    SGD with momentum updates in place."""
    if not job.optimizer.startswith("adam"):
        return 0
    own = max((b.owned_numel(shard_rank) for b in layout.trainable), default=0)
    return 2 * min(OPTIM_CHUNK_BYTES, own * 4)


def peak_bytes(layout: PlannedLayout, cfg: StrategyConfig, job: Job, activations: int,
               shard_rank: int = 0) -> dict[str, int]:
    """Peak bytes per rank over a micro-batch and the step: persistent states + the largest of the start of backward,
    the end of backward and the optimizer step (module docstring). ``activations``: their peak, at the start of
    backward (``stats.activation_bytes``)."""
    st = state_bytes(layout, cfg, job, shard_rank)
    window = job.accumulation > 1
    accum_held = st["accumulators"] if window else 0  # per_micro_batch: alive from the window's first reduction on
    persistent = st["params"] + st["master"] + st["optimizer_state"] + accum_held
    if cfg.reduce_quant != "none" and cfg.quant_error_feedback:  # the residual: fp32, every trainable element
        persistent += sum(b.padded_numel * 4 for b in layout.trainable if b.num_shards > 1)
    if cfg.secondary_shard:  # hpZ: 1/I of every unit, from its first gather to the step (counted as held throughout)
        persistent += sum(b.padded_numel // cfg.secondary_shard * b.itemsize for b in layout.buckets)
    if cfg.offload_optimizer:  # host memory (``on_host``), not the device's: the masters and the optimizer state
        persistent -= st["master"] + st["optimizer_state"] + (st["params"] if cfg.offload_params else 0)
    grad_full = sum(b.padded_numel * b.itemsize for b in layout.trainable)
    in_flight = 0  # fp32 copies of half gradients and reduce-scatter outputs, held until the reduction is folded in
    per_bucket = []
    for b in layout.trainable:
        rd = _reduce_dtype(cfg, b)
        extra = (b.padded_numel * _SIZE[rd] if rd != b.dtype else 0) + \
            (b.shard_numel * _SIZE[rd] if layout.stage >= 2 or (layout.stage == 1 and rd != b.dtype) else 0)
        if cfg.reduce_quant != "none" and b.num_shards > 1:  # comm/quant.py: the pieces sent and received (bytes)
            # and the received pieces dequantized to fp32, besides the fp32 output shard
            pieces = b.num_shards * piece_bytes(cfg.reduce_quant, cfg.quant_block, b.shard_numel)
            extra = 2 * pieces + b.padded_numel * 4 + b.shard_numel * 4
        elif layout.stage >= 1 and cfg.reduce_scatter_via == "all_to_all":
            if b.num_shards == 2:  # the other rank's piece arrives in the shard itself (engine/comm/collectives.py
                # ``exchange_pair``); stage 1 reduces in place into its own range, whose piece must wait for it
                extra += b.shard_numel * _SIZE[rd] if layout.stage == 1 and rd == b.dtype else 0
            else:  # every rank's pieces of this rank's range
                extra += b.padded_numel * _SIZE[rd]
        in_flight += extra
        per_bucket.append(b.padded_numel * b.itemsize + extra)
    gathered = gathered_bytes(layout, cfg)
    window_held = window and not cfg.per_micro_batch  # defer / keep_*: every full gradient kept to the boundary
    start_gathered = 0  # stage 3: units gathered at the start of backward (the step units, gathered again for it)
    if layout.stage < 2 or (layout.stage == 2 and window_held):  # full buffers present for the whole backward
        start_grads, end = grad_full, grad_full + in_flight
    elif layout.stage == 2:  # buffers appear as backward reaches them and go once reduced
        start_grads, end = 0, sum(sorted(per_bucket, reverse=True)[: IN_FLIGHT + 1])
    else:
        roots = [b for u in layout.units if u.is_root for b in u.buckets]
        if cfg.policy == "keep_params" or not cfg.reshard_after_forward:
            start_gathered = sum(u.full_bytes for u in layout.units)  # still gathered from forward
        else:
            start_gathered = sum(b.padded_numel * b.itemsize for b in roots)
        # a gradient buffer is allocated with its unit's first gradient; an accumulation window keeps them all
        start_grads = grad_full if window_held else 0
        end = grad_full + in_flight + gathered
    start = activations + start_gathered + start_grads
    # the step: its gradients and the optimizer's temporaries (offload: the CPU steps, on host buffers)
    step = st["grads"] + st["accumulators"] - accum_held + optimizer_temporaries(layout, job, shard_rank)
    if cfg.offload_optimizer:
        step = st["accumulators"] - accum_held
    total = persistent + max(start, end, step)
    return {"persistent": persistent, "gathered": gathered, "gradients": grad_full + in_flight,
            "activations": activations, "start_gathered": start_gathered, "start_grads": start_grads,
            "backward_start": start, "backward_end": end, "step": step, "at_setup": st["params"] + st["master"],
            "optimizer_state": st["optimizer_state"], "master": st["master"], "params": st["params"],
            "on_host": st["on_host"], "total": total}


def fits(total: float, device_bytes: Optional[float], headroom: float = 0.9) -> bool:
    """Usable memory: ``headroom`` of the device (CUDA context, allocator fragmentation take the rest)."""
    return device_bytes is None or total <= headroom * device_bytes
