"""Evaluate strategy configurations for one model, job and topology: memory, traffic, time per step.

One :class:`PlanRow` per configuration; ``recommend.py`` picks among them and the CLI prints them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

from .config import Job, StrategyConfig
from .hardware import DeviceSpec
from .layout import OptimizerGroups, default_groups, plan_layout
from .memory import fits, peak_bytes, state_bytes, zero_paper_bytes
from .placement import JobPlacement
from .stats import TransformerShape, activation_bytes, transformer_shape
from .time import DEFAULT_BUS_EFFICIENCY, DEFAULT_EFFICIENCY, Calibrated, Nominal, StepTime, step_time
from .traffic import buffer_groups, by_link_class, step_collectives


@dataclass
class PlanRow:
    config: StrategyConfig
    memory: dict[str, int]  # peak breakdown per rank (memory.peak_bytes)
    states: dict[str, int]  # model states right before the step (memory.state_bytes)
    zero_paper: float  # the ZeRO paper's model-state bytes for comparison
    fits: bool
    traffic: dict[str, float]  # wire bytes per rank per step by link class
    time: StepTime
    tokens_per_s: float
    rings: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.config.label

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.config.registered, "label": self.label, "kwargs": self.config.kwargs(),
                "memory_per_rank": self.memory, "model_states": self.states, "zero_paper_bytes": self.zero_paper,
                "fits": self.fits, "bytes_per_step": self.traffic, "step_time_s": self.time.total,
                "compute_s": self.time.compute, "exposed_comm_s": self.time.exposed_comm, "engine_s": self.time.engine,
                "link_busy_s": self.time.total_comm, "tokens_per_s": self.tokens_per_s,
                "rings": {k: {"ranks": r.ranks, "gbps": r.gbps, "class": r.link_class} for k, r in self.rings.items()}}


@dataclass
class Context:
    """Everything that does not change between candidate configurations."""

    module: nn.Module
    groups: OptimizerGroups
    placement: JobPlacement
    job: Job
    device: DeviceSpec
    shape: Optional[TransformerShape]
    activations: float
    psi: float
    buffers: list[int]
    efficiency: float = DEFAULT_EFFICIENCY
    bus_efficiency: float = DEFAULT_BUS_EFFICIENCY
    rates: Any = None  # time.Nominal, or time.Calibrated with a machine profile

    @property
    def calibrated(self) -> bool:
        return isinstance(self.rates, Calibrated)


def make_context(module: nn.Module, groups: Optional[OptimizerGroups], placement: JobPlacement, job: Job,
                 device: DeviceSpec, activations: Optional[float] = None, efficiency: float = DEFAULT_EFFICIENCY,
                 bus_efficiency: float = DEFAULT_BUS_EFFICIENCY, profile: Any = None) -> Context:
    """``profile``: a :class:`~.profile.MachineProfile` of the machine the job runs on (the calibrated time model);
    None: the nominal one."""
    shape = transformer_shape(module, job.seq if job.seq > 1 else None)
    if activations is None:
        activations = activation_bytes(shape, job.micro_batch, job.act_bytes) if shape is not None else 0.0
    rates: Any = Nominal(device.peak_flops, efficiency, bus_efficiency, device.memory_bw)
    if profile is not None:
        from .calibrate import model_signature

        sig = model_signature(module, shape, job)
        measured = profile.compute.get(sig)
        rates = Calibrated(profile, tuple(measured) if measured else None, rates, profile.unit_ops.get(sig))
    return Context(module, groups if groups is not None else default_groups(module), placement, job, device, shape,
                   activations, float(sum(p.numel() for p in module.parameters())),
                   buffer_groups(module, job.param_dtype if job.param_dtype.is_floating_point else None),
                   efficiency, bus_efficiency, rates)


def collectives_of(ctx: Context, cfg: StrategyConfig) -> tuple[Any, list]:
    """The engine's layout for ``cfg`` and every collective of one optimizer step."""
    job = ctx.job
    layout = plan_layout(ctx.module, ctx.groups, cfg.stage, cfg.shard_size or job.world, cfg.bucket_mb,
                         cfg.granularity, cfg.wrap_classes if cfg.wrap_classes is not None else "auto",
                         cfg.min_params, param_dtype=job.param_dtype, min_unit_mb=cfg.min_unit_mb)
    return layout, step_collectives(layout, cfg, job, ctx.buffers, num_optimizers=len(ctx.groups))


def evaluate(ctx: Context, cfg: StrategyConfig) -> PlanRow:
    job = ctx.job
    shard = cfg.shard_size or job.world
    layout, colls = collectives_of(ctx, cfg)
    rings = ctx.placement.groups(cfg.shard_size, cfg.secondary_shard)
    memory = peak_bytes(layout, cfg, job, int(ctx.activations))
    states = state_bytes(layout, cfg, job)
    params = list(ctx.module.parameters())
    trainable = float(sum(p.numel() for p in params if p.requires_grad))
    t = step_time(layout, cfg, job, colls, rings, ctx.psi, ctx.shape, ctx.rates, trainable, len(params))
    traffic = by_link_class(colls, {k: r.link_class for k, r in rings.items()})
    paper = zero_paper_bytes(ctx.psi, shard, cfg.stage, job.precision, job.optimizer)
    return PlanRow(cfg, memory, states, paper, fits(memory["total"], ctx.device.memory_bytes), traffic, t,
                   job.tokens_per_step / t.total if t.total > 0 else float("inf"), rings)


def island_shard_size(placement: JobPlacement) -> Optional[int]:
    """Hybrid layout of the job: ranks per island (or per node), when the job spans several equal ones; None
    when neither gives more than one rank per shard group and more than one group."""
    topo = placement.topology
    keys = [(topo.devices[d].node, topo.island_index(d)) for d in placement.devices]
    sizes = [keys.count(k) for k in dict.fromkeys(keys)]
    if len(sizes) > 1 and len(set(sizes)) == 1 and sizes[0] > 1:
        return sizes[0]
    # islands of one device (PCIe-only GPUs): shard inside each node instead, replicate across nodes
    nodes = [topo.devices[d].node for d in placement.devices]
    per_node = [nodes.count(n) for n in dict.fromkeys(nodes)]
    if len(per_node) > 1 and len(set(per_node)) == 1:
        return per_node[0]
    return None


def candidates(module: nn.Module, placement: JobPlacement, accumulation: int) -> list[StrategyConfig]:
    """Every registered strategy with each accumulation policy that differs at this accumulation count. On CPU
    devices (gloo) the rows reduce-scatter as the engine does there (``reduce_scatter_via="auto"``: an all-to-all
    of each bucket and a sum of the pieces)."""
    rows = _candidates(module, placement, accumulation)
    if placement.devices and all(placement.topology.devices[d].kind == "cpu" for d in placement.devices):
        rows = [r if r.stage == 0 else r.with_(reduce_scatter_via="all_to_all") for r in rows]
    return rows


def _candidates(module: nn.Module, placement: JobPlacement, accumulation: int) -> list[StrategyConfig]:
    multi = accumulation > 1
    has_blocks = any(isinstance(m, nn.ModuleList) and len(m) for m in module.modules())
    out = [StrategyConfig("zero0", 0), StrategyConfig("zero1", 1), StrategyConfig("zero2", 2)]
    if multi:
        out.append(StrategyConfig("zero2", 2, "per_micro_batch"))
    policies3 = ["per_micro_batch", "keep_unsharded_grads", "keep_params"] if multi else ["per_micro_batch"]
    out += [StrategyConfig("zero3", 3, p) for p in policies3]
    if has_blocks:
        for reshard in (True, False):
            out += [StrategyConfig("fsdp_shard", 3, p, reshard_after_forward=reshard) for p in policies3
                    if reshard or p != "keep_params"]
    s = island_shard_size(placement) if placement.world > 1 else None
    if s and s > 1:
        out += [StrategyConfig("zero2", 2, "defer", shard_size=s),
                StrategyConfig("zero3", 3, policies3[0], shard_size=s)]
        if has_blocks:
            out += [StrategyConfig("fsdp_shard", 3, p, shard_size=s) for p in policies3]
    return out


