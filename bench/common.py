"""Shared machinery of the sharding benchmarks (``bench_zero12.py`` and ``bench_zero3.py`` are thin entry points).

Two suites, each a table of variants trained on the same small GPT (synthetic tokens, fixed seed, AdamW), each
variant in a fresh Python process with N CPU ranks (gloo, 1 thread per rank):

* ``zero12`` -> ``bench/results/zero12.{json,md}``: ``zero0``/``zero1``/``zero2`` (lightning_shard), ``ddp``
  (Lightning ``DDPStrategy``), ``zero_r`` (``torch.distributed.optim.ZeroRedundancyOptimizer`` wrapping AdamW,
  returned from ``configure_optimizers`` under Lightning ``DDPStrategy``).
* ``zero3`` -> ``bench/results/zero3.{json,md}``: ``zero3`` (lightning_shard ``Zero3Strategy``, every module with
  parameters a unit), ``fsdp_shard`` (``FSDPShardStrategy(wrap_classes=[<GPT block class>])``), ``fsdp2`` (torch
  FSDP2 ``fully_shard`` applied per block then to the GPT root in ``configure_model()``, run by Lightning's
  ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` on gloo), ``ddp`` (reference).
* ``unused`` -> ``bench/results/unused.{json,md}``: what leaving parameters without gradients out of the step
  costs (``find_unused_parameters=True``, the default: one all-reduce of a byte per parameter per optimizer step)
  against ``False`` (no exchange), for zero2 and zero3, side by side in one run.
* ``all``: every table in one go (a variant measured for an earlier table is reused in a later one).

Every variant uses a launcher that starts each rank as its own fresh interpreter, so peak RSS is per rank.

Measured per rank (no barrier in the timed loop): tokens/s from ``time.perf_counter`` at ``on_train_batch_start``
of the first timed step to ``on_train_batch_end`` of the last; optimizer-state and model-state bytes from the
tensors the rank holds (unique storages, so padding inside a storage counts); peak RSS (``VmHWM``); bytes on the
wire per optimizer step per rank, ring conventions (reduce-scatter / all-gather (N-1)/N x full tensor, all-reduce
2(N-1)/N x tensor, broadcast = bytes received):

* lightning_shard variants: ``LEDGER`` ring wire bytes (measured).
* ddp / zero_r: a DDP communication hook that counts each gradient bucket it all-reduces; zero_r broadcasts via a
  wrapped ``torch.distributed.broadcast`` (bytes this rank receives).
* fsdp2: **computed** from FSDP2's own units after lazy init: per unit padded flat size S (each parameter's dim 0
  padded to a multiple of N): all-gather in forward + all-gather in backward (units resharded after forward; the
  root is not) + reduce-scatter of the gradients, (N-1)/N x S each. As a cross-check, ``all_gather_single`` /
  ``reduce_scatter_single`` are wrapped to count what FSDP2 actually issued (reported next to it).

Model state per rank = parameters + gradients + optimizer state (+ fp32 master / accumulators) actually held,
taken in ``on_before_optimizer_step`` of the last timed step (gradients reduced, before the update; the snapshot's
own time is taken out of the timing):
lightning_shard ``engine.memory_report()`` minus ``gathered_params`` (transient full parameters); FSDP2: the local
shards (``DTensor.to_local()``) of the parameters, of their gradients and of the optimizer state; DDP / ZeRO-R: the
parameter, ``.grad`` and optimizer tensors (DDP's reducer bucket buffers are not counted).

No speed thresholds: this script reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
OURS = ("zero0", "zero1", "zero2", "zero3", "fsdp_shard", "zero2_nomask", "zero3_nomask")  # ShardEngine + LEDGER
SUITES = {
    "zero12": ("zero0", "zero1", "zero2", "ddp", "zero_r"),
    "zero3": ("zero3", "fsdp_shard", "fsdp2", "ddp"),
    "unused": ("zero2", "zero2_nomask", "zero3", "zero3_nomask"),
}
VARIANTS = tuple(dict.fromkeys(v for vs in SUITES.values() for v in vs))
NOTES = {
    "zero0": "lightning_shard stage 0: bucketed all-reduce, replicated AdamW",
    "zero1": "lightning_shard: reduce-scatter grads, sharded AdamW, all-gather params",
    "zero2": "as zero1, full grads freed after reduce-scatter",
    "ddp": "Lightning DDPStrategy (baseline)",
    "zero_r": "torch ZeroRedundancyOptimizer(AdamW) under Lightning DDP: all-reduce + per-param broadcasts",
    "zero3": "lightning_shard Zero3Strategy: every module with parameters is a unit",
    "fsdp_shard": "lightning_shard FSDPShardStrategy(wrap_classes=[GPT block]): one unit per block + root",
    "fsdp2": "torch FSDP2 fully_shard per block + root, Lightning ModelParallelStrategy (dp=N, tp=1, gloo)",
    "zero2_nomask": "zero2 with find_unused_parameters=False (no used-mask all-reduce)",
    "zero3_nomask": "zero3 with find_unused_parameters=False (no used-mask all-reduce)",
}


# ============================================================================================ model
def build_model(vocab: int, block: int, n_layer: int, n_head: int, n_embd: int):
    """A small pre-LayerNorm GPT (tied embedding/LM head), written for this benchmark."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(n_embd, 3 * n_embd)
            self.out = nn.Linear(n_embd, n_embd)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            heads = self.qkv(x).view(b, t, 3, n_head, c // n_head).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(heads[0], heads[1], heads[2], is_causal=True)
            return self.out(y.transpose(1, 2).reshape(b, t, c))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
            self.attn = Attention()
            self.up, self.down = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.norm1(x))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class TinyGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, n_embd)
            self.pos = nn.Parameter(torch.zeros(block, n_embd))
            self.layers = nn.ModuleList(Layer() for _ in range(n_layer))
            self.norm = nn.LayerNorm(n_embd)
            self.head = nn.Linear(n_embd, vocab, bias=False)
            for p in self.parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=0.02)
            self.head.weight = self.tok.weight  # tied

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos[: idx.shape[1]]
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    return TinyGPT()


def model_param_bytes(args: argparse.Namespace) -> int:
    """Psi in bytes (fp32, tied weight once), from a meta-device copy: no memory, independent of sharding."""
    import torch

    with torch.device("meta"):
        model = build_model(args.vocab, args.block_size, args.n_layer, args.n_head, args.n_embd)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def make_module(args: argparse.Namespace, variant: str):
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    class BenchModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(args.vocab, args.block_size, args.n_layer, args.n_head, args.n_embd)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.model(x)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

        def configure_optimizers(self):
            decay = [p for p in self.parameters() if p.dim() >= 2]
            rest = [p for p in self.parameters() if p.dim() < 2]
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
            hp = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
            if variant == "zero_r":
                from torch.distributed.optim import ZeroRedundancyOptimizer

                zr = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                             weight_decay=0.1, **hp)
                zr.add_param_group(groups[1])
                return zr
            return torch.optim.AdamW(groups, **hp)

    if variant != "fsdp2":
        return BenchModule()

    class FSDP2Module(BenchModule):
        """ModelParallelStrategy requires ``configure_model``: FSDP2 on each block, then on the GPT root."""

        def configure_model(self) -> None:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if isinstance(self.model, FSDPModule):
                return
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return FSDP2Module()


# ============================================================================================ measuring
def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), falling back to getrusage."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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


_MISSING = object()


def fsdp2_units(model: Any, world: int) -> list[dict[str, Any]]:
    """FSDP2's units after lazy init: padded flat bytes S and whether the unit is resharded after forward."""
    from torch.distributed.fsdp import FSDPModule

    units = []
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for i, mod in enumerate(fsdp_modules):
        state = mod._get_fsdp_state()
        groups = list(getattr(state, "_fsdp_param_groups", None) or [])
        if not groups and getattr(state, "_fsdp_param_group", None) is not None:
            groups = [state._fsdp_param_group]
        for g in groups:
            padded = 0
            for fp in g.fsdp_params:
                data = getattr(fp, "_sharded_param_data", None)
                if data is not None:
                    padded += data.numel() * data.element_size() * world
                else:  # fallback: dim 0 padded to a multiple of world
                    shape = list(fp.sharded_param.shape)
                    rows = -(-shape[0] // world) * world
                    rest = 1
                    for d in shape[1:]:
                        rest *= d
                    padded += rows * rest * fp.sharded_param.element_size()
            info = getattr(g, "post_forward_mesh_info", _MISSING)
            reshard = (i != 0) if info is _MISSING else info is not None  # fsdp_modules[0] is the root
            units.append({"module": type(mod).__name__, "params": len(g.fsdp_params), "padded_bytes": padded,
                          "reshard_after_forward": reshard})
    return units


class Counters:
    """Bytes counted outside the ledger (DDP comm hook, patched broadcast, patched FSDP2 collectives)."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank
        self.allreduce_bytes = 0
        self.allreduce_calls = 0
        self.bcast_bytes = 0  # all broadcast tensors (as root or receiver)
        self.bcast_recv_bytes = 0  # tensors this rank received
        self.bcast_calls = 0
        self.ag_bytes = 0  # all-gather output (full) bytes
        self.ag_calls = 0
        self.rs_bytes = 0  # reduce-scatter input (full) bytes
        self.rs_calls = 0

    def snapshot(self) -> dict[str, int]:
        return dict(vars(self))


def counting_allreduce_hook(state, bucket):  # no annotations: DDP checks that of `bucket`
    """DDP comm hook: average the bucket with one all-reduce (what DDP does by default), counting its bytes."""
    import torch.distributed as dist

    buf = bucket.buffer()
    state.allreduce_bytes += buf.numel() * buf.element_size()
    state.allreduce_calls += 1
    buf.div_(state.world)
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def patch_broadcast(counters: Counters) -> None:
    import torch.distributed as dist

    original = dist.broadcast

    def broadcast(tensor, src=None, group=None, async_op=False, **kwargs):
        nbytes = tensor.numel() * tensor.element_size()
        counters.bcast_calls += 1
        counters.bcast_bytes += nbytes
        if src is not None and dist.get_rank() != src:
            counters.bcast_recv_bytes += nbytes
        return original(tensor, src=src, group=group, async_op=async_op, **kwargs)

    dist.broadcast = broadcast


def patch_fsdp2_collectives(counters: Counters) -> None:
    """Count the all-gathers / reduce-scatters FSDP2 issues (it calls them as ``torch.distributed.<name>``)."""
    import torch.distributed as dist

    def nbytes(t: Any) -> int:
        return t.numel() * t.element_size()

    def wrap(name: str, kind: str, pick) -> None:
        original = getattr(dist, name, None)
        if original is None:
            return

        def counted(*a, **k):
            t = pick(a, k)
            setattr(counters, f"{kind}_bytes", getattr(counters, f"{kind}_bytes") + nbytes(t))
            setattr(counters, f"{kind}_calls", getattr(counters, f"{kind}_calls") + 1)
            return original(*a, **k)

        setattr(dist, name, counted)

    first = lambda a, k, key: a[0] if a else k[key]  # noqa: E731
    for name in ("all_gather_single", "all_gather_into_tensor"):
        wrap(name, "ag", lambda a, k: first(a, k, "output_tensor"))
    wrap("reduce_scatter_single", "rs", lambda a, k: a[1] if len(a) > 1 else k["input"])
    wrap("reduce_scatter_tensor", "rs", lambda a, k: a[1] if len(a) > 1 else k["input"])


def patch_engine_timers(timers: dict[str, float]) -> None:
    """Time the ShardEngine phases from outside (wrapping methods on the class, no engine change)."""
    from lightning_shard.core.engine import ShardEngine

    for name in ("pre_backward", "post_backward", "prepare_step", "finish_step", "_leave_out_unused"):
        original = getattr(ShardEngine, name)

        def timed(self, *a, __orig=original, __name=name, **k):
            t0 = time.perf_counter()
            try:
                return __orig(self, *a, **k)
            finally:
                if timers.get("_on"):
                    timers[__name] = timers.get(__name, 0.0) + time.perf_counter() - t0

        setattr(ShardEngine, name, timed)


def make_callback(args: argparse.Namespace, variant: str, counters: Counters, engine_timers: dict[str, float]):
    import lightning.pytorch as pl

    from lightning_shard.core.collectives import LEDGER

    first, last = args.warmup, args.warmup + args.steps - 1

    class Meter(pl.Callback):
        def __init__(self) -> None:
            self.step_times: list[float] = []
            self.phase = {"forward": 0.0, "backward_and_grad_sync": 0.0, "optimizer_and_param_sync": 0.0}
            self.losses: list[float] = []
            self.t_span0 = self.t_span1 = 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            if variant in ("ddp", "zero_r") and args.comm_hook:
                trainer.strategy.model.register_comm_hook(counters, counting_allreduce_hook)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == first:
                self.ledger_mark = LEDGER.mark()
                self.counters0 = counters.snapshot()
                engine_timers.clear()
                engine_timers["_on"] = 1.0
                self.t_span0 = time.perf_counter()
            self.batch_idx = batch_idx
            self.t0 = self.t_mark = time.perf_counter()

        def _lap(self, name: str, batch_idx: int) -> None:
            now = time.perf_counter()
            if first <= batch_idx <= last:
                self.phase[name] += now - self.t_mark
            self.t_mark = now

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self._lap("forward", self.batch_idx)

        def on_after_backward(self, trainer, pl_module) -> None:
            self._lap("backward_and_grad_sync", self.batch_idx)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if self.batch_idx == last:  # gradients reduced, optimizer state exists: the model state to report
                t = time.perf_counter()
                self.model_state = held_model_state(trainer, variant)
                dt = time.perf_counter() - t
                self.t0 += dt  # the snapshot is not part of the timed step
                self.t_span0 += dt
            self.t_mark = time.perf_counter()  # clipping etc. (none here) excluded

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self._lap("optimizer_and_param_sync", batch_idx)
            now = time.perf_counter()
            self.losses.append(float(outputs["loss"]))
            if first <= batch_idx <= last:
                self.step_times.append(now - self.t0)
            if batch_idx == last:
                self.t_span1 = now
                engine_timers["_on"] = 0.0
                self.entries = LEDGER.since(self.ledger_mark)
                self.counters1 = counters.snapshot()

        def on_train_end(self, trainer, pl_module) -> None:
            write_rank_result(args, variant, trainer, self, counters, engine_timers)

    return Meter()


def write_rank_result(args, variant, trainer, meter, counters: Counters, engine_timers) -> None:
    import torch

    world, rank, n = trainer.world_size, trainer.global_rank, args.steps
    tokens_per_step = args.batch_size * args.block_size
    span = meter.t_span1 - meter.t_span0
    model_state = getattr(meter, "model_state", None) or held_model_state(trainer, variant)
    opt_bytes = model_state["optimizer_state"]
    param_bytes = model_param_bytes(args)

    # ------------------------------------------------------------------ bytes per optimizer step
    ring = (world - 1) / world
    c0, c1 = meter.counters0, meter.counters1
    if variant in OURS:
        from lightning_shard.core.collectives import Ledger

        summary = {f"{op}/{grp}": v for (op, grp), v in Ledger.summarize(meter.entries).items()}
        wire = sum(e.wire_bytes for e in meter.entries) / n
        wire_source = "measured: lightning_shard LEDGER ring wire bytes"
        # zero0: all-reduce; zero1/2: reduce-scatter + all-gather (same total); stage 3: all-gather fwd + bwd + RS
        formula = (3 if variant in ("zero3", "fsdp_shard", "zero3_nomask") else 2) * ring * param_bytes
        mask = [e for e in meter.entries if e.tag == "used_mask"]
        detail: dict[str, Any] = {"ledger": summary, "used_mask_calls_per_step": len(mask) / n,
                                  "used_mask_bytes_per_step": sum(e.bytes for e in mask) / n,
                                  "used_mask_wire_bytes_per_step": sum(e.wire_bytes for e in mask) / n}
    elif variant == "fsdp2":
        units = fsdp2_units(trainer.lightning_module.model, world)
        wire = sum(ring * u["padded_bytes"] * (3 if u["reshard_after_forward"] else 2) for u in units)
        wire_source = ("computed, not measured: per FSDP2 unit padded flat S, all-gather fwd + all-gather bwd "
                       "(if resharded after forward) + reduce-scatter, (N-1)/N x S each")
        formula = 3 * ring * param_bytes
        ag = (c1["ag_bytes"] - c0["ag_bytes"]) / n
        rs = (c1["rs_bytes"] - c0["rs_bytes"]) / n
        detail = {"counted_wire_bytes_per_step": ring * (ag + rs),
                  "counted_all_gather_bytes_per_step": ag, "counted_reduce_scatter_bytes_per_step": rs,
                  "all_gather_calls_per_step": (c1["ag_calls"] - c0["ag_calls"]) / n,
                  "reduce_scatter_calls_per_step": (c1["rs_calls"] - c0["rs_calls"]) / n,
                  "units": units}
    else:
        ar = (c1["allreduce_bytes"] - c0["allreduce_bytes"]) / n
        bc_recv = (c1["bcast_recv_bytes"] - c0["bcast_recv_bytes"]) / n
        detail = {"allreduce_bytes_per_step": ar, "allreduce_calls_per_step": (c1["allreduce_calls"] - c0["allreduce_calls"]) / n,
                  "broadcast_bytes_per_step": (c1["bcast_bytes"] - c0["bcast_bytes"]) / n,
                  "broadcast_recv_bytes_per_step": bc_recv,
                  "broadcast_calls_per_step": (c1["bcast_calls"] - c0["bcast_calls"]) / n}
        formula = 2 * ring * param_bytes + (ring * param_bytes if variant == "zero_r" else 0.0)
        if args.comm_hook:
            wire = 2 * ring * ar + bc_recv
            wire_source = "measured: DDP comm hook (all-reduce 2(N-1)/N x bucket bytes)" + \
                (" + received broadcast bytes" if variant == "zero_r" else "")
        else:
            wire = formula
            wire_source = "computed, not measured: 2(N-1)/N x grad bytes" + \
                (" + (N-1)/N x param bytes" if variant == "zero_r" else "")
    out = {
        "variant": variant, "rank": rank, "world": world, "timed_steps": n, "tokens_per_step": tokens_per_step,
        "span_s": span, "tokens_per_s": n * tokens_per_step / span if span > 0 else float("nan"),
        "median_step_s": sorted(meter.step_times)[len(meter.step_times) // 2] if meter.step_times else None,
        "step_times_s": meter.step_times,
        "phase_s_per_step": {k: v / n for k, v in meter.phase.items()},
        "engine_s_per_step": {k: v / n for k, v in engine_timers.items() if k != "_on"},
        "optimizer_state_bytes": opt_bytes, "model_state": model_state, "param_bytes": param_bytes,
        "peak_rss_bytes": peak_rss_bytes(),
        "wire_bytes_per_step": wire, "wire_source": wire_source, "wire_formula_bytes_per_step": formula,
        "wire_detail": detail, "losses": meter.losses, "torch_threads": torch.get_num_threads(),
    }
    path = Path(args.rank_out).with_suffix(f".rank{rank}.json")
    path.write_text(json.dumps(out, indent=1))


# ============================================================================================ one variant
def run_variant(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_shard  # noqa: F401  (registers the strategy names)
    from lightning_shard.strategies import FSDPShardStrategy, Zero0Strategy, Zero1Strategy, Zero2Strategy, Zero3Strategy

    variant = args.variant
    pl.seed_everything(args.seed, verbose=False)
    world = args.devices
    n_seq = (args.warmup + args.steps) * args.batch_size * world
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(args.vocab, (n_seq, args.block_size + 1), generator=gen)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size, drop_last=True)

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    counters = Counters(world, rank)
    engine_timers: dict[str, float] = {}
    module = make_module(args, variant)  # same seed on every rank: identical initial weights everywhere
    if variant in ("ddp", "zero_r"):
        strategy = DDPStrategy(process_group_backend="gloo")
        if variant == "zero_r":
            patch_broadcast(counters)
    elif variant == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                         process_group_backend="gloo", save_distributed_checkpoint=True)
        patch_fsdp2_collectives(counters)
    elif variant in ("zero3", "zero3_nomask"):
        strategy = Zero3Strategy(accumulation="auto", find_unused_parameters=variant == "zero3")
        patch_engine_timers(engine_timers)
    elif variant == "fsdp_shard":
        strategy = FSDPShardStrategy(wrap_classes=[type(module.model.layers[0])], accumulation="auto")
        patch_engine_timers(engine_timers)
    else:
        cls = {"zero0": Zero0Strategy, "zero1": Zero1Strategy, "zero2": Zero2Strategy,
               "zero2_nomask": Zero2Strategy}[variant]
        strategy = cls(bucket_mb=args.bucket_mb, accumulation="defer",
                       find_unused_parameters=variant != "zero2_nomask")
        patch_engine_timers(engine_timers)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.warmup + args.steps,
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[make_callback(args, variant, counters, engine_timers)])
    counters.rank = trainer.global_rank
    trainer.fit(module, train_dataloaders=data)


# ============================================================================================ driver
def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    import lightning
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    model = build_model(args.vocab, args.block_size, args.n_layer, args.n_head, args.n_embd)
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "lightning": lightning.__version__, "platform": platform.platform(), "ranks": args.devices,
        "threads_per_rank": 1, "backend": "gloo", "params": n_params, "param_mib_fp32": n_params * 4 / 2**20,
        "model": {k: getattr(args, k) for k in ("vocab", "block_size", "n_layer", "n_head", "n_embd")},
        "micro_batch_per_rank": args.batch_size, "tokens_per_step_per_rank": args.batch_size * args.block_size,
        "warmup_steps": args.warmup, "timed_steps": args.steps, "optimizer": "AdamW(lr=3e-4, betas=(0.9,0.95), wd=0.1/0)",
        "bucket_mb": args.bucket_mb, "comm_hook": args.comm_hook, "repeats": args.repeats,
    }


def child_argv(args: argparse.Namespace, variant: str, rank_out: Path) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--variant", variant, "--rank-out", str(rank_out)]
    for k in ("steps", "warmup", "n_layer", "n_head", "n_embd", "vocab", "block_size", "batch_size", "bucket_mb",
              "seed", "devices"):
        argv += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if not args.comm_hook:
        argv.append("--no-comm-hook")
    return argv


def suite_outputs(args: argparse.Namespace, suite: str) -> tuple[Path, Path]:
    single = len(args.suites) == 1
    out_json = Path(args.out_json) if single and args.out_json else Path(args.out_dir) / f"{suite}.json"
    out_md = Path(args.out_md) if single and args.out_md else Path(args.out_dir) / f"{suite}.md"
    return out_json, out_md


def run_all(args: argparse.Namespace) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    info = machine_info(args)
    print(f"model: {info['params'] / 1e6:.1f}M params ({info['param_mib_fp32']:.0f} MiB fp32); "
          f"{args.devices} ranks x 1 thread; {args.warmup} warmup + {args.steps} timed steps; "
          f"{info['tokens_per_step_per_rank']} tokens/step/rank; suite(s) {', '.join(args.suites)}", flush=True)
    done: dict[str, tuple[str, dict[str, Any]]] = {}  # variant -> (suite that ran it, merged result)
    written = []
    for suite in args.suites:
        variants = [v for v in SUITES[suite] if v in args.variants]
        if not variants:
            print(f"suite {suite}: no selected variant, skipped", flush=True)
            continue
        tmp = RESULTS / f"{suite}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        t_suite = time.perf_counter()
        todo = [v for v in variants if v not in done]
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in todo}
        for rep in range(args.repeats):
            order = list(todo) if rep % 2 == 0 else list(reversed(todo))  # ABC CBA: spread drift
            for variant in order:
                runs[variant].append(run_one(args, variant, rep, tmp, env))
        results: dict[str, dict[str, Any]] = {}
        for v in variants:
            if v in done:  # measured in an earlier table of this invocation: reuse, say so
                results[v] = dict(done[v][1], reused_from_suite=done[v][0])
            else:
                results[v] = merge_repeats(v, runs[v])
                done[v] = (suite, results[v])
        wall = time.perf_counter() - t_suite
        for key, base_variant in (("ratio_vs_ddp", "ddp"), ("ratio_vs_fsdp2", "fsdp2")):
            base = results.get(base_variant, {}).get("tokens_per_s_mean")
            if base_variant in results:
                for r in results.values():
                    if "error" not in r:
                        r[key] = r["tokens_per_s_mean"] / base if base else None
        doc = {"suite": suite, "machine": info, "command": " ".join([Path(sys.executable).name] + sys.argv),
               "wall_s": wall, "results": results}
        out_json, out_md = suite_outputs(args, suite)
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(doc, indent=1))
        md = MARKDOWN[suite](doc)
        out_md.parent.mkdir(parents=True, exist_ok=True)
        out_md.write_text(md)
        print("\n" + md, flush=True)
        written += [str(out_json), str(out_md)]
    print(f"wrote {', '.join(written)}")


def run_one(args: argparse.Namespace, variant: str, rep: int, tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    rank_out = tmp / f"{variant}.r{rep}.json"
    for r in range(args.devices):
        rank_out.with_suffix(f".rank{r}.json").unlink(missing_ok=True)
    log_path = tmp / f"{variant}.r{rep}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(child_argv(args, variant, rank_out), cwd=REPO, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=args.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    files = [rank_out.with_suffix(f".rank{r}.json") for r in range(args.devices)]
    deadline = time.time() + (60 if rc == 0 else 0)
    while not all(f.exists() for f in files) and time.time() < deadline:
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    if rc != 0 or not all(f.exists() for f in files):
        tail = log_path.read_text()[-3000:]
        print(f"[{variant} #{rep}] FAILED (rc={rc}); log tail:\n{tail}", flush=True)
        return {"variant": variant, "note": NOTES[variant], "error": f"rc={rc}", "log_tail": tail}
    time.sleep(0.5)  # let the last rank finish writing
    r = summarize(variant, [json.loads(f.read_text()) for f in files], wall)
    print(f"[{variant} #{rep}] {r['tokens_per_s_mean']:.0f} tok/s/rank, model state "
          f"{'/'.join(f'{x:.1f}' for x in r['model_state_mib_per_rank'])} MiB (opt "
          f"{'/'.join(f'{x:.1f}' for x in r['optimizer_state_mib_per_rank'])}), "
          f"peak RSS {r['peak_rss_mib_max']:.0f} MiB, wire {r['wire_mib_per_step_per_rank']:.1f} MiB/step, "
          f"final loss {r['final_loss_rank0']:.4f} ({wall:.0f}s)", flush=True)
    return r


def merge_repeats(variant: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean tokens/s over repeats; memory and bytes from the first good run (they do not depend on timing)."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    out = dict(good[0])
    out["repeats"] = [{k: r[k] for k in ("tokens_per_s_mean", "tokens_per_s_per_rank", "median_step_s_per_rank",
                                         "phase_s_per_step_rank0", "engine_s_per_step_rank0", "variant_wall_s")}
                      for r in good]
    out["failed_repeats"] = len(runs) - len(good)
    out["tokens_per_s_mean"] = sum(r["tokens_per_s_mean"] for r in good) / len(good)
    out["tokens_per_s_rank0"] = sum(r["tokens_per_s_rank0"] for r in good) / len(good)
    out["peak_rss_mib_max"] = max(r["peak_rss_mib_max"] for r in good)
    out["peak_rss_mib_per_rank"] = [max(r["peak_rss_mib_per_rank"][i] for r in good)
                                    for i in range(len(good[0]["peak_rss_mib_per_rank"]))]
    for key in ("phase_s_per_step_rank0", "engine_s_per_step_rank0"):
        out[key] = {k: sum(r[key][k] for r in good) / len(good) for k in good[0][key]}
    out["median_step_s_per_rank"] = [sorted(r["median_step_s_per_rank"][i] for r in good)[len(good) // 2]
                                     for i in range(len(good[0]["median_step_s_per_rank"]))]
    return out


def summarize(variant: str, ranks: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    mib = 2**20
    tps = [r["tokens_per_s"] for r in ranks]
    return {
        "variant": variant, "note": NOTES[variant], "variant_wall_s": wall,
        "tokens_per_s_rank0": tps[0], "tokens_per_s_mean": sum(tps) / len(tps), "tokens_per_s_per_rank": tps,
        "median_step_s_per_rank": [r["median_step_s"] for r in ranks],
        "optimizer_state_mib_per_rank": [round(r["optimizer_state_bytes"] / mib, 2) for r in ranks],
        "model_state_mib_per_rank": [round(r["model_state"]["total"] / mib, 2) for r in ranks],
        "model_state_bytes_each_rank": [r["model_state"] for r in ranks],
        "peak_rss_mib_per_rank": [round(r["peak_rss_bytes"] / mib, 1) for r in ranks],
        "peak_rss_mib_max": max(r["peak_rss_bytes"] for r in ranks) / mib,
        "wire_mib_per_step_per_rank": max(r["wire_bytes_per_step"] for r in ranks) / mib,
        "wire_mib_per_step_each_rank": [r["wire_bytes_per_step"] / mib for r in ranks],
        "wire_formula_mib_per_step": ranks[0]["wire_formula_bytes_per_step"] / mib,
        "wire_source": ranks[0]["wire_source"], "wire_detail_rank0": ranks[0]["wire_detail"],
        "phase_s_per_step_rank0": ranks[0]["phase_s_per_step"],
        "phase_s_per_step_rank1": ranks[-1]["phase_s_per_step"],
        "engine_s_per_step_rank0": ranks[0]["engine_s_per_step"],
        "model_state_rank0": ranks[0]["model_state"],
        "final_loss_rank0": ranks[0]["losses"][-1], "losses_rank0": ranks[0]["losses"],
        "torch_threads": ranks[0]["torch_threads"],
    }


# ============================================================================================ reports
def _header(doc: dict[str, Any], title: str) -> list[str]:
    m = doc["machine"]
    return [
        f"# {title}",
        "",
        f"{m['ranks']} CPU ranks x {m['threads_per_rank']} thread (gloo) on {m['cores']} cores ({m['cpu']}); "
        f"torch {m['torch']}, lightning {m['lightning']}, python {m['python']}.",
        f"Model: GPT {m['model']['n_layer']} layers x {m['model']['n_embd']} wide, {m['model']['n_head']} heads, "
        f"vocab {m['model']['vocab']}, seq {m['model']['block_size']}, tied embedding: "
        f"{m['params'] / 1e6:.2f}M params ({m['param_mib_fp32']:.1f} MiB fp32). AdamW, fp32. "
        f"Micro-batch {m['micro_batch_per_rank']} x {m['model']['block_size']} = {m['tokens_per_step_per_rank']} "
        f"tokens/step/rank; {m['warmup_steps']} warmup + {m['timed_steps']} timed steps per run, {m['repeats']} "
        f"run(s) per variant (order reversed every other round; tokens/s = mean of runs); bucket_mb={m['bucket_mb']}.",
        f"Command: `{doc['command']}` (wall of this table {doc['wall_s']:.0f} s).",
        "",
    ]


def _phase_rows(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| variant | forward | backward+sync | optimizer+sync | engine post_backward | engine finish_step "
        "| median step | final loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v, r in doc["results"].items():
        if "error" in r:
            continue
        p, e = r["phase_s_per_step_rank0"], r["engine_s_per_step_rank0"]
        eng = " | ".join(f"{e[k]:.3f}" if k in e else "-" for k in ("post_backward", "finish_step"))
        lines.append(f"| {v} | {p['forward']:.3f} | {p['backward_and_grad_sync']:.3f} | "
                     f"{p['optimizer_and_param_sync']:.3f} | {eng} | {r['median_step_s_per_rank'][0]:.3f} | "
                     f"{r['final_loss_rank0']:.4f} |")
    return lines


def markdown_zero12(doc: dict[str, Any]) -> str:
    lines = _header(doc, "zero0/zero1/zero2 vs Lightning DDP vs ZeroRedundancyOptimizer") + [
        "| variant | tokens/s (rank mean) | vs DDP | opt-state MiB/rank | peak RSS MiB (max rank) | wire MiB/step/rank | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for v, r in doc["results"].items():
        if "error" in r:
            lines.append(f"| {v} | failed | | | | | {r['error']} |")
            continue
        ratio = f"{r['ratio_vs_ddp']:.3f}" if r.get("ratio_vs_ddp") else "n/a"
        opt = " / ".join(f"{x:.1f}" for x in r["optimizer_state_mib_per_rank"])
        reps = "/".join(f"{x['tokens_per_s_mean']:.0f}" for x in r.get("repeats", []))
        note = f"{r['note']}; tok/s per repeat {reps}; wire {r['wire_source']} (formula {r['wire_formula_mib_per_step']:.1f})"
        lines.append(f"| {v} | {r['tokens_per_s_mean']:.0f} | {ratio} | {opt} | {r['peak_rss_mib_max']:.0f} | "
                     f"{r['wire_mib_per_step_per_rank']:.1f} | {note} |")
    lines += [
        "",
        "Opt-state is listed per rank (rank0 / rank1), from the tensors each rank holds. Wire bytes per rank use",
        "ring conventions: all-reduce 2(N-1)/N x bytes, reduce-scatter / all-gather (N-1)/N x bytes, broadcast =",
        "bytes this rank receives. Formula column: DDP / ZeRO-1/2 2(N-1)/N x Psi bytes; ZeroRedundancyOptimizer adds",
        "(N-1)/N x Psi bytes of broadcasts (DESIGN.md section 2). Timed loop has no barriers; tokens/s is per rank.",
        "",
        "Per-step phases, rank 0 (s): forward | backward incl. gradient sync wait | optimizer step incl. param sync",
        "",
        "Engine columns (zero* only): time inside ShardEngine.post_backward (waiting for the last gradient",
        "reductions) and ShardEngine.finish_step (parameter all-gather), measured by wrapping the methods.",
        "",
    ] + _phase_rows(doc)
    return "\n".join(lines) + "\n"


def markdown_zero3(doc: dict[str, Any]) -> str:
    res = doc["results"]
    lines = _header(doc, "zero3 / fsdp_shard vs torch FSDP2 (fully_shard via Lightning ModelParallelStrategy)") + [
        "| variant | tokens/s (rank mean) | vs FSDP2 | vs DDP | model state MiB/rank | of which opt state | "
        "peak RSS MiB/rank | wire MiB/step/rank | wire source | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for v, r in res.items():
        if "error" in r:
            lines.append(f"| {v} | failed | | | | | | | | {r['note']}; {r['error']} (see {doc['suite']}.json log_tail) |")
            continue
        fmt = lambda xs, d=1: " / ".join(f"{x:.{d}f}" for x in xs)  # noqa: E731
        ratio = lambda k, r=r: f"{r[k]:.3f}" if r.get(k) else "n/a"  # noqa: E731
        reps = "/".join(f"{x['tokens_per_s_mean']:.0f}" for x in r.get("repeats", []))
        note = f"{r['note']}; tok/s per repeat {reps}; final loss {r['final_loss_rank0']:.4f}"
        if r.get("reused_from_suite"):
            note += f"; measured in the {r['reused_from_suite']} table of this run (not interleaved with these)"
        src = r["wire_source"]
        counted = r["wire_detail_rank0"].get("counted_wire_bytes_per_step")
        if counted is not None:
            src += f"; cross-check, counted FSDP2 collectives: {counted / 2**20:.1f}"
        src += f"; ideal 3-pass formula {r['wire_formula_mib_per_step']:.1f}" if v in ("zero3", "fsdp_shard", "fsdp2") \
            else f"; formula {r['wire_formula_mib_per_step']:.1f}"
        lines.append(f"| {v} | {r['tokens_per_s_mean']:.0f} | {ratio('ratio_vs_fsdp2')} | {ratio('ratio_vs_ddp')} | "
                     f"{fmt(r['model_state_mib_per_rank'])} | {fmt(r['optimizer_state_mib_per_rank'])} | "
                     f"{fmt(r['peak_rss_mib_per_rank'], 0)} | {r['wire_mib_per_step_per_rank']:.1f} | {src} | {note} |")
    lines += ["", "Model state breakdown, rank 0 (MiB): " + "; ".join(
        f"{v}: " + ", ".join(f"{k} {b / 2**20:.1f}" for k, b in r["model_state_rank0"].items()
                             if k not in ("total", "padding_elements") and (b or k in ("params", "grads")))
        for v, r in res.items() if "error" not in r and r.get("model_state_rank0"))]
    lines += [
        "",
        "Per-rank columns are rank0 / rank1. Model state = parameters + gradients + optimizer state (+ fp32",
        "master / accumulators) the rank holds in the last timed step just before the optimizer update",
        "(gradients reduced; snapshot time excluded from timing), unique storages (padding included):",
        "lightning_shard from `engine.memory_report()` minus `gathered_params`; FSDP2 from the local shards",
        "(`DTensor.to_local()`) of parameters, gradients and AdamW state; DDP from its parameter, `.grad` and",
        "AdamW tensors (its reducer buckets not counted). Peak RSS is each rank's VmHWM (whole process).",
        "",
        "Wire bytes per rank per optimizer step, ring conventions ((N-1)/N x full bytes for all-gather and",
        "reduce-scatter, 2(N-1)/N for all-reduce). lightning_shard: measured by the LEDGER. FSDP2: computed, not",
        "measured, from its units after lazy init (per unit padded flat size S: all-gather in forward, again in",
        "backward when the unit is resharded after forward - FSDP2 does not reshard the root - and a",
        "reduce-scatter); the bytes of the all-gathers / reduce-scatters FSDP2 actually issued are counted",
        "as a cross-check. Ideal 3-pass formula: 3(N-1)/N x Psi bytes (every unit resharded after forward).",
        "",
        "Per-step phases, rank 0 (s): forward | backward incl. gradient sync wait | optimizer step incl. param sync",
        "(engine columns: lightning_shard only).",
        "",
    ] + _phase_rows(doc)
    for v, r in res.items():
        units = r.get("wire_detail_rank0", {}).get("units") if "error" not in r else None
        if units:
            lines += ["", f"FSDP2 units ({v}, rank 0): " + ", ".join(
                f"{u['module']} {u['padded_bytes'] / 2**20:.2f} MiB{'' if u['reshard_after_forward'] else ' (not resharded)'}"
                for u in units)]
    return "\n".join(lines) + "\n"


def markdown_unused(doc: dict[str, Any]) -> str:
    res = doc["results"]
    lines = _header(doc, "The cost of leaving parameters without gradients out of the step (find_unused_parameters)") + [
        "| variant | find_unused_parameters | tokens/s (rank mean) | median step s | used-mask all-reduces/step | "
        "used-mask bytes/step | time in the used-mask step, ms/step | wire MiB/step/rank | tok/s vs True |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v, r in res.items():
        if "error" in r:
            lines.append(f"| {v} | | failed | | | | | {r['error']} |")
            continue
        base = res.get(v.replace("_nomask", ""), {})
        ratio = r["tokens_per_s_mean"] / base["tokens_per_s_mean"] if base.get("tokens_per_s_mean") else None
        d = r["wire_detail_rank0"]
        reps = "/".join(f"{x['tokens_per_s_mean']:.0f}" for x in r.get("repeats", []))
        mask_ms = 1000 * r["engine_s_per_step_rank0"].get("_leave_out_unused", 0.0)
        lines.append(f"| {v} | {'False' if v.endswith('_nomask') else 'True (default)'} | "
                     f"{r['tokens_per_s_mean']:.0f} ({reps}) | {r['median_step_s_per_rank'][0]:.3f} | "
                     f"{d.get('used_mask_calls_per_step', 0):.0f} | {d.get('used_mask_bytes_per_step', 0):.0f} | "
                     f"{mask_ms:.2f} | {r['wire_mib_per_step_per_rank']:.3f} | {f'{ratio:.3f}' if ratio else '-'} |")
    lines += ["", "Used-mask bytes: one uint8 per parameter tensor, all-reduced (max) once per optimizer step. The time",
              "column is measured around the engine's _leave_out_unused (building the mask, the all-reduce, marking the",
              "left-out pieces), rank 0, mean per step; with False it only checks locally which parameters got no",
              "gradient. Tokens/s differences within the run-to-run spread (per-repeat figures in brackets) are noise.", ""]
    return "\n".join(lines) + "\n"


MARKDOWN = {"zero12": markdown_zero12, "zero3": markdown_zero3, "unused": markdown_unused}


# ============================================================================================ CLI
def parse_args(argv: Optional[list[str]] = None, default_suite: str = "zero12",
               description: Optional[str] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(description or __doc__ or "").split("\n\n")[0])
    p.add_argument("--suite", choices=(*SUITES, "all"), default=default_suite,
                   help=f"which table(s): zero12 {SUITES['zero12']}, zero3 {SUITES['zero3']}, or all "
                        f"(default {default_suite})")
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                   help="restrict the suite(s) to these variants (default: all of the suite's)")
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps per variant")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before timing")
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=None)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per rank per step")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per variant, order reversed every other round; tokens/s is their mean")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="~1 minute smoke run per suite (smaller model, few steps)")
    p.add_argument("--no-comm-hook", dest="comm_hook", action="store_false",
                   help="plain DDP (no counting hook): DDP/ZeRO-R bytes are then computed, not measured")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per variant before giving up")
    p.add_argument("--out-dir", default=str(RESULTS), help="where <suite>.json / <suite>.md go")
    p.add_argument("--out-json", default=None, help="JSON path (only when a single suite runs)")
    p.add_argument("--out-md", default=None, help="Markdown path (only when a single suite runs)")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one variant, one rank
    p.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    full = dict(repeats=2, steps=12, warmup=3, n_layer=6, n_embd=512, batch_size=4)
    quick = dict(repeats=1, steps=5, warmup=2, n_layer=2, n_embd=256, batch_size=2)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.suites = list(SUITES) if args.suite == "all" else [args.suite]
    in_suites = [v for s in args.suites for v in SUITES[s]]
    if args.variants is None:
        args.variants = list(dict.fromkeys(in_suites))
    elif not args.variant:
        stray = [v for v in args.variants if v not in in_suites]
        if stray:
            p.error(f"variant(s) {stray} are not in suite {args.suite}; use --suite all or the suite that has them")
    if (args.out_json or args.out_md) and len(args.suites) > 1:
        p.error("--out-json/--out-md name one table's files; with --suite all use --out-dir")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (the first step pays one-time setup costs)")
    return args


def main(default_suite: str = "zero12", description: Optional[str] = None) -> None:
    args = parse_args(default_suite=default_suite, description=description)
    if args.variant:
        run_variant(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
