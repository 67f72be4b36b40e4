"""Calibration: measure, on the machine and the process groups a job will use, the rates the time model assumes.

Every rank of the job takes part at once (the measurements share the machine as training will: on CPU ranks the
cores, on GPUs the links), and the slowest rank's figure is kept (a step waits for it). What is measured, and how
``time.py`` uses it, is in ``profile.py``. Entry points:

* :func:`calibrate` (inside an initialized process group, every rank): measure what ``profile`` lacks for this model
  and job, return the completed profile (``strategy=auto`` with ``calibrate=True`` calls it at setup);
* :func:`calibrate_job` (no process group: the CLI's ``plan --calibrate`` and Python): load the cached profile for
  this machine, or start ``world`` processes on this machine that measure it, and save it (``profile.profile_path``).

Collectives run through the engine's own forms (``engine/comm``: the reduce-scatter by the path the engine takes on
this backend, the all-gather by its per-size form) and are recorded in the ledger under the tag ``calibrate``.
"""

from __future__ import annotations

import copy
import os
import platform
import socket
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.comm import collectives as C
from ..engine.comm.gather import all_gather_form
from ..engine.comm.reduce import AllToAllSum, BackendReduceScatter, PairExchange, reduce_form, sum_pieces_into
from .config import PRECISIONS, Job
from .placement import JobPlacement
from .profile import OPS, Curve, MachineProfile, library_versions, load_profile, profile_path
from .stats import TransformerShape, transformer_shape

TAG = "calibrate"
LADDER_MIN = 4096  # bytes: the first rung; each next one 4x
LADDER_MAX = 64 * 2**20  # the top rung, unless the plan issues larger collectives
MIN_TIMED_S = 0.02  # calls of one size are repeated until they take this long (at most MAX_CALLS)
MAX_CALLS = 20
COMPUTE_REPS = 9  # timed forward-backward passes of the model's compute, the median kept (3 moved it by 18% at world 4)
COMPUTE_BUDGET = 2**30  # bytes of block copies the compute measurement may hold on a CPU device (GPU: 10% free)


def ladder(max_bytes: float) -> list[int]:
    """4 KiB, 16 KiB, ... up to the first rung at or above ``max_bytes`` (at least 64 KiB)."""
    top = max(float(max_bytes), 4 * LADDER_MIN)
    out = [LADDER_MIN]
    while out[-1] < top:
        out.append(out[-1] * 4)
    return out


def machine_description(placement: JobPlacement, backend: str, threads: int) -> dict[str, Any]:
    """What a profile is of (and what its file name encodes): the device, the job's ranks and topology."""
    topo = placement.topology
    if backend == "nccl" and torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        device = cpu_model()
    return {"device": device, "backend": backend, "world": placement.world, "threads": threads,
            "topology": topo.name, "nodes": topo.num_nodes, "host_cpus": os.cpu_count()}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ============================================================================================ compute
def model_signature(module: nn.Module, shape: Optional[TransformerShape], job: Job) -> str:
    blocks = _blocks(module)
    name = type(blocks[0]).__name__ if blocks else type(module).__name__
    dims = (f"{shape.layers}x{shape.hidden}/{shape.heads}h/v{shape.vocab}/s{shape.seq}" if shape is not None else
            f"{sum(p.numel() for p in module.parameters())}p")
    return f"{name}:{dims}/mb{job.micro_batch}/{job.precision}"


def _blocks(module: nn.Module) -> Optional[nn.ModuleList]:
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    return max(lists, key=len) if lists else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _materialize(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A copy on ``device`` in ``dtype`` with small random weights (a meta module is fine: shapes are what count)."""
    m = copy.deepcopy(module)
    m = m.to_empty(device=device) if any(p.is_meta for p in m.parameters()) else m.to(device)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.02)
    return m.to(dtype)


def _median(values: list[float]) -> float:
    """The middle value (of an even count, the upper of the two middle ones)."""
    return sorted(values)[len(values) // 2]


def _timed(fn: Callable[[], Any], device: torch.device, reps: int = 3) -> float:
    """Median seconds of ``fn`` after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return _median(times)


def _fwd_bwd(forward: Callable[[], torch.Tensor], device: torch.device, autocast: Optional[torch.dtype],
             reps: int = 3) -> tuple[float, float]:
    """Median (forward, backward) seconds of ``forward()`` and the backward of its output."""

    def fwd() -> torch.Tensor:
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            out = forward()
        return out[0] if isinstance(out, (tuple, list)) else out

    out = fwd()
    out.backward(torch.ones_like(out))
    fw, bw = [], []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        out = fwd()
        _sync(device)
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        _sync(device)
        fw.append(t1 - t0)
        bw.append(time.perf_counter() - t1)
    return _median(fw), _median(bw)


def measure_compute(module: nn.Module, shape: Optional[TransformerShape], job: Job, device: torch.device,
                    matmul_flops: float) -> list[float]:
    """Forward and backward seconds of one micro-batch, measured as the model runs it with copies of one of its
    blocks: the input layer (token and position embeddings), a block per layer, the output layer
    (final LayerNorm, the vocabulary projection, the cross-entropy); then the backward of the loss. A model that is
    not a stack of blocks, or whose block does not take the hidden states alone, is counted by its FLOPs at
    ``matmul_flops``."""
    from .time import training_flops_per_token

    dtype, _, _ = PRECISIONS[job.precision]
    autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(job.precision)
    blocks = _blocks(module)
    if shape is not None and blocks is not None:
        b, s, h, v = job.micro_batch, shape.seq, shape.hidden, shape.vocab
        try:
            block = _materialize(blocks[0], device, dtype)
            block_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
            # distinct copies (as many as the layers, within a budget): the weights stream through the caches as the
            # model's own do; beyond the budget the copies repeat
            budget = (0.1 * torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else COMPUTE_BUDGET
            stack = [block] + [_materialize(blocks[0], device, dtype)
                               for _ in range(min(shape.layers, max(1, int(budget // max(block_bytes, 1)))) - 1)]
            ln = nn.LayerNorm(h).to(device, dtype)
            emb, pos = nn.Embedding(v, h).to(device, dtype), nn.Embedding(s, h).to(device, dtype)
            head = torch.randn(v, h, device=device, dtype=dtype, requires_grad=True)
            idx = torch.randint(v, (b, s), device=device)
            target = torch.randint(v, (b * s,), device=device)
            where = torch.arange(s, device=device)

            def forward() -> torch.Tensor:
                x = emb(idx) + pos(where)
                for layer in range(shape.layers):
                    x = stack[layer % len(stack)](x)
                    x = x[0] if isinstance(x, (tuple, list)) else x
                return F.cross_entropy(F.linear(ln(x), head).view(-1, v).float(), target)

            return list(_fwd_bwd(forward, device, autocast, COMPUTE_REPS))
        except (TypeError, RuntimeError, ValueError):
            pass  # a block with another signature: counted by FLOPs below
    psi = float(sum(p.numel() for p in module.parameters()))
    seq = shape.seq if shape is not None else job.seq
    t = training_flops_per_token(psi, shape) * job.micro_batch * seq / matmul_flops
    return [t / 3, 2 * t / 3]


def measure_matmul_flops(shape: Optional[TransformerShape], job: Job, device: torch.device) -> float:
    """Achieved FLOP/s of the model's MLP matmul: (micro-batch x seq, hidden) @ (hidden, 4 hidden)."""
    dtype, _, _ = PRECISIONS[job.precision]
    if dtype == torch.float32 and job.precision in ("bf16-mixed", "16-mixed"):
        dtype = torch.bfloat16 if job.precision == "bf16-mixed" else torch.float16
    m = (job.micro_batch * shape.seq) if shape is not None else 1024
    k = shape.hidden if shape is not None else 1024
    a = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(k, 4 * k, device=device, dtype=dtype)
    return 2 * m * k * 4 * k / _timed(lambda: a @ w, device)


def measure_optimizer(device: torch.device, numel: int = 2**21) -> float:
    """Seconds per fp32 element of an AdamW step (the engine steps flat shards)."""
    p = torch.zeros(numel, device=device, requires_grad=True)
    p.grad = torch.randn(numel, device=device)
    opt = torch.optim.AdamW([p], lr=1e-3)
    return _timed(opt.step, device) / numel


# ============================================================================================ collectives
def _runner(op: str, group: C.Group, nbytes: int, device: torch.device) -> Callable[[bool], Any]:
    """One call of ``op`` on ``group`` for a tensor of ``nbytes`` (fp32), by the engine's path; ``run(async_op)``."""
    world = C.get_world_size(group)
    n = max(world, nbytes // 4 // world * world)
    full = torch.randn(n, device=device)
    rank = C.get_rank(group)
    if op == "reduce":
        form = reduce_form("auto", group)
        shard = n // world
        out = torch.empty(shard, device=device)
        if isinstance(form, PairExchange):
            own = full[rank * shard:(rank + 1) * shard]

            def run(async_op: bool = False) -> Any:
                w = C.exchange_pair(out, full, group=group, async_op=async_op, tag=TAG)
                if not async_op:
                    out.add_(own)
                return w
        elif isinstance(form, AllToAllSum):
            pieces = torch.empty(n, device=device)

            def run(async_op: bool = False) -> Any:
                w = C.all_to_all(pieces, full, group=group, async_op=async_op, tag=TAG)
                if not async_op:
                    sum_pieces_into(pieces.view(world, -1), out)
                return w
        elif isinstance(form, BackendReduceScatter):
            def run(async_op: bool = False) -> Any:
                return C.reduce_scatter(out, full, group=group, async_op=async_op, tag=TAG)
        else:
            def run(async_op: bool = False) -> Any:
                return C.all_reduce(full, group=group, async_op=async_op, tag=TAG)
        return run
    if op == "gather":
        form = all_gather_form("auto", group, n * 4)
        mine = full.view(world, -1)[rank]
        return lambda async_op=False: form(full, mine, group, async_op, TAG)
    if op == "all_reduce":
        return lambda async_op=False: C.all_reduce(full, group=group, async_op=async_op, tag=TAG)
    if op == "all_to_all":
        out2 = torch.empty(n, device=device)
        return lambda async_op=False: C.all_to_all(out2, full, group=group, async_op=async_op, tag=TAG)
    if op == "broadcast":
        src = C.global_rank(group, 0)
        return lambda async_op=False: C.broadcast(full, src=src, group=group, async_op=async_op, tag=TAG)
    raise ValueError(f"unknown collective {op!r}; known: {OPS}")


def _time_calls(run: Callable[[bool], Any], group: C.Group, device: torch.device) -> float:
    """Seconds per call: one untimed call, then calls back to back until ``MIN_TIMED_S`` (at most ``MAX_CALLS``);
    every rank of the group calls as often (the count is agreed from the first timed call's maximum)."""
    run(False)
    C.barrier(group=group, tag=TAG)
    _sync(device)
    t = time.perf_counter()
    run(False)
    _sync(device)
    first = torch.tensor([time.perf_counter() - t])
    C.all_reduce(first, op="max", group=group, tag=TAG)
    calls = int(min(MAX_CALLS, max(1, MIN_TIMED_S // max(first.item(), 1e-6))))
    batches = []
    for _ in range(3):
        C.barrier(group=group, tag=TAG)
        t = time.perf_counter()
        for _ in range(calls):
            run(False)
        _sync(device)
        batches.append((time.perf_counter() - t) / calls)
    return _median(batches)


def measure_curve(op: str, group: C.Group, sizes: list[int], device: torch.device) -> Curve:
    return Curve(list(sizes), [_time_calls(_runner(op, group, s, device), group, device) for s in sizes])


def monotone(seconds: list[float]) -> list[float]:
    """A larger call never takes less time: each rung at most the next one's (noise on small sizes)."""
    out = list(seconds)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def measure_overlap(group: C.Group, device: torch.device, nbytes: int = 4 * 2**20) -> float:
    """The share of a gradient reduction hidden behind compute when both run at once: (alone + alone - together) /
    the shorter of the two, in [0, 1]."""
    run = _runner("reduce", group, nbytes, device)
    a = torch.randn(256, 512, device=device)
    w = torch.randn(512, 2048, device=device)
    t_comm = _time_calls(run, group, device)
    t_mm = _timed(lambda: a @ w, device)
    reps = max(1, int(t_comm / max(t_mm, 1e-6)))

    def compute() -> None:
        for _ in range(reps):
            a @ w

    t_c = _timed(compute, device)
    C.barrier(group=group, tag=TAG)
    _sync(device)
    t = time.perf_counter()
    work = run(True)
    compute()
    if work is not None:
        work.wait()
    _sync(device)
    t_both = time.perf_counter() - t
    hidden = (t_c + t_comm - t_both) / max(min(t_c, t_comm), 1e-9)
    return float(min(1.0, max(0.0, hidden)))


# ============================================================================================ the engine's own cost
ENGINE_PROBE = (8, 40)  # layers of the probe model (a stack of tiny Linear layers): the slope between the two
WIDE = 256  # the probe's width for what grows with a bucket's bytes
UNIT_PROBE = (1, 4)  # copies of the model's own block in the stage-3 unit probe (the slope between the two)
UNIT_BUDGET_S = 0.25  # seconds of timed steps each unit-probe run takes at least (5 steps at least, MAX_STEPS at most)
MAX_STEPS = 40


def _engine_step_s(name: Optional[str], model: nn.Module, x: torch.Tensor, device: torch.device, steps: int,
                   warmup: int, tuning: Optional[dict] = None, around_step: bool = False,
                   group: C.Group = None, budget_s: float = 0.0) -> tuple[float, float, list[int]]:
    """(median seconds of one training step, collectives per step outside calibration's own, full bytes of each
    bucket) of ``model`` on input ``x`` under the engine at ``name``'s stage (zero0: ``defer``; zero3:
    ``per_micro_batch``; ``around_step``: its root unit gathered around the step, as the strategy does), or without
    an engine (``None``: forward and backward alone, the optimizer priced per element elsewhere); after ``warmup``
    untimed steps (``budget_s``: and more than ``steps`` timed ones, up to :data:`MAX_STEPS`, while they take less
    than that in all). The loss is the mean square of the output. ``group``: the ranks the engine shards over (None:
    every rank)."""
    from ..engine.comm.groups import Groups
    from ..engine.engine import ShardEngine
    from ..options import options_for

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opts = {"zero0": {"accumulation": "defer"}, "zero3": {"accumulation": "per_micro_batch", "tuning": tuning or {}}}
    engine = ShardEngine(model, [opt], options_for(name, **opts[name]), Groups(shard=group)) if name else None
    hooks = []
    if around_step and engine is not None and engine.controller is not None:
        ctl = engine.controller
        hooks = [model.register_forward_pre_hook(lambda m, a: ctl.step_pre_forward()),
                 model.register_forward_hook(lambda m, a, out: ctl.step_post_forward(out))]

    def step() -> None:
        if engine is not None:
            engine.pre_backward()
        out = model(x)
        (out[0] if isinstance(out, (tuple, list)) else out).float().square().mean().backward()
        if engine is not None:
            engine.post_backward()
            engine.prepare_step(opt)
            opt.step()
            engine.finish_step(opt)
        else:
            model.zero_grad(set_to_none=True)

    try:
        for _ in range(warmup - 1):
            step()
        if budget_s > 0:  # short steps: more of them, the same count on every rank of the group
            _sync(device)
            t = time.perf_counter()
            step()
            _sync(device)
            want = torch.tensor([min(MAX_STEPS, max(steps, budget_s / max(time.perf_counter() - t, 1e-6)))],
                                dtype=torch.float64)
            if C.get_world_size(group) > 1:
                C.all_reduce(want, op="max", group=group, tag=TAG)
            steps = int(want.item())
        mark = C.LEDGER.mark()
        seconds = _timed(step, device, steps)  # one more untimed step, then the median of ``steps``
        calls = sum(e.tag != TAG and e.op != "barrier" for e in C.LEDGER.since(mark)) / (steps + 1)
        sizes = [b.store.full_bytes for b in engine.buckets] if engine is not None else []
    finally:
        for h in hooks:
            h.remove()
        if engine is not None:
            engine.remove_hooks()
    return seconds, calls, sizes


def _probe_step_s(name: Optional[str], layers: int, device: torch.device, steps: int = 7, width: int = 16,
                  group: C.Group = None) -> tuple[float, float, int]:
    """(median seconds of one step, collectives per step, bucket operations per step) of a stack of ``layers`` tiny
    Linear layers under the engine at ``name``'s stage (zero3: one unit per layer) sharded over ``group`` (None:
    every rank), or without an engine (``None``: forward and backward alone)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
    seconds, calls, sizes = _engine_step_s(name, model, torch.randn(4, width, device=device), device, steps, 2,
                                           {"min_unit_mb": 0.0}, group=group)
    # the bucket operations the engine ran, with or without a collective (a group of one rank issues none):
    # zero3 gathers each unit's bucket in forward and again in backward and reduces it; zero0 reduces its bucket
    return seconds, calls, (3 if name == "zero3" else 1) * len(sizes)


def measure_engine_overhead(device: torch.device, solo: C.Group, repeats: int = 3) -> tuple[float, float, float]:
    """The median over ``repeats`` of :func:`engine_overhead_once` (each figure on its own)."""
    runs = [engine_overhead_once(device, solo) for _ in range(repeats)]
    return tuple(_median([r[i] for r in runs]) for i in range(3))  # type: ignore[return-value]


def engine_overhead_once(device: torch.device, solo: C.Group) -> tuple[float, float, float]:
    """The engine's own cost beyond compute, from a probe model of small Linear layers at two depths (the slope
    cancels what does not grow with them) and two widths, all ranks at once:

    * per parameter tensor per step: zero0 (one bucket: its hooks, copies and the flat optimizer step) against the
      same layers' forward and backward alone, each rank's engine sharding over ``solo`` (a group of that rank
      alone: every rank works as in training, sharing the machine, and no collective runs);
    * per bucket operation (a unit's gather or a bucket's reduction): zero3 with one unit per layer (each gathered
      in forward and in backward and reduced once) against zero0, *with* the fixed cost of the collective each
      operation issues, as the engine meets it (launched, waited, while the ranks take turns on the machine): the
      time model prices a bucket operation's collective by its bytes only (``time.Calibrated``). At world 1 no
      collective runs: what is left is the hooks and bookkeeping;
    * per byte of a bucket operation: zero3 against zero0 at the deeper depth and a larger width, on ``solo`` too:
      the copies in and out of flat buffers. A collective's growth with its bytes is its curve's
      (``time.Calibrated``); measured on the world group, this figure would be what is left of the step after
      subtracting the curves, smaller than their noise."""
    (k1, k2), tensors = ENGINE_PROBE, 2  # weight and bias per layer
    plain = [_probe_step_s(None, k, device)[0] for k in (k1, k2)]
    alone = {(name, k, w): _probe_step_s(name, k, device, width=w, group=solo)
             for name, k, w in (("zero0", k1, 16), ("zero0", k2, 16), ("zero3", k2, 16), ("zero0", k2, WIDE),
                                ("zero3", k2, WIDE))}
    per_tensor = (((alone["zero0", k2, 16][0] - plain[1]) - (alone["zero0", k1, 16][0] - plain[0]))
                  / (tensors * (k2 - k1)))
    z0 = [_probe_step_s("zero0", k, device) for k in (k1, k2)]
    z3 = [_probe_step_s("zero3", k, device) for k in (k1, k2)]
    ops = (z3[1][2] - z3[0][2]) - (z0[1][2] - z0[0][2])
    small, wide = 4 * (16 * 16 + 16), 4 * (WIDE * WIDE + WIDE)  # bytes of one unit's bucket
    extra = (z3[1][0] - z3[0][0]) - (z0[1][0] - z0[0][0])
    per_op = max(0.0, extra / max(ops, 1))
    # the same depth with wider layers, one rank per group: what grows with a bucket's bytes
    grown = ((alone["zero3", k2, WIDE][0] - alone["zero0", k2, WIDE][0])
             - (alone["zero3", k2, 16][0] - alone["zero0", k2, 16][0]))
    per_byte = max(0.0, grown / max(alone["zero3", k2, 16][2] * (wide - small), 1))
    return per_op, max(0.0, per_tensor), per_byte


def _stack_step_s(name: str, block: nn.Module, depth: int, shape: TransformerShape, job: Job,
                  device: torch.device, comm: Callable[[str, float], float]) -> tuple[float, float, int]:
    """(median seconds of one step, seconds of its bucket operations' collectives by their bytes, bucket operations
    per step) of ``depth`` copies of the model's own block at the job's micro-batch, under the engine at ``name``'s
    stage with its default units (zero3) or its one bucket (zero0). ``comm(op, nbytes)``: a collective's seconds
    by its bytes, its fixed cost left out (0 on one rank)."""
    torch.manual_seed(0)
    dtype = PRECISIONS[job.precision][0]
    model = nn.Sequential(*[_materialize(block, device, dtype) for _ in range(depth)])
    x = torch.randn(job.micro_batch, shape.seq, shape.hidden, device=device, dtype=dtype)
    seconds, _, sizes = _engine_step_s(name, model, x, device, 5, 1, around_step=True, budget_s=UNIT_BUDGET_S)
    if name == "zero3":  # each unit gathered in forward and in backward, and reduced once
        return seconds, sum(2 * comm("gather", n) + comm("reduce", n) for n in sizes), 3 * len(sizes)
    return seconds, sum(comm("all_reduce", n) for n in sizes), len(sizes)


def measure_unit_ops(module: nn.Module, shape: Optional[TransformerShape], job: Job, device: torch.device,
                     comm: Callable[[str, float], float], repeats: int = 3) -> Optional[float]:
    """The engine's seconds per stage-3 bucket operation (a unit's gather or reduction) on this model's own blocks at
    its micro-batch: zero3 against zero0 on stacks of :data:`UNIT_PROBE` copies of its block (the slope cancels the
    root unit and the step), less the collectives' growth with bytes (``time.Calibrated`` prices that by the curves).
    It holds what a unit costs beyond its bytes: hooks, copies into and out of flat buffers, and the compute the
    gathered-and-freed parameters slow down, which a probe of tiny layers does not show. None: the model is not a
    stack of blocks that take the hidden states alone (the probe's per-operation cost is used instead). The median of
    ``repeats`` such figures, each from its own four runs (a single one moves by half its value when ranks share
    cores)."""
    blocks = _blocks(module)
    if shape is None or blocks is None:
        return None
    (k1, k2) = UNIT_PROBE
    figures = []
    for _ in range(repeats):
        try:
            runs = {(name, k): _stack_step_s(name, blocks[0], k, shape, job, device, comm)
                    for name in ("zero0", "zero3") for k in UNIT_PROBE}
        except (TypeError, RuntimeError, ValueError):
            return None
        slope = {name: [b - a for a, b in zip(runs[name, k1], runs[name, k2])] for name in ("zero0", "zero3")}
        extra = (slope["zero3"][0] - slope["zero3"][1]) - (slope["zero0"][0] - slope["zero0"][1])
        figures.append(max(0.0, extra / max(slope["zero3"][2], 1)))
    return _median(figures)


# ============================================================================================ the whole
def group_kinds(placement: JobPlacement, shard_sizes: list[int]) -> dict[str, list[list[int]]]:
    """``{"<ranks>/<link class>": rank lists}`` of the groups the candidates use: the world and, per hybrid shard
    size, its shard groups and replicate groups (every rank in one group of each kind)."""
    n = placement.world
    kinds: dict[str, list[list[int]]] = {}
    if n > 1:
        kinds[f"{n}/{placement.ring(range(n)).link_class}"] = [list(range(n))]
    for s in sorted(set(shard_sizes)):
        if 1 < s < n and n % s == 0:
            shard = [list(range(k, k + s)) for k in range(0, n, s)]
            repl = [list(range(k, n, s)) for k in range(s)]
            for lists in (shard, repl):
                ring = min((placement.ring(r) for r in lists), key=lambda r: r.gbps)
                kinds.setdefault(f"{len(lists[0])}/{ring.link_class}", lists)
    return kinds


def lacks(profile: MachineProfile, sig: str, kinds: list[str], top: int, world: int) -> dict[str, str]:
    """What ``profile`` lacks for the model of signature ``sig`` on the groups ``kinds`` with collectives up to ``top``
    bytes, in a world of ``world`` ranks: ``{item: what it is, in words}`` (:func:`calibrate` measures the items,
    :func:`needs` says the words)."""
    out = {}
    if not profile.matmul_flops:
        out["matmul_flops"] = "the matmul rate"
    if not profile.optimizer_s_per_element:
        out["optimizer"] = "the optimizer step"
    if sig not in profile.compute:
        out["compute"] = "this model's compute"
    if profile.engine_s_per_call is None:
        out["engine"] = "the engine's own cost"
    if sig not in profile.unit_ops:
        out["unit_ops"] = "the engine's cost on this model's units"
    if profile.overlap is None and world > 1:
        out["overlap"] = "the overlap"
    for kind in kinds:
        for op in OPS:
            if (c := profile.collectives.get(f"{op}/{kind}")) is None or c.sizes[-1] < top:
                out[f"{op}/{kind}"] = f"collectives on {kind}"
    return out


def calibrate(module: nn.Module, job: Job, placement: JobPlacement, device: torch.device,
              profile: Optional[MachineProfile], max_bytes: float, shard_sizes: tuple[int, ...] = ()) -> MachineProfile:
    """Every rank: measure what ``profile`` (None: a new one) lacks for this model, job and groups; return it."""
    t0 = time.perf_counter()
    backend = C.backend() if C.is_initialized() else ("nccl" if device.type == "cuda" else "gloo")
    if profile is None:
        profile = MachineProfile(machine_description(placement, backend, torch.get_num_threads()), library_versions(),
                                 created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    shape = transformer_shape(module, job.seq if job.seq > 1 else None)
    sig = model_signature(module, shape, job)
    world = placement.world
    measured: dict[str, Any] = {}
    sizes = ladder(max_bytes)
    kinds = group_kinds(placement, list(shard_sizes))
    todo = lacks(profile, sig, list(kinds), sizes[-1], world)
    if world > 1:
        C.barrier(tag=TAG)
    if "matmul_flops" in todo:
        measured["matmul_flops"] = measure_matmul_flops(shape, job, device)
    if "compute" in todo:
        measured["compute"] = measure_compute(module, shape, job, device, measured.get("matmul_flops")
                                              or profile.matmul_flops)
    if "optimizer" in todo:
        measured["optimizer"] = measure_optimizer(device)
    curves: dict[str, Curve] = {}
    for kind, lists in kinds.items():
        groups = [C.new_group(r, f"calibrate/{kind}") for r in lists]  # collective: every rank makes every group
        me = next(g for g, r in zip(groups, lists) if C.get_rank() in r)
        for op in OPS:
            if f"{op}/{kind}" in todo:
                curves[f"{op}/{kind}"] = measure_curve(op, me, sizes, device)
        if "overlap" in todo and "overlap" not in measured and kind.startswith(f"{world}/"):
            measured["overlap"] = measure_overlap(me, device)
    if "engine" in todo:
        solo = None  # each rank's group of itself alone (collective: every rank makes every group)
        if world > 1:
            solo = [C.new_group([r], "calibrate/solo") for r in range(world)][C.get_rank()]
        measured["engine"] = list(measure_engine_overhead(device, solo))
    if "unit_ops" in todo:
        have = {**profile.collectives, **curves}

        def comm(op: str, nbytes: float) -> float:  # a bucket operation's collective by its bytes (time.Calibrated)
            c = next((c for k, c in have.items() if k.startswith(f"{op}/{world}/")), None) if world > 1 else None
            return max(0.0, c(nbytes) - c.latency_s) if c is not None else 0.0

        unit = measure_unit_ops(module, shape, job, device, comm)
        measured["unit_ops"] = -1.0 if unit is None else unit
    # the slowest rank's figure (a step waits for it); FLOP/s: the slowest rank's too (the smallest)
    values = [*(curve_t for c in curves.values() for curve_t in c.seconds), *measured.get("compute", []),
              measured.get("optimizer", 0.0), -measured.get("matmul_flops", 0.0), -measured.get("overlap", 1.0),
              *measured.get("engine", []), measured.get("unit_ops", 0.0)]
    if world > 1 and values:
        v = torch.tensor(values, dtype=torch.float64)
        C.all_reduce(v, op="max", group=None, tag=TAG)
        values = v.tolist()
    it = iter(values)
    for key, c in curves.items():
        profile.collectives[key] = Curve(c.sizes, monotone([next(it) for _ in c.seconds]))
    if "compute" in measured:
        profile.compute[sig] = [next(it), next(it)]
    opt, mm, ov = next(it), -next(it), -next(it)
    if "optimizer" in measured:
        profile.optimizer_s_per_element = opt
    if "matmul_flops" in measured:
        profile.matmul_flops = mm
    if "overlap" in measured:
        profile.overlap = ov
    if "engine" in measured:
        profile.engine_s_per_call, profile.engine_s_per_tensor, profile.engine_s_per_byte = next(it), next(it), next(it)
    unit = next(it)
    if "unit_ops" in measured:
        profile.unit_ops[sig] = None if unit < 0 else unit
    profile.calibration_s += time.perf_counter() - t0
    return profile


def needs(profile: Optional[MachineProfile], module: nn.Module, job: Job, placement: JobPlacement,
          max_bytes: float, shard_sizes: tuple[int, ...] = ()) -> list[str]:
    """What ``profile`` lacks for this model, job and groups (empty: nothing to measure)."""
    if profile is None:
        return ["everything"]
    shape = transformer_shape(module, job.seq if job.seq > 1 else None)
    todo = lacks(profile, model_signature(module, shape, job), list(group_kinds(placement, list(shard_sizes))),
                 ladder(max_bytes)[-1], placement.world)
    return list(dict.fromkeys(todo.values()))


def _worker(rank: int, world: int, port: int, threads: int, backend: str, module: nn.Module, job: Job,
            placement: JobPlacement, profile: Optional[MachineProfile], max_bytes: float, shard_sizes: tuple[int, ...],
            out: str) -> None:
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    C.init_process_group(backend, rank, world, f"tcp://127.0.0.1:{port}", timedelta(minutes=10))
    try:
        prof = calibrate(module, job, placement, device, profile, max_bytes, shard_sizes)
        if rank == 0:
            prof.save(Path(out))
    finally:
        C.destroy_process_group()


def calibrate_job(module: nn.Module, job: Job, placement: JobPlacement, max_bytes: float,
                  shard_sizes: tuple[int, ...] = (), path: Optional[Path] = None, threads: Optional[int] = None,
                  again: bool = False) -> tuple[MachineProfile, Path, str]:
    """The profile of this machine for this job, measured by ``job.world`` processes started here (one per device)
    unless the cached one (``path``, default :func:`~.profile.profile_path`) already has what the job needs.
    Returns ``(profile, path, what happened)``. Only this node's devices: a job of several nodes is calibrated
    inside the job (``strategy=auto`` with ``calibrate=True``)."""
    gpu = all(placement.topology.devices[d].kind != "cpu" for d in placement.devices)
    backend = "nccl" if gpu else "gloo"
    if gpu and torch.cuda.device_count() < placement.world:
        raise ValueError(f"calibrating {placement.world} GPU ranks needs {placement.world} GPUs here, found "
                         f"{torch.cuda.device_count()}: calibrate on the machine the job runs on, or plan without "
                         "--calibrate (the nominal model)")
    if placement.topology.num_nodes > 1:
        raise ValueError("plan --calibrate measures this machine: a job of several nodes is calibrated inside the "
                         "job (strategy=auto with calibrate=true)")
    threads = threads or (1 if backend == "gloo" else torch.get_num_threads())
    machine = machine_description(placement, backend, threads)
    path = Path(path) if path else profile_path(machine)
    prof, why = (None, "measured again (asked)") if again else load_profile(path)
    missing = needs(prof, module, job, placement, max_bytes, shard_sizes)
    if not missing:
        return prof, path, f"reused {path}"
    t = time.perf_counter()
    if placement.world == 1:  # here, with the job's threads
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            prof = calibrate(module, job, placement, torch.device("cuda", 0) if gpu else torch.device("cpu"), prof,
                             max_bytes, shard_sizes)
        finally:
            torch.set_num_threads(before)
        prof.save(path)
    else:
        import torch.multiprocessing as mp

        method = "fork" if platform.system() == "Linux" and not gpu else "spawn"
        mp.start_processes(_worker, args=(placement.world, free_port(), threads, backend, module, job, placement,
                                          prof, max_bytes, tuple(shard_sizes), str(path)),
                           nprocs=placement.world, start_method=method)
        prof, err = load_profile(path)
        if prof is None:
            raise RuntimeError(f"calibration wrote no usable profile at {path}: {err}")
    return prof, path, (f"measured {', '.join(missing)} in {time.perf_counter() - t:.1f} s "
                        f"({why or 'the cached profile lacked it'}); saved {path}")


def calibrate_in_job(module: nn.Module, job: Job, placement: JobPlacement, device: torch.device, max_bytes: float,
                     shard_sizes: tuple[int, ...] = (),
                     path: Optional[Path] = None) -> tuple[MachineProfile, Path, str]:
    """Every rank of a running job (``strategy=auto`` with ``calibrate=True``): rank 0's cached profile if it has what
    this job needs, else measured here by every rank on the job's own groups and saved by rank 0."""
    world = C.get_world_size() if C.is_initialized() else 1
    backend = C.backend() if world > 1 else ("nccl" if device.type == "cuda" else "gloo")
    machine = machine_description(placement, backend, torch.get_num_threads())
    path = Path(path) if path else profile_path(machine)
    loaded, why = load_profile(path) if C.get_rank() == 0 or world == 1 else (None, "")
    if world > 1:
        loaded, why = C.broadcast_object((loaded, why), tag=TAG)
    missing = needs(loaded, module, job, placement, max_bytes, shard_sizes)
    if not missing:
        return loaded, path, f"reused {path}"
    t = time.perf_counter()
    prof = calibrate(module, job, placement, device, loaded, max_bytes, shard_sizes)
    if world == 1 or C.get_rank() == 0:
        prof.save(path)
    return prof, path, (f"measured {', '.join(missing)} in {time.perf_counter() - t:.1f} s "
                        f"({why or 'the cached profile lacked it'}); saved {path}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
