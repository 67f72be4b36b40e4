"""DeepSpeed ZeRO-1/2/3 as peers in the peak suite (``ds_zero1`` / ``ds_zero2`` / ``ds_zero3``, opt-in): one rank's
training under ``deepspeed.initialize``, measured as ``measure.py``'s Meter measures the Lightning variants.

Why no Lightning Trainer: Lightning's ``DeepSpeedStrategy.setup_environment`` raises on anything but a
``CUDAAccelerator`` ("The DeepSpeed strategy is only supported on CUDA GPUs", lightning 2.6). DeepSpeed itself runs
on CPU: its CPU accelerator (``DS_ACCELERATOR=cpu``, set here before the import) talks gloo when oneCCL is not
installed, and plain ZeRO with torch AdamW as the client optimizer compiles no op.

The same as the other variants: the model and its AdamW groups (``variants.make_module``: the LightningModule's
``training_step`` is the engine's forward, as Lightning's forward redirection does), the seed
(``seed_everything`` before the model is built), the data (``rank.make_data`` behind the DistributedSampler
Lightning would put in: shuffle, seed = the global seed, epoch 0), warmup + timed steps, 1 thread per rank, each rank
its own fresh interpreter (rank 0 starts the others, as Lightning's subprocess launcher does), the driver's malloc
environment, and what is measured: the baseline ``VmRSS`` and setup ``VmHWM`` when the engine is set up and no step
has run, then the high-water-mark reset; the training-window ``VmHWM`` at the end of the last timed step; step and
phase times (forward / backward incl. DeepSpeed's gradient reduction / ``engine.step``); the losses.

What differs, by DeepSpeed's design: its ZeRO optimizers allocate the AdamW state in ``deepspeed.initialize``
(``initialize_optimizer_states``), so the baseline contains it where the Lightning variants' does not (their AdamW
state appears at the first step, inside the training window); the whole-process peak is comparable either way.
Model state (reported beside the peak, not used for it) counts the tensors held at the last timed step after
backward: the module's parameters (stage 3: their partitions, plus the full data of those still gathered, i.e. the
persistent small ones), the fp32 master partitions DeepSpeed keeps apart from them, the gradients (``.grad`` and
DeepSpeed's partitioned gradient buffers) and the AdamW state; DeepSpeed's bucket buffers are not counted (like DDP's
reducer buckets). Wire bytes are the ZeRO formula (computed, not measured).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

from measure import (
    minor_faults,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    state_bytes,
    storage_bytes,
    write_rank_result,
)
from rank import make_data
from variants import deepspeed_config, make_module, model_param_bytes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_other_ranks(world: int) -> list[subprocess.Popen]:
    """In the process the driver started (rank 0): the rendezvous environment, then ranks 1..N-1 as fresh interpreters
    running this same command line; in those: nothing (their environment names their rank)."""
    if "LOCAL_RANK" in os.environ:
        return []
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world), RANK="0",
                      LOCAL_RANK="0")
    return [subprocess.Popen([sys.executable, *sys.argv], env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r)))
            for r in range(1, world)]


def held_model_state(engine: Any) -> dict[str, int]:
    """Params + master partitions + grads + AdamW state this rank holds (bytes, each storage once per kind)."""
    opt = engine.optimizer  # DeepSpeedZeroOptimizer (stage 1/2) or DeepSpeedZeroOptimizer_Stage3
    params = list(engine.module.parameters())
    held = [t for p in params for t in (p.data, getattr(p, "ds_tensor", None))]  # stage 3: empty data unless gathered
    master = list(getattr(opt, "single_partition_of_fp32_groups", None)
                  or getattr(opt, "fp32_partitioned_groups_flat", None) or [])
    grads = [p.grad for p in params] + [m.grad for m in master]
    for part in (getattr(opt, "averaged_gradients", None) or {}).values():
        grads += list(part or [])
    grads += [getattr(opt, "grads_in_partition", None), getattr(opt, "grad_partitions_flat_buffer", None)]
    out = {"params": storage_bytes(held), "master": storage_bytes(master), "grads": storage_bytes(grads),
           "optimizer_state": state_bytes(opt.optimizer.state)}
    out["total"] = sum(out.values())
    return out


def wire_formula(args: argparse.Namespace, variant: str, world: int) -> dict[str, Any]:
    """ZeRO's bytes on the wire per step per rank (ring): stage 1/2 reduce + gather 2(N-1)/N Psi, stage 3 3(N-1)/N."""
    stage, ring = int(variant[-1]), (world - 1) / world
    formula = (3 if stage == 3 else 2) * ring * model_param_bytes(args)
    return {"wire_bytes_per_step": formula, "wire_formula_bytes_per_step": formula,
            "wire_source": f"computed, not measured: {3 if stage == 3 else 2}(N-1)/N x param bytes (ZeRO stage "
                           f"{stage} formula)", "wire_detail": {}}


class Meter(SimpleNamespace):
    """The fields ``measure.write_rank_result`` reads from the Lightning Meter, filled by the loop below."""


def run_deepspeed(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as exc:  # an error row in the table, not a crash of the driver
        raise ImportError(f"{args.variant} needs DeepSpeed: pip install -c <(echo torch==2.13.0) -e "
                          f"'.[bench-deepspeed]' ({exc})") from exc
    import logging
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    world, variant = args.devices, args.variant
    children = launch_other_ranks(world)
    try:
        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, timeout=timedelta(minutes=5))
        rank = torch.distributed.get_rank()
        pl.seed_everything(args.seed, verbose=False)
        loader = make_data(args)
        sampler = DistributedSampler(loader.dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
        sampler.set_epoch(0)
        data = DataLoader(loader.dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
        module = make_module(args, variant)  # same seed on every rank: identical initial weights everywhere
        module.forward = module.training_step  # the engine's forward is the step, as in Lightning
        optimizer = module.configure_optimizers()
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer,
                                               config=deepspeed_config(args, variant), dist_init_required=False)
        meter = train(args, engine, data)
        write_rank_result(args, variant, SimpleNamespace(global_rank=rank, world_size=world), meter)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:
        for child in children:  # a rank that failed leaves no rank waiting for it
            child.kill()
        raise
    failed = [c.args for c in children if c.wait() != 0]
    if failed:
        raise RuntimeError(f"{len(failed)} DeepSpeed rank process(es) failed")


PHASES = ("forward", "backward_and_grad_sync", "optimizer_and_param_sync", "between_steps")


def _lap(m: Meter, name: str, timed: bool, mark: tuple[float, float]) -> tuple[float, float]:
    """Add the wall time since ``mark`` and its off-CPU part (wall - main-thread CPU, as ``measure.py``) to phase
    ``name`` of a timed step; the new mark."""
    now = (time.perf_counter(), time.thread_time())
    if timed:
        m.phase[name] += now[0] - mark[0]
        m.off_cpu[name] += (now[0] - mark[0]) - (now[1] - mark[1])
    return now


def train(args: argparse.Namespace, engine: Any, data: Any) -> Meter:
    """Warmup + timed steps; memory, times and losses as ``measure.make_callback``'s Meter takes them."""
    first, last = args.warmup, args.warmup + args.steps - 1
    m = Meter(step_times=[], losses=[], t_span0=0.0, t_span1=0.0, engine_s_per_step={},
              phase=dict.fromkeys(PHASES, 0.0), off_cpu=dict.fromkeys(PHASES, 0.0),
              wire=wire_formula(args, args.variant, engine.world_size))
    # train start: engine set up (parameters placed and partitioned, AdamW state allocated), no step yet
    m.baseline_rss, m.setup_peak_rss = rss_bytes(), peak_rss_bytes()
    m.hwm_reset = reset_peak_rss()
    end = (0.0, 0.0)
    for step, (x, y) in enumerate(data):
        if step > last:
            break
        timed = first <= step <= last
        t0 = time.perf_counter()
        mark = (t0, time.thread_time())
        if first < step <= last:  # since the last timed step ended (as measure.py's Meter)
            _lap(m, "between_steps", True, end)
        if step == first:
            m.t_span0, m.faults0 = t0, minor_faults()
        loss = engine((x, y), step)
        mark = _lap(m, "forward", timed, mark)
        engine.backward(loss)  # DeepSpeed reduces (stage 1) / reduce-scatters (2, 3) the gradients here
        mark = _lap(m, "backward_and_grad_sync", timed, mark)
        t = mark[0]
        if step == last:  # gradients reduced, before the update: the model state to report (its time taken out)
            m.model_state = held_model_state(engine)
            dt = time.perf_counter() - t
            t0 += dt
            m.t_span0 += dt
        mark = (time.perf_counter(), time.thread_time())
        engine.step()
        end = _lap(m, "optimizer_and_param_sync", timed, mark)
        now = end[0]
        m.losses.append(float(loss.detach()))
        if timed:
            m.step_times.append(now - t0)
        if step == last:
            m.t_span1, m.faults1 = now, minor_faults()
            m.peak_rss = peak_rss_bytes()
    return m
