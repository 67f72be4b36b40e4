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

Two sets of rates price these (``rates``): :class:`Nominal`, the datasheet figures above (planning a machine you do
not have), and :class:`Calibrated`, a machine profile measured on this machine (``profile.py``, ``calibrate.py``):
compute as measured for the model, each collective from its measured curve at its bytes, the optimizer step per
element, the engine's own work per bucket operation (with its collective's fixed cost, as the engine meets it), per
byte and per parameter tensor, and of the communication the schedule below would hide, only the measured share
(``overlap``).

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
from typing import TYPE_CHECKING, Optional

from .config import Job, StrategyConfig
from .layout import PlannedLayout
from .placement import Ring
from .stats import TransformerShape
from .traffic import Collective

if TYPE_CHECKING:
    from .profile import MachineProfile

BUCKET_OPS = ("unshard", "grad", "param")  # a unit's gather, a bucket's reduction, the post-step gather
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
    engine: float = 0.0  # the engine's own work per step (calibrated model: per bucket operation, byte, tensor)

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.engine


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


@dataclass(frozen=True)
class Nominal:
    """The uncalibrated rates: datasheet FLOP/s at ``efficiency``, rings at ``bus_efficiency`` of their slowest link,
    no optimizer time, communication fully hidden where the schedule allows (planning a machine you do not have)."""

    peak_flops: float
    efficiency: float = DEFAULT_EFFICIENCY
    bus_efficiency: float = DEFAULT_BUS_EFFICIENCY
    memory_bw: float = 2e12
    name = "nominal"

    def micro_batch(self, psi: float, shape: Optional[TransformerShape], job: Job) -> tuple[float, float]:
        t = training_flops_per_token(psi, shape) * job.micro_batch * job.seq / (self.peak_flops * self.efficiency)
        return t / 3, 2 * t / 3

    def collective(self, c: Collective, ring: Ring, cfg: StrategyConfig) -> float:
        return collective_seconds(c, ring, self.bus_efficiency)

    def optimizer(self, elements: float) -> float:
        return 0.0

    def engine(self, ops: list[Collective], tensors: int, stage: int = 0) -> float:
        return 0.0

    @property
    def overlap(self) -> float:
        return 1.0


def profile_op(c: Collective, cfg: StrategyConfig) -> str:
    """The machine profile's name for the path a planned collective takes (``profile.py``)."""
    if c.kind == "grad" and cfg.reduce_quant != "none":
        return "all_to_all"
    if c.kind == "grad" and c.op in ("reduce_scatter", "all_to_all"):
        return "reduce"
    return {"all_gather": "gather"}.get(c.op, c.op)


@dataclass(frozen=True)
class Calibrated:
    """Rates measured on this machine (``profile.py``): a micro-batch's forward and backward seconds, seconds per
    collective call by its path, group and bytes (fixed cost included), the optimizer step per element, and the share
    of communication that really runs behind compute. What the profile lacks comes from ``fallback``."""

    profile: "MachineProfile"
    compute: Optional[tuple[float, float]]  # this model's (forward, backward) seconds per micro-batch, if measured
    fallback: Nominal
    unit_op_s: Optional[float] = None  # the engine's seconds per stage-3 bucket operation on this model, if measured
    name = "calibrated"

    def micro_batch(self, psi: float, shape: Optional[TransformerShape], job: Job) -> tuple[float, float]:
        if self.compute is not None:
            return self.compute
        if self.profile.matmul_flops:
            t = training_flops_per_token(psi, shape) * job.micro_batch * job.seq / self.profile.matmul_flops
            return t / 3, 2 * t / 3
        return self.fallback.micro_batch(psi, shape, job)

    def collective(self, c: Collective, ring: Ring, cfg: StrategyConfig) -> float:
        """The curve at the collective's bytes; a bucket operation's without the per-call fixed cost, which the engine's
        measured cost per bucket operation (:meth:`engine`) holds as the engine meets it."""
        if c.world <= 1:
            return 0.0
        curve = self.profile.collective(profile_op(c, cfg), c.world, ring.link_class)
        if curve is None:
            return self.fallback.collective(c, ring, cfg)
        if c.kind in BUCKET_OPS and self.profile.engine_s_per_call is not None:
            return max(0.0, curve(c.bytes) - curve.latency_s)
        return curve(c.bytes)

    def optimizer(self, elements: float) -> float:
        return elements * self.profile.optimizer_s_per_element

    def engine(self, ops: list[Collective], tensors: int, stage: int = 0) -> float:
        """The engine's own work: per bucket operation (stage 3: this model's measured cost per unit operation where
        the profile has it, else the probe's per operation and per byte) and per parameter tensor."""
        p = self.profile
        if stage == 3 and self.unit_op_s is not None:
            return len(ops) * self.unit_op_s + tensors * p.engine_s_per_tensor
        return (len(ops) * (p.engine_s_per_call or 0.0) + sum(c.bytes for c in ops) * p.engine_s_per_byte
                + tensors * p.engine_s_per_tensor)

    @property
    def overlap(self) -> float:
        return 1.0 if self.profile.overlap is None else self.profile.overlap

    @property
    def memory_bw(self) -> float:  # not measured: the datasheet's (quantization's cost)
        return self.fallback.memory_bw


def step_time(layout: PlannedLayout, cfg: StrategyConfig, job: Job, colls: list[Collective],
              rings: dict[str, Ring], psi: float, shape: Optional[TransformerShape], rates: "Nominal | Calibrated",
              trainable: Optional[float] = None, tensors: int = 0) -> StepTime:
    """Seconds per optimizer step: compute, the optimizer, the communication the schedule cannot hide (of what it
    could hide, the share ``rates.overlap`` does not), the engine's own work per bucket operation and per
    parameter tensor (``tensors``). ``rates``: :class:`Nominal` or :class:`Calibrated`."""
    t_fwd, t_bwd = rates.micro_batch(psi, shape, job)
    t_mb = t_fwd + t_bwd
    t_quant = quant_seconds(layout, cfg, colls, rates.memory_bw)
    shard = cfg.shard_size or job.world
    t_opt = rates.optimizer((psi if trainable is None else trainable) / (1 if layout.stage == 0 else shard))
    t_work = t_mb * job.accumulation + t_quant + t_opt

    # the engine's own work per bucket operation (a unit's gather, a bucket's reduction or post-step gather): it runs
    # at every world size, a group of one rank included
    t_engine = rates.engine([c for c in colls if c.kind in BUCKET_OPS], tensors, layout.stage)

    def sec(c: Collective) -> float:
        return rates.collective(c, rings[c.group], cfg)

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
        return _with_overlap(StepTime(t_work, exposed, total_comm, t_engine), rates)
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
    return _with_overlap(StepTime(t_work, exposed, total_comm, t_engine), rates)


def _with_overlap(t: StepTime, rates: "Nominal | Calibrated") -> StepTime:
    """Of the communication the schedule hides, the share the machine does not really overlap is exposed too."""
    hidden = max(0.0, t.total_comm - t.exposed_comm)
    return StepTime(t.compute, t.exposed_comm + (1.0 - rates.overlap) * hidden, t.total_comm, t.engine)
