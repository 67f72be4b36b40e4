"""Step time: compute from FLOPs, collectives from an alpha-beta ring model, and the engine's overlap rules.

Compute. Training FLOPs per token = 6Ψ + 6·L·s·h: Kaplan et al. 2020, "Scaling Laws for Neural Language
Models", section 2.1 (C_forward ≈ 2N + 2·n_layer·n_ctx·d_attn, backward twice the forward); the 6Ψ·D rule
is also Hoffmann et al. 2022 (Chinchilla), appendix F. Time = FLOPs / (peak × efficiency); the default
efficiency 0.4 is a model-FLOPs utilisation in the range reported for large-model training (Chowdhery et al.
2022, PaLM, table 3: 46 %; Narayanan et al. 2021, Megatron-LM: 52 % of peak at 1T parameters). Forward is
1/3 of it, backward 2/3 (the same 2N : 4N split).

Collectives. A ring collective over n ranks takes ``steps · α + wire_bytes / (busbw)`` where wire bytes are
the ledger's (nccl-tests PERFORMANCE.md: (n-1)/n for reduce-scatter/all-gather, 2(n-1)/n for all-reduce),
steps = n-1 (2(n-1) for all-reduce), α the slowest hop's latency and busbw = the ring's slowest hop ×
``bus_efficiency`` (0.8 by default: nccl-tests busbw on NVLink/PCIe typically reaches ~80 % of the link rate,
e.g. the F09 capture in tests/assets/topology measured 25.9 GB/s on a 31.5 GB/s PCIe Gen4 path).

Overlap (what the engine does, engine/buckets/sync.py and engine/zero3/):
* stages 0-2: bucket reductions launch from gradient hooks during backward, so they hide behind backward
  compute; the last bucket (the first layers' gradients) can only start when backward ends:
  exposed = max(t_reductions - t_backward, t_last_bucket). The post-step all-gather (stages 1/2) runs in
  the background and is waited per module in the next forward (``overlap_param_gather``): exposed =
  max(t_gathers - t_forward, t_first_bucket). The hybrid cross-island all-reduce and the step's small
  collectives are waited on at once: fully exposed.
* stage 3: a unit's gather is prefetched while the previous unit computes (``prefetch_depth`` >= 1), so each
  unit costs max(compute of the previous unit, its own communication); backward shares the link between
  the prefetch gather and the reduce-scatter. Without prefetch every gather is exposed. (The engine also issues
  the first units at the start of the forward and of the backward, behind the root's gather and the loss's
  backward; not modelled: the first unit's gather of each pass counts as exposed here.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .config import Job, StrategyConfig
from .layout import PlannedLayout
from .placement import Ring
from .stats import TransformerShape
from .traffic import Collective

DEFAULT_EFFICIENCY = 0.4
DEFAULT_BUS_EFFICIENCY = 0.8
# memory traffic per element (``quant_seconds``), counted from engine/comm/quant.py's eager torch passes, not measured:
# quantize (cast, abs, amax, scale, round, clamp, dequantized copy, int8 cast, pack) ~64 bytes; dequantize (int8 to
# fp32, scale, copy out) ~24; error feedback (the fp32 copy, the residual added and the new one) ~24. A fused kernel
# (ZeRO++'s) moves ~3-6 bytes per element: these overstate its cost, not ours.
QUANTIZE_BYTES, DEQUANTIZE_BYTES, FEEDBACK_BYTES = 64, 24, 24


def training_flops_per_token(psi: float, shape: Optional[TransformerShape]) -> float:
    """Kaplan et al. 2020 section 2.1: 6N + 6·n_layer·n_ctx·d_attn (3 x the forward's 2N + 2·n_layer·n_ctx·d)."""
    attn = 6 * shape.layers * shape.seq * shape.hidden if shape is not None else 0
    return 6 * psi + attn


def collective_seconds(c: Collective, ring: Ring, bus_efficiency: float = DEFAULT_BUS_EFFICIENCY) -> float:
    """Alpha-beta ring model (module docstring); 0 for a group of one rank."""
    if c.world <= 1:
        return 0.0
    steps = 2 * (c.world - 1) if c.op == "all_reduce" else c.world - 1
    return steps * ring.latency_us * 1e-6 + c.wire_bytes / (ring.gbps * 1e9 * bus_efficiency)


@dataclass(frozen=True)
class StepTime:
    compute: float
    exposed_comm: float
    total_comm: float  # link busy time, overlapped or not

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm


def _pipeline(compute: list[float], comm: list[float], prefetch: bool) -> float:
    """Exposed communication of a sequence of units: unit u's comm overlaps unit u-1's compute."""
    if not prefetch:
        return sum(comm)
    exposed = comm[0] if comm else 0.0
    for u in range(1, len(comm)):
        exposed += max(0.0, comm[u] - compute[u - 1])
    return exposed


def quant_seconds(layout: PlannedLayout, cfg: StrategyConfig, colls: list[Collective], memory_bw: float) -> float:
    """Time spent quantizing and dequantizing per step (``gather_quant`` / ``reduce_quant``): a quantized gather
    quantizes the rank's shard and dequantizes the full unit, a quantized reduction quantizes the full bucket and
    dequantizes and sums the N pieces of the rank's range; each element costs the memory traffic of the constants
    above, on the critical path (before a launch, after a wait)."""
    numel = {b.index: b.padded_numel for b in layout.buckets}
    traffic = 0.0
    for c in colls:
        n = numel.get(c.bucket, 0)
        if c.world <= 1:
            continue
        if c.kind == "unshard" and cfg.gather_quant != "none":  # the rank's shard quantized, the unit dequantized
            traffic += n / c.world * QUANTIZE_BYTES + n * DEQUANTIZE_BYTES
        elif c.kind == "grad" and cfg.reduce_quant != "none":  # the bucket (+ residual) quantized, N pieces decoded
            traffic += n * (QUANTIZE_BYTES + FEEDBACK_BYTES * cfg.quant_error_feedback) + n * DEQUANTIZE_BYTES
    return traffic / memory_bw


def step_time(layout: PlannedLayout, cfg: StrategyConfig, job: Job, colls: list[Collective],
              rings: dict[str, Ring], psi: float, shape: Optional[TransformerShape], peak_flops: float,
              efficiency: float = DEFAULT_EFFICIENCY, bus_efficiency: float = DEFAULT_BUS_EFFICIENCY,
              memory_bw: float = 2e12) -> StepTime:
    tokens = job.micro_batch * job.seq
    t_mb = training_flops_per_token(psi, shape) * tokens / (peak_flops * efficiency)
    t_quant = quant_seconds(layout, cfg, colls, memory_bw)
    t_fwd, t_bwd = t_mb / 3, 2 * t_mb / 3

    def sec(c: Collective) -> float:
        return collective_seconds(c, rings[c.group], bus_efficiency)

    total_comm = sum(sec(c) for c in colls)
    exposed = 0.0
    # small and post-backward collectives: waited on at once
    exposed += sum(sec(c) for c in colls if c.phase in ("boundary", "step") and c.kind != "param")
    # stages 1/2: the post-step all-gather runs in the background, issued in forward order and waited per
    # module in the next forward (engine ``overlap_param_gather``, default True): hidden behind that forward
    # except the first bucket it needs
    gathers = [sec(c) for c in colls if c.kind == "param"]
    if gathers:
        exposed += max(sum(gathers) - t_fwd, gathers[-1]) if cfg.overlap_param_gather else sum(gathers)
    if layout.stage < 3:
        for m in range(job.accumulation):
            red = [sec(c) for c in colls if c.micro_batch == m and c.kind == "grad"]
            if red:
                exposed += max(sum(red) - t_bwd, red[-1])
        return StepTime(t_mb * job.accumulation + t_quant, exposed, total_comm)
    # stage 3: units in forward order (root first: it is gathered around the step), compute by parameter share
    units = layout.units
    weight = [sum(b.numel for b in u.buckets) for u in units]
    share = [w / max(1, sum(weight)) for w in weight]
    by_unit_bucket = {b.index: u.index for u in units for b in u.buckets}
    prefetch = cfg.prefetch_depth > 0
    for m in range(job.accumulation):
        mine = [c for c in colls if c.micro_batch == m and c.phase in ("forward", "backward")]
        # collectives come in bucket order per kind; map them back to units by the layout's bucket order
        fwd = [0.0] * len(units)
        bwd = [0.0] * len(units)
        gathers = [c for c in mine if c.kind == "unshard"]
        rs = [c for c in mine if c.kind == "grad"]
        nb = len(layout.buckets)
        for k, c in enumerate(gathers):
            u = by_unit_bucket[layout.buckets[k % nb].index]
            (fwd if c.phase == "forward" else bwd)[u] += sec(c)
        for k, c in enumerate(rs):
            bwd[by_unit_bucket[layout.trainable[k].index]] += sec(c)
        exposed += _pipeline([t_fwd * s for s in share], fwd, prefetch)
        order = list(reversed(range(len(units))))  # backward visits units in reverse
        exposed += _pipeline([t_bwd * share[u] for u in order], [bwd[u] for u in order], prefetch)
    return StepTime(t_mb * job.accumulation + t_quant, exposed, total_comm)
