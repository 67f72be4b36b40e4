"""Recommendation: the fastest configuration that fits memory, the runner-up and what it costs; bad input.

``plan(...)`` evaluates every candidate (evaluate.py) for a model, a topology and a batch; ``recommend_for``
is the entry the strategies' ``strategy=auto`` calls at setup; ``auto_policy`` picks an accumulation policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from torch import nn

from ..topology import Topology
from ..topology.resolve import resolve as resolve_topology
from .config import Job, StrategyConfig, batch_split, check_precision
from .evaluate import Context, PlanRow, candidates, collectives_of, evaluate, island_shard_size, make_context
from .hardware import DeviceSpec, device_spec
from .layout import groups_of
from .placement import place
from .stats import transformer_shape

GiB = 2**30
TIE = 0.02  # step times within 2% count as equal
QUANT_MARGIN = 0.10  # quantized communication is recommended only when predicted at least 10% faster


@dataclass
class PlanResult:
    rows: list[PlanRow]
    best: PlanRow
    runner_up: Optional[PlanRow]
    reason: str
    context: Context
    topology_spec: Optional[str] = None  # what the topology was asked as: a preset name, a capture path, "detect"
    calibration: Optional[str] = None  # what calibration did (measured, reused), when the plan asked for it

    def to_dict(self, recipe: Optional[str] = None) -> dict[str, Any]:
        """JSON-ready; every row carries the Hydra overrides and the Python constructor that run it (advice.py)."""
        from .advice import python_constructor, reproduce, strategy_overrides

        ctx = self.context
        rows = []
        for r in self.rows:
            imp, ctor = python_constructor(self, r)
            rows.append({**r.to_dict(), "hydra_strategy_overrides": strategy_overrides(self, r),
                         "python": {"import": imp, "strategy": ctor}})
        return {"topology": ctx.placement.topology.name, "topology_spec": self.topology_spec, "world": ctx.job.world,
                "devices": list(ctx.placement.devices), "device": ctx.device.name,
                "device_memory_bytes": ctx.device.memory_bytes, "params": ctx.psi,
                "accumulation": ctx.job.accumulation, "micro_batch": ctx.job.micro_batch, "seq": ctx.job.seq,
                "precision": ctx.job.precision, "activations_bytes": ctx.activations,
                "time_model": ctx.rates.name, "calibration": self.calibration,
                "recommended": self.best.label, "runner_up": self.runner_up.label if self.runner_up else None,
                "reason": self.reason, "reproduce": reproduce(self, recipe=recipe).to_dict(), "rows": rows}


@dataclass
class Recommendation:
    strategy_name: str  # registered name (``StrategyConfig.registered``): zero0 ... fsdp_shard, <name>_hybrid
    kwargs: dict[str, Any]  # the registered class's keywords (``StrategyConfig.kwargs()``)
    reason: str
    table: list[dict[str, Any]]
    predicted_step_s: float = 0.0  # the pick's predicted seconds per optimizer step
    time_model: str = "nominal"  # or "calibrated"
    calibration: Optional[str] = None  # what calibration did (measured, reused)


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def plan(module: nn.Module, topology: Union[None, str, Topology], world: Optional[int], global_batch: int,
         micro_batch: int, precision: str = "bf16-true", optimizer_groups: Any = None, seq: Optional[int] = None,
         optimizer: str = "adam", device: Optional[DeviceSpec] = None, configs: Optional[list[StrategyConfig]] = None,
         devices: Optional[list[int]] = None, activations: Optional[float] = None, require_fit: bool = True,
         calibrate: bool = False, profile_path: Optional[str] = None, in_job: Any = None,
         **ctx_kw: Any) -> PlanResult:
    """Evaluate ``configs`` (default: every candidate); ``require_fit=False`` ranks them even if none fits.

    ``calibrate=True``: time them with the calibrated model, from this machine's profile (``profile_path``, default
    the cache), measured first by ``world`` processes here where it lacks what this job needs (``calibrate.py``), or,
    with ``in_job=<this rank's torch.device>``, by every rank of the running job (collective: every rank calls
    ``plan``); ``profile=`` a :class:`~.profile.MachineProfile` already at hand. Otherwise the nominal model."""
    check_precision(precision)
    topo = resolve_topology(topology, world or 1)
    world = world or len(topo.devices)
    acc = batch_split(global_batch, micro_batch, world)
    placement = place(topo, world, devices)
    d0 = placement.topology.devices[placement.devices[0]]
    spec = device or device_spec(d0.model, d0.kind)
    shape = transformer_shape(module, seq)
    job = Job(world=world, micro_batch=micro_batch, accumulation=acc, seq=shape.seq if shape else (seq or 1),
              precision=precision, optimizer=optimizer)
    groups = groups_of(optimizer_groups) or None
    every = configs is None  # every candidate: compressed variants of the pick are considered too
    configs = configs or candidates(module, placement, acc)
    calibration = None
    if calibrate and ctx_kw.get("profile") is None:
        from .calibrate import calibrate_in_job, calibrate_job

        ctx0 = make_context(module, groups, placement, job, spec, activations)
        largest = max((c.bytes for cfg in configs for c in collectives_of(ctx0, cfg)[1]), default=0)
        shard_sizes = tuple(sorted({cfg.shard_size for cfg in configs if cfg.shard_size}))
        if in_job is not None:
            ctx_kw["profile"], _, calibration = calibrate_in_job(module, job, placement, in_job, largest, shard_sizes,
                                                                 profile_path)
        else:
            ctx_kw["profile"], _, calibration = calibrate_job(module, job, placement, largest, shard_sizes,
                                                              profile_path)
    ctx = make_context(module, groups, placement, job, spec, activations, **ctx_kw)
    rows = [evaluate(ctx, c) for c in configs]
    ok = sorted((r for r in rows if r.fits), key=lambda r: (round(r.time.total, 6), r.memory["total"]))
    if not ok and require_fit:
        raise ValueError(nothing_fits(ctx, rows))
    ok = ok or sorted(rows, key=lambda r: r.time.total)
    # within TIE of the fastest, the leanest wins: the same speed with more memory headroom
    near = [r for r in ok if r.time.total <= ok[0].time.total * (1 + TIE)]  # explained by cli_plan.legend
    best = min(near, key=lambda r: r.memory["total"])
    rest = [r for r in ok if r is not best]
    runner = rest[0] if rest else None
    lead = ("fastest that fits" if len(near) == 1 else
            f"leanest of the {len(near)} within {TIE:.0%} of the fastest that fits")
    quantized = quantized_variant(ctx, best) if every else None
    if quantized is not None:  # compressed communication pays: the exact row becomes the runner-up
        rows.append(quantized)
        lead = (f"{lead} as {best.label}, with compressed communication predicted "
                f"{1 - quantized.time.total / best.time.total:.0%} faster (>= {QUANT_MARGIN:.0%} required)")
        best, runner = quantized, best
    reason = (f"{best.label}: {lead} ({best.time.total:.3f} s/step, {_gib(best.memory['total'])} of "
              f"{_gib(spec.memory_bytes)} per rank)")
    if runner is not None:
        reason += (f"; runner-up {runner.label}: {runner.time.total / best.time.total:.2f}x the step time, "
                   f"{_gib(runner.memory['total'])} per rank")
    asked = topology if isinstance(topology, str) else ("cpu" if topology is None else None)
    return PlanResult(rows, best, runner, reason, ctx, asked, calibration)


def quantized_variant(ctx: Context, best: PlanRow) -> Optional[PlanRow]:
    """The fastest of ``best`` with int8 gathers (stage 3), int8 reductions (stages 1-3), both, and (stage 3 on a
    machine of several islands) each of these with hpZ island copies (``secondary_shard``), if it fits and is
    predicted at least ``QUANT_MARGIN`` faster than ``best`` itself; else None. Quantization changes the numbers a
    model trains with (docs/compression.md), so it is taken only for a clear gain."""
    cfg = best.config
    if ctx.job.world < 2 or cfg.stage == 0 or cfg.reduce_dtype is not None or cfg.gather_quant != "none" or \
            cfg.reduce_quant != "none":
        return None
    options = [cfg.with_(reduce_quant="int8")]
    if cfg.stage == 3:
        options += [cfg.with_(gather_quant="int8"), cfg.with_(gather_quant="int8", reduce_quant="int8")]
        island = island_shard_size(ctx.placement)
        if island and not cfg.shard_size and not cfg.secondary_shard:  # hpZ: exact, but it costs memory
            options += [o.with_(secondary_shard=island) for o in [cfg, *options]]
    good = [r for r in (evaluate(ctx, c) for c in options)
            if r.fits and r.time.total <= best.time.total * (1 - QUANT_MARGIN)]
    return min(good, key=lambda r: r.time.total) if good else None


def nothing_fits(ctx: Context, rows: list[PlanRow]) -> str:
    """What would fit: more devices, a smaller micro-batch, CPU offload (:func:`offload_hint`)."""
    low = min(rows, key=lambda r: r.memory["total"])
    usable = 0.9 * ctx.device.memory_bytes
    msg = [f"no strategy fits {_gib(usable)} usable per rank on {ctx.placement.topology.name} ({ctx.device.name}): "
           f"the leanest, {low.label}, needs {_gib(low.memory['total'])} per rank "
           f"(sharded states {_gib(low.memory['persistent'])}, activations {_gib(low.memory['activations'])})."]
    sharded = low.memory["persistent"] * ctx.job.world  # scales as 1/N
    rest = low.memory["total"] - low.memory["persistent"]
    grads = low.memory["gradients"]
    if grads > 0.5 * usable:
        msg.append(f"The engine holds full gradient buffers (and fp32 copies of half gradients) during backward: "
                   f"{_gib(grads)} per rank whatever the world size; reduce_dtype='bf16' drops the copies.")
    if rest < usable:
        need = next((n for n in range(ctx.job.world, 4097) if sharded / n + rest <= usable), None)
        if need:
            msg.append(f"More devices: about {need} ranks ({-(-need // ctx.placement.topology.devices_per_node)} "
                       f"node(s) of {ctx.placement.topology.devices_per_node}) would hold the sharded states.")
    if ctx.job.micro_batch > 1 or low.memory["activations"] > 0.25 * usable:
        msg.append(f"Smaller micro-batch: activations take {_gib(low.memory['activations'])} at micro-batch "
                   f"{ctx.job.micro_batch}; they scale with it (raise accumulation to keep the global batch).")
    msg.append(offload_hint(ctx, low, usable))
    return " ".join(msg)


def offload_hint(ctx: Context, low: PlanRow, usable: float) -> str:
    """What ZeRO-Offload would leave on the device for the leanest row (``offload_optimizer``; stage 3 also
    ``offload_params``), evaluated as a row of its own, and the host memory it needs per rank."""
    cfg = low.config.with_(offload_optimizer=True, offload_params=low.config.stage == 3)
    row = evaluate(ctx, cfg)
    knobs = ", ".join(f"{k}=True" for k in ("offload_optimizer", "offload_params") if getattr(cfg, k))
    what = "the fp32 masters, gradient shards and optimizer state" + (" and the parameter shards"
                                                                       if cfg.offload_params else "")
    verdict = "fits" if row.memory["total"] <= usable else "still does not fit"
    return (f"CPU offload: {cfg.strategy} with {knobs} keeps {what} in host memory ({_gib(row.memory['on_host'])} "
            f"per rank of host RAM) and needs {_gib(row.memory['total'])} per rank on the device: {verdict}; it "
            "costs a CPU optimizer step and two shard copies per step.")


def recommend_for(module: nn.Module, optimizer_groups_or_none: Any, topology: Union[None, str, Topology],
                  world_size: int, global_batch: int, micro_batch: int, precision: str = "32-true",
                  **kw: Any) -> Recommendation:
    """For ``strategy=auto`` at setup: the registered strategy name, its kwargs, the reason and the table."""
    res = plan(module, topology, world_size, global_batch, micro_batch, precision, optimizer_groups_or_none, **kw)
    cfg = res.best.config
    return Recommendation(cfg.registered, cfg.kwargs(), res.reason, [r.to_dict() for r in res.rows],
                          res.best.time.total, res.context.rates.name, res.calibration)


def auto_policy(stage: int, accumulation: int, grad_bytes: float, free_bytes: Optional[float] = None,
                ring_gbps: Optional[float] = None) -> tuple[str, str]:
    """Accumulation policy by memory budget and links ("Design rules" 6)."""
    defer = "keep_unsharded_grads" if stage == 3 else "defer"
    if stage < 2:
        return "defer", f"zero{stage} keeps full gradients, so deferring costs no memory"
    if accumulation == 1:
        return ("per_micro_batch" if stage == 3 else "defer"), "accumulation 1: every micro-batch is a boundary"
    mib = grad_bytes / 2**20
    if free_bytes is not None and grad_bytes > 0.25 * free_bytes:
        return "per_micro_batch", (f"full gradients ({mib:.1f} MiB) exceed 25% of free memory "
                                   f"({free_bytes / 2**20:.0f} MiB): keep only gradient shards")
    if ring_gbps is not None and ring_gbps >= 200:
        return "per_micro_batch", (f"{ring_gbps:g} GB/s ring: the {accumulation - 1} extra reduce-scatters hide "
                                   f"behind backward, and holding only shards frees {mib:.1f} MiB")
    return defer, (f"full gradients ({mib:.1f} MiB) fit: one reduce-scatter per step instead of {accumulation}"
                   + (f" on a {ring_gbps:g} GB/s ring" if ring_gbps else ""))
