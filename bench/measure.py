"""What one rank measures while it trains, and the per-rank result file it writes.

Measured per rank (no barrier in the timed loop): tokens/s from ``time.perf_counter`` at ``on_train_batch_start``
of the first timed step to ``on_train_batch_end`` of the last; optimizer-state and model-state bytes from the
tensors the rank holds (unique storages, so padding inside a storage counts); peak RSS (``VmHWM``, read at the end
of the timed steps); bytes on the wire per optimizer step per rank (see ``wire.py``).

Model state per rank = parameters + gradients + optimizer state (+ fp32 master / accumulators) actually held,
taken in ``on_before_optimizer_step`` of the last timed step (gradients reduced, before the update; the snapshot's
own time is taken out of the timing):
lightning_shard ``engine.memory_report()`` minus ``gathered_params`` (transient full parameters); FSDP2: the local
shards (``DTensor.to_local()``) of the parameters, of their gradients and of the optimizer state; DDP / ZeRO-R: the
parameter, ``.grad`` and optimizer tensors (DDP's reducer bucket buffers are not counted).

Peak suite only (``--suite peak``, ``bench_peak.py``): at ``on_train_start`` (strategy set up, model built and
sharded, optimizer constructed; no step taken, so no optimizer state yet) each rank records its resident set
(``VmRSS``, the baseline) and its high-water mark so far (``VmHWM``, the setup peak), then resets the high-water mark
to the current RSS (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0) so that the ``VmHWM`` read at the end of the
timed steps is the peak of the training window alone; the whole-process peak is the larger of the two. Where the
reset is refused, the training-window peak is the whole-process one (``hwm_reset: false`` in the result).

Engine phases (lightning_shard variants): the ``torch.profiler`` labels ``lightning_shard.<phase>`` the engine
emits, summed over ``--profile-steps`` extra steps run after the timed ones (the profiler's overhead stays out of
the timed steps), reported as seconds per step under the engine's method names (``post_backward``, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from variants import OURS, model_param_bytes, program_of
from wire import Counters, counting_allreduce_hook, wire_per_step

# JSON keys of ``engine_s_per_step``: the ShardEngine methods; their profiler label drops the leading underscore
ENGINE_PHASES = ("pre_backward", "post_backward", "prepare_step", "finish_step", "_leave_out_unused")
# ``labels_s_per_step`` (speed suite): every profiler range of these families, any variant, the per-module suffix
# FSDP2 adds (`` (fqn)``) dropped so that a label sums over modules: the engine's phases and collective launches /
# waits (``lightning_shard.*``, engine/labels.py), FSDP2's (``FSDP::*``), DDP's forward. (Not torch's
# ``Optimizer.step#...``: under Lightning's automatic optimization the step runs the closure, i.e. forward and
# backward, inside it for some strategies and not for others.)
LABEL_PREFIXES = ("lightning_shard.", "FSDP::", "DistributedDataParallel.")


# ============================================================================================ memory
def _status_bytes(key: str) -> Optional[int]:
    """A ``kB`` line of ``/proc/self/status`` (``VmHWM``, ``VmRSS``) in bytes; None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), falling back to getrusage."""
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def minor_faults() -> int:
    """Minor page faults of this process so far (``getrusage``): pages the kernel zero-filled or mapped on first touch,
    i.e. memory handed back to the OS and taken again (speed suite: per timed step)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rss_bytes() -> Optional[int]:
    """This process's resident set now (VmRSS)."""
    return _status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (``/proc/self/clear_refs`` value 5, Linux >= 4.0); False where refused."""
    before = _status_bytes("VmHWM")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    after = _status_bytes("VmHWM")
    return before is not None and after is not None and after <= before


MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def _local(t: Any) -> Any:
    """A DTensor's local shard; any other tensor as is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the storages behind ``tensors`` (DTensors: their local shard), each storage counted once."""
    import torch

    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        if torch.is_tensor(t):
            s = t.untyped_storage()
            seen[s.data_ptr() or id(s)] = s.nbytes()
    return sum(seen.values())


def state_bytes(*states: Any) -> int:
    """Bytes of the tensors in optimizer ``state`` dicts, each storage counted once (DTensors: local part)."""
    return storage_bytes(v for state in states for st in state.values() for v in st.values())


def held_model_state(trainer: Any, variant: str) -> dict[str, int]:
    """Params + grads + optimizer state (+ master/accumulators) this rank holds, in bytes; ``total`` sums them."""
    if variant in OURS:
        rep = trainer.strategy.engine.memory_report()
        out = {k: int(v) for k, v in rep.items() if k not in ("total", "padding_elements", "gathered_params")}
        out["total"] = sum(out.values())
        out["gathered_params_excluded"] = int(rep.get("gathered_params", 0))
        out["padding_elements"] = int(rep.get("padding_elements", 0))
        return out
    params = list({id(p): p for p in trainer.lightning_module.parameters()}.values())
    opt = trainer.optimizers[0]
    states = (opt.optim.state, opt.state) if variant == "zero_r" else (opt.state,)
    out = {"params": storage_bytes(params), "grads": storage_bytes(p.grad for p in params),
           "optimizer_state": state_bytes(*states)}
    out["total"] = sum(out.values())
    return out


# ============================================================================================ engine phases
def profiled_steps(args: argparse.Namespace, variant: str) -> int:
    """Steps run after the timed ones under the profiler: the lightning_shard variants (engine phases); in the speed
    suite every Lightning variant (the peers' own labels: FSDP2's ``FSDP::*``, DDP's forward, the optimizer step)."""
    return args.profile_steps if variant in OURS or getattr(args, "suite", None) == "speed" else 0


class EnginePhaseProfile:
    """Seconds per step inside each engine phase, from its ``torch.profiler`` label, over a window of steps."""

    def __init__(self) -> None:
        self.prof: Any = None

    def start(self) -> None:
        import torch

        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.prof.start()

    def stop(self, steps: int) -> dict[str, float]:
        self.prof.stop()
        total_us = {e.key: e.cpu_time_total for e in self.prof.key_averages()}  # inclusive CPU time, all calls
        self.prof = None
        self.labels = {}
        for key, us in total_us.items():
            if key.startswith(LABEL_PREFIXES):
                name = key.split(" (", 1)[0]
                self.labels[name] = self.labels.get(name, 0.0) + us / 1e6 / steps
        labels = {name: "lightning_shard." + name.lstrip("_") for name in ENGINE_PHASES}
        return {name: total_us[label] / 1e6 / steps for name, label in labels.items() if label in total_us}

    def close(self) -> None:
        """Stop a profiler still running (training ended early or raised), so that none outlives the run."""
        if self.prof is not None:
            self.prof.stop()
            self.prof = None


# ============================================================================================ callback
def make_callback(args: argparse.Namespace, variant: str, counters: Counters):
    import lightning.pytorch as pl

    from lightning_shard.engine.comm.collectives import LEDGER

    first, last = args.warmup, args.warmup + args.steps - 1
    n_profiled = profiled_steps(args, variant)
    peak_probe = getattr(args, "suite", None) == "peak"

    class Meter(pl.Callback):
        def __init__(self) -> None:
            self.step_times: list[float] = []
            # ``between_steps``: from a timed step's batch end to the next one's batch start (the loop, the next
            # batch, and whatever the last step left running, e.g. zero1/2's post-step all-gather): with it the
            # phases per step add up to the span over the timed steps, i.e. to 1 / throughput
            self.phase = {"forward": 0.0, "backward_and_grad_sync": 0.0, "optimizer_and_param_sync": 0.0,
                          "between_steps": 0.0}
            self.off_cpu = dict.fromkeys(self.phase, 0.0)  # wall - main-thread CPU time: blocked (waits) or preempted
            self.labels: dict[str, float] = {}
            self.losses: list[float] = []
            self.t_span0 = self.t_span1 = 0.0
            self.engine_s_per_step: dict[str, float] = {}
            self.profile = EnginePhaseProfile()
            self.n_batches = 0  # batches started, all epochs (the profiled steps can run in a second epoch)

        def on_train_start(self, trainer, pl_module) -> None:
            if peak_probe:  # baseline before the first step; then the high-water mark of training alone
                self.baseline_rss = rss_bytes()
                self.setup_peak_rss = peak_rss_bytes()
                self.hwm_reset = reset_peak_rss()
            if program_of(variant) in ("ddp", "zero_r") and args.comm_hook:
                trainer.strategy.model.register_comm_hook(counters, counting_allreduce_hook)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.step, self.n_batches = self.n_batches, self.n_batches + 1
            if first < self.step <= last:  # the time since the last timed step ended
                self._lap("between_steps", count=True)
            if self.step == first:
                self.faults0 = minor_faults()
                self.ledger_mark = LEDGER.mark()
                self.counters0 = counters.snapshot()
                self.t_span0 = time.perf_counter()
                self.cpu0 = (time.process_time(), time.thread_time())  # every thread of the process; the main one
            if self.step == last + 1 and n_profiled:
                self.profile.start()
            self.t0 = self.t_mark = time.perf_counter()
            self.cpu_mark = time.thread_time()

        def _lap(self, name: str, count: bool = False) -> None:
            now, cpu = time.perf_counter(), time.thread_time()
            if count or first <= self.step <= last:
                self.phase[name] += now - self.t_mark
                self.off_cpu[name] += (now - self.t_mark) - (cpu - self.cpu_mark)
            self.t_mark, self.cpu_mark = now, cpu

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self._lap("forward")

        def on_after_backward(self, trainer, pl_module) -> None:
            self._lap("backward_and_grad_sync")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if self.step == last:  # gradients reduced, optimizer state exists: the model state to report
                t = time.perf_counter()
                self.model_state = held_model_state(trainer, variant)
                dt = time.perf_counter() - t
                self.t0 += dt  # the snapshot is not part of the timed step
                self.t_span0 += dt
            self.t_mark, self.cpu_mark = time.perf_counter(), time.thread_time()  # clipping etc. (none here) excluded

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self._lap("optimizer_and_param_sync")
            now = time.perf_counter()
            step = self.step
            if step <= last:  # the profiled steps after the timed ones are not part of the run's losses
                self.losses.append(float(outputs["loss"]))
            if first <= step <= last:
                self.step_times.append(now - self.t0)
            if step == last:
                self.faults1 = minor_faults()
                self.t_span1 = now
                self.cpu1 = (time.process_time(), time.thread_time())
                self.entries = LEDGER.since(self.ledger_mark)
                self.counters1 = counters.snapshot()
                self.peak_rss = peak_rss_bytes()  # before the profiled window (the profiler holds its events)
            if n_profiled and step == last + n_profiled:
                self.engine_s_per_step = self.profile.stop(n_profiled)
                self.labels = self.profile.labels

        def on_train_end(self, trainer, pl_module) -> None:
            self.profile.close()
            write_rank_result(args, variant, trainer, self)

        def on_exception(self, trainer, pl_module, exception) -> None:
            self.profile.close()

    return Meter()


# ============================================================================================ per-rank result
def write_rank_result(args: argparse.Namespace, variant: str, trainer: Any, meter: Any) -> None:
    import torch

    rank, n = trainer.global_rank, args.steps
    tokens_per_step = args.batch_size * args.block_size
    span = meter.t_span1 - meter.t_span0
    model_state = getattr(meter, "model_state", None) or held_model_state(trainer, variant)
    param_bytes = model_param_bytes(args)
    out = {
        "variant": variant, "rank": rank, "world": trainer.world_size, "timed_steps": n,
        "tokens_per_step": tokens_per_step,
        "span_s": span, "tokens_per_s": n * tokens_per_step / span if span > 0 else float("nan"),
        "median_step_s": sorted(meter.step_times)[len(meter.step_times) // 2] if meter.step_times else None,
        "step_times_s": meter.step_times,
        "phase_s_per_step": {k: v / n for k, v in meter.phase.items()},
        "off_cpu_s_per_step": {k: v / n for k, v in getattr(meter, "off_cpu", {}).items()},
        "engine_s_per_step": meter.engine_s_per_step,
        "labels_s_per_step": getattr(meter, "labels", {}),
        "minor_faults_per_step": (meter.faults1 - meter.faults0) / n if hasattr(meter, "faults1") else None,
        # CPU seconds per timed step: the whole process (compute, gloo's threads, the allocator) and its main thread
        "cpu_s_per_step": ({"process": (meter.cpu1[0] - meter.cpu0[0]) / n, "main": (meter.cpu1[1] - meter.cpu0[1]) / n}
                           if hasattr(meter, "cpu1") else None),
        "optimizer_state_bytes": model_state["optimizer_state"], "model_state": model_state,
        "param_bytes": param_bytes, "peak_rss_bytes": getattr(meter, "peak_rss", None) or peak_rss_bytes(),
        # a meter that brings its own wire figures (the DeepSpeed rank, bench/deepspeed_rank.py) keeps them
        **(getattr(meter, "wire", None)
           or wire_per_step(args, variant, trainer, meter.entries, meter.counters0, meter.counters1, param_bytes)),
        "losses": meter.losses, "torch_threads": torch.get_num_threads(),
    }
    if getattr(args, "suite", None) == "peak":
        setup_peak, train_peak = getattr(meter, "setup_peak_rss", None), out["peak_rss_bytes"]
        out.update({
            "baseline_rss_bytes": getattr(meter, "baseline_rss", None),  # VmRSS at on_train_start
            "setup_peak_rss_bytes": setup_peak,  # VmHWM at on_train_start (before the reset)
            "hwm_reset": getattr(meter, "hwm_reset", False),
            "train_peak_rss_bytes": train_peak,  # VmHWM at the end of the timed steps (since the reset, if done)
            "peak_rss_bytes": max(train_peak, setup_peak or 0),  # whole process
            "malloc_env": {k: os.environ.get(k) for k in MALLOC_ENV},
        })
    path = Path(args.rank_out).with_suffix(f".rank{rank}.json")
    path.write_text(json.dumps(out, indent=1))
