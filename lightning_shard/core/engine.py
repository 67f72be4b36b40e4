"""The ZeRO-0/1/2 sharding engine and its gradient-sync controller.

One engine serves every stage; the stage only changes how a bucket is split and reduced:

============  =====================================  ========================  ==================
stage         gradient reduction (boundary)          optimizer steps on        after the step
============  =====================================  ========================  ==================
0             all-reduce of the full bucket           the whole bucket          nothing
1             reduce-scatter, full grads kept         the rank's shard          all-gather params
2             reduce-scatter, full grads freed        the rank's shard          all-gather params
============  =====================================  ========================  ==================

Accumulation (the controller): :meth:`no_sync` marks micro-batches that are not an accumulation boundary.
With the ``defer`` policy those communicate nothing and gradients accumulate in the full buffers; with
``per_micro_batch`` (stage 2 only) each micro-batch is reduce-scattered into an fp32 shard accumulator and
the full gradients are freed. On a communicating backward, bucket reductions are launched asynchronously
from gradient hooks as soon as a bucket's gradients are complete (``overlap=True``), always in bucket
order so that every rank issues the same collectives in the same sequence.
"""

from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn

from . import collectives as C
from . import grads, health, state_dict
from .bucket import Bucket
from .deferred import DeferredInit
from .optim import OptimizerBinding, optimizer_state_bytes, validate_optimizer
from .plan import Owner, flat_buckets, param_owners, unit_buckets
from .spec import ShardSpec
from .state import AccumulationPolicy, GradState
from .units import UnitSpec, describe_plan, plan_units
from .zero3 import ParamShardController, Unit

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


@dataclass
class UnitConfig:
    """Stage 3 only: how parameters are grouped into units and when they are gathered."""

    granularity: str = "zero3"  # "zero3": every module with direct parameters; "fsdp": wrap policy
    wrap_classes: Any = None  # fsdp: module classes (or class names) that become units
    min_params: Optional[int] = None  # fsdp: modules with at least this many parameters become units
    reshard_after_forward: bool = True  # free full parameters after forward (False: keep until backward)
    prefetch_depth: int = 1  # units gathered ahead of use, in forward and backward
    leaf_modules: Any = None  # module classes, class names or FQNs whose whole subtree is one unit


def phase(fn):
    """Label an engine phase for ``torch.profiler`` as ``lightning_shard.<method>`` (what ``bench/`` times)."""
    label = f"lightning_shard.{fn.__name__.lstrip('_')}"

    @functools.wraps(fn)
    def labelled(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return labelled


def parse_reduce_dtype(value: Optional[str]) -> Optional[torch.dtype]:
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in _DTYPES:
        raise ValueError(f"reduce_dtype must be null (fp32) or one of {sorted(_DTYPES)}, got {value!r}")
    return _DTYPES[value]


class ShardEngine:
    def __init__(self, module: nn.Module, optimizers: list[torch.optim.Optimizer], *, stage: int,
                 group: Any = None, bucket_mb: float = 25.0, reduce_dtype: Optional[str] = None,
                 accumulation: str = "defer", overlap: bool = True, broadcast_buffers: bool = True,
                 allow_custom_optimizer: bool = False, find_unused_parameters: bool = True,
                 units: Optional[UnitConfig] = None, deferred: Optional[DeferredInit] = None,
                 replicate_group: Any = None, overlap_param_gather: bool = True,
                 optim_chunk_mb: float = 4.0, skip_nonfinite: Optional[bool] = None,
                 debug_collectives: bool = False, gather_group: Any = None) -> None:
        self.spec = ShardSpec(stage, C.get_world_size(group))  # what the stage means, for every bucket
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0 (MiB per gradient bucket), got {bucket_mb}")
        policy = AccumulationPolicy.parse(accumulation)
        if policy is AccumulationPolicy.PER_MICRO_BATCH and not self.spec.frees_grads:
            raise ValueError(f"accumulation='per_micro_batch' needs sharded gradients (stage 2 or 3); stage {stage} "
                             "holds full gradients anyway, so use accumulation='defer'.")
        if policy is AccumulationPolicy.KEEP_PARAMS and not self.spec.shards_params:
            raise ValueError(f"accumulation='keep_params' is about sharded parameters (stage 3); stage {stage} "
                             "never frees its parameters: use accumulation='defer'.")
        if not optimizers:
            raise ValueError("no optimizer to shard: configure_optimizers() returned nothing")
        self.module, self.stage, self.group, self.policy = module, stage, group, policy
        # hybrid sharding: ``group`` shards (inside an island), ``replicate_group`` holds the copies of this
        # rank's shard in the other islands; gradients are averaged over both, i.e. over every rank
        self.world, self.rank = C.get_world_size(group), C.get_rank(group)
        self.replicate_group = replicate_group
        self.replicas = C.get_world_size(replicate_group) if replicate_group is not None else 1
        self.total_world = self.world * self.replicas
        self.reduce_dtype = parse_reduce_dtype(reduce_dtype)
        self.overlap, self.broadcast_buffers = overlap, broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self._warned_unused: set[str] = set()
        self.bucket_bytes = int(bucket_mb * 2**20)
        if not optim_chunk_mb > 0:
            raise ValueError(f"optim_chunk_mb must be > 0 (MiB of shard per optimizer tensor), got {optim_chunk_mb}")
        self.chunk_numel = max(1, int(optim_chunk_mb * 2**20) // 4)  # fp32 elements (masters are fp32)
        for opt in optimizers:
            validate_optimizer(opt, allow_custom_optimizer)
        self.bindings = [OptimizerBinding(i, opt) for i, opt in enumerate(optimizers)]
        self.deferred = deferred
        self.skip_nonfinite, self.debug_collectives = skip_nonfinite, debug_collectives
        health.check_same_model(self.module, self.deferred)
        self._ledger_mark = C.LEDGER.mark()
        if deferred is None:  # deferred init: every rank computes the same values from the same RNG state
            sync_module_states(self.module, None)
        elif not self.spec.shards_params:
            raise ValueError("deferred (meta-device) initialization needs parameter sharding: use zero3 or fsdp_shard")
        owner = self._param_owners()
        self.controller: Optional[ParamShardController] = None
        self.units: list[Unit] = []
        self.plan_summary = ""
        self.gather_group = group
        if self.spec.shards_params:
            cfg = units or UnitConfig()
            specs = plan_units(module, cfg.granularity, cfg.wrap_classes, cfg.min_params,
                               numel=deferred.numel if deferred is not None else (lambda p: p.numel()),
                               leaf_modules=cfg.leaf_modules)
            self.plan_summary = describe_plan(specs, cfg.granularity)
            health.agree("unit plan", [(s.name, len(s.params)) for s in specs], "wrap policy or model structure")
            # parameter gathers get a process group of their own: ranks that run different modules issue them
            # at different times relative to the gradient reductions (plain sharding: a copy of the world
            # group; hybrid layouts pass a copy of each shard group)
            if gather_group is None and group is None and C.get_world_size() > 1:
                gather_group = C.duplicate_group(None, "gather")
            self.gather_group = gather_group if gather_group is not None else group
            self.buckets, self.units = self._build_unit_buckets(specs, owner)
            self.controller = ParamShardController(self, self.units, cfg.reshard_after_forward, cfg.prefetch_depth)
        else:
            self.buckets = self._build_flat_buckets(owner)
        self._comm_buckets = [b for b in self.buckets if b.trainable]
        for binding in self.bindings:
            binding.rebind(self.buckets)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(b, i))
                       for b in self._comm_buckets for i, p in enumerate(b.params)]
        # stages 1/2: the all-gather after a step runs in the background and each module waits for its own
        # buckets in a forward pre-hook, so the gather overlaps the next forward (see finish_step)
        self.overlap_param_gather = overlap_param_gather and self.spec.gathers_after_step
        self._pending_gathers: list[Bucket] = []
        if self.overlap_param_gather:
            self._hooks += self._register_gather_waits()
        self._require_sync = True
        self._comm_this_backward = False
        self.boundary_backward = False  # the backward running now ends an accumulation window
        self._next_launch = 0
        self.last_grad_norm: Optional[float] = None

    # ------------------------------------------------------------------ health (health.py)
    def check_collective_sequence(self) -> None:
        """Debug (``debug_collectives=True``): all ranks issued the same collectives since the last check."""
        self._ledger_mark = health.check_collective_sequence(self._ledger_mark)

    def find_nonfinite(self, optimizer: torch.optim.Optimizer) -> Optional[str]:
        """Name of the first parameter with a non-finite gradient on any rank (agreed on every rank), or None."""
        rank = self.rank if self.total_world == self.world else C.get_rank()
        return health.find_nonfinite(self.binding_for(optimizer).buckets, rank, self.total_world, self.buckets[0].device)

    # ------------------------------------------------------------------ buckets (plan.py)
    def _param_owners(self) -> dict[int, Owner]:
        """``id(param) -> (optimizer index, param group index)``, validating the optimizers' parameters."""
        owner = param_owners(self.module, [b.orig_groups for b in self.bindings])
        if not any(p.requires_grad and id(p) in owner for p in self.module.parameters()):
            raise ValueError("the model has no trainable parameter that an optimizer updates: nothing to shard. "
                             "Check requires_grad and the parameters passed to the optimizer.")
        return owner

    def _bucket(self, index: int, params: list[nn.Parameter], names: list[str], key: Optional[Owner]) -> Bucket:
        return Bucket(index, params, names, key[0] if key else None, key[1] if key else None, spec=self.spec,
                      rank=self.rank, group=self.group, replicate_group=self.replicate_group,
                      chunk_numel=self.chunk_numel, gather_group=self.gather_group)

    def _build_unit_buckets(self, specs: list[UnitSpec], owner: dict[int, Owner]) -> tuple[list[Bucket], list[Unit]]:
        """Stage 3: the buckets of :func:`.plan.unit_buckets`, made unit by unit (with deferred init, as soon
        as every module touching the unit is materialized). Bucket order, the reduction launch order, is
        reverse unit order: roughly the order backward produces gradients."""
        per_unit: dict[int, list[Bucket]] = {}

        def make(ui: int) -> None:
            spec = specs[ui]
            per_unit[ui] = [self._bucket(-1, [spec.params[i] for i in idx], [spec.names[i] for i in idx], key)
                            for key, idx in unit_buckets(spec, owner)]
            if self.deferred is not None:
                self.deferred.sharded(spec.params)

        d = self.deferred
        if d is None:
            for ui in range(len(specs)):
                make(ui)
        else:  # materialize module by module; shard a unit as soon as every module touching it is done
            waiting = {ui: {id(m) for p in spec.params if d.is_deferred(p) for m in d.referrers[id(p)]}
                       for ui, spec in enumerate(specs)}
            for ui, w in waiting.items():
                if not w:
                    make(ui)
            for m in d.modules_in_order():
                d.materialize(m)
                for ui, w in waiting.items():
                    if ui not in per_unit and id(m) in w:
                        w.discard(id(m))
                        if not w:
                            make(ui)
        buckets: list[Bucket] = []
        for ui in reversed(range(len(specs))):
            for b in per_unit[ui]:
                b.index = len(buckets)
                buckets.append(b)
        return buckets, [Unit(ui, spec, per_unit[ui]) for ui, spec in enumerate(specs)]

    def _build_flat_buckets(self, owner: dict[int, Owner]) -> list[Bucket]:
        names = {id(p): n for n, p in self.module.named_parameters(remove_duplicate=True)}
        return [self._bucket(i, ps, [names[id(p)] for p in ps], key)
                for i, (key, ps) in enumerate(flat_buckets(self.module, owner, self.bucket_bytes))]

    def _register_gather_waits(self) -> list[Any]:
        owners: dict[int, set[int]] = {}
        for b in self.buckets:
            for p in b.params:
                owners.setdefault(id(p), set()).add(b.index)
        handles = []
        for m in self.module.modules():
            mine = sorted({i for p in m.parameters(recurse=False) for i in owners.get(id(p), ())})
            if mine:
                waits = [self.buckets[i] for i in mine]
                handles.append(m.register_forward_pre_hook(lambda mod, args, waits=waits: self._wait(waits)))
        return handles

    def _wait(self, buckets: list[Bucket]) -> None:
        for b in buckets:
            b.wait_param_gather()

    def wait_params(self) -> None:
        """Finish every parameter all-gather still in flight (before anything reads or writes parameters
        outside a forward: the optimizer step, checkpoints, evaluation, teardown)."""
        pending, self._pending_gathers = self._pending_gathers, []
        self._wait(pending)

    def _make_hook(self, bucket: Bucket, i: int):
        def hook(_: torch.Tensor) -> None:
            if bucket.grad_buf is None:  # a backward that did not go through pre_backward
                return
            bucket.adopt_grad(i)
            if bucket.unit is not None and bucket.unit.pending == 0:
                self.controller.on_grads_ready(bucket.unit)
            self.bucket_ready(bucket)
        return hook

    def bucket_ready(self, bucket: Bucket) -> None:
        """A bucket may have all of its gradients for this backward: launch the reductions that are due."""
        if self._comm_this_backward and self.overlap and bucket.pending == 0:
            self._launch_in_order(force=False)

    # ------------------------------------------------------------------ the controller
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches run inside this context are not an accumulation boundary."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def communicates_on_next_backward(self) -> bool:
        return self._require_sync or self.policy is AccumulationPolicy.PER_MICRO_BATCH

    @phase
    def pre_backward(self) -> None:
        self.wait_params()
        self.boundary_backward = self._require_sync
        self._comm_this_backward = self.communicates_on_next_backward()
        self._next_launch = 0
        for b in self._comm_buckets:
            if b.state is GradState.REDUCED:
                raise RuntimeError(
                    f"rank {self.rank}: backward ran again after the gradients of bucket {b.index} ({b.names[0]}...) "
                    "were reduced and before the optimizer stepped. Call optimizer.step() after the boundary "
                    "backward, or wrap earlier micro-batches in strategy.block_backward_sync()/toggle_model(sync_grad=False)."
                )
            if self.spec.shards_params:  # parameters are sharded now: views attach when the unit is gathered
                b.pending = len(b.params)
            else:
                b.attach_grads()
        if self.controller is not None:
            self.controller.begin_backward()

    @phase
    def post_backward(self) -> None:
        if self.controller is not None:
            self.controller.close_backward_schedule()
        if not self._comm_this_backward:
            for b in self._comm_buckets:
                b.set_state(GradState.ACCUMULATING)
        else:
            self._launch_in_order(force=True)
            accumulate = self.policy is AccumulationPolicy.PER_MICRO_BATCH
            for b in self._comm_buckets:
                b.finish_reduce(self.boundary_backward, accumulate)
            self._comm_this_backward = False
        if self.controller is not None:
            self.controller.end_backward()

    def _launch_in_order(self, force: bool) -> None:
        while self._next_launch < len(self._comm_buckets):
            b = self._comm_buckets[self._next_launch]
            if not force and b.pending > 0:
                return
            b.launch_reduce(self._reduce_dtype_for(b), async_op=True)
            self._next_launch += 1

    def _reduce_dtype_for(self, b: Bucket) -> torch.dtype:
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return torch.float32 if b.dtype in (torch.float16, torch.bfloat16) else b.dtype

    # ------------------------------------------------------------------ optimizer step
    def binding_for(self, optimizer: torch.optim.Optimizer) -> OptimizerBinding:
        for b in self.bindings:
            if b.optimizer is optimizer:
                return b
        raise ValueError(f"optimizer {type(optimizer).__name__} is not managed by this strategy; create it in "
                         "configure_optimizers()")

    @phase
    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Make sure this optimizer's shard gradients are final (reduces now if no boundary backward ran)."""
        self.wait_params()
        accumulate = self.policy is AccumulationPolicy.PER_MICRO_BATCH
        for b in self.binding_for(optimizer).buckets:
            if b.state in (GradState.EMPTY, GradState.ACCUMULATING):
                b.launch_reduce(self._reduce_dtype_for(b), async_op=False)
                b.finish_reduce(True, accumulate)
        self._leave_out_unused(optimizer)
        if self.controller is not None:
            self.controller.before_step()

    @phase
    def _leave_out_unused(self, optimizer: torch.optim.Optimizer) -> None:
        """Parameters that got no gradient on any rank in this window are left out of the step, exactly as torch
        leaves a parameter whose ``.grad`` is None (no momentum, weight decay or Adam step). Costs one all-reduce
        of one byte per parameter per optimizer step (``find_unused_parameters=True``, the default).

        With ``find_unused_parameters=False`` the mask is not exchanged: every parameter steps, one without a
        gradient with zeros (as DDP's ``find_unused_parameters=False`` would, had it not raised); a parameter that
        got no gradient on this rank is named once in a warning."""
        buckets = self.binding_for(optimizer).buckets
        if not buckets:
            return
        mask = torch.cat([b.used for b in buckets]).to(self.buckets[0].device)
        if not self.find_unused_parameters:
            for b in buckets:
                for i in range(len(b.params)):
                    if not b.used[i] and b.names[i] not in self._warned_unused:
                        self._warned_unused.add(b.names[i])
                        warnings.warn(f"rank {C.get_rank()}: parameter {b.names[i]} got no gradient in this window; "
                                      "with find_unused_parameters=False it steps with a zero gradient (momentum and "
                                      "weight decay still move it). Leave find_unused_parameters at True (default) "
                                      "for the result of one process.", stacklevel=3)
            return
        if self.total_world > 1:
            C.all_reduce(mask, op="max", group=None, tag="used_mask")
        unused = (mask == 0).tolist()
        off, split = 0, False
        for b in buckets:
            split |= b.leave_out([i for i in range(len(b.params)) if unused[off + i]], optimizer.state)
            off += len(b.params)
        if split:  # parameters now treated apart got chunks of their own: the optimizer must see them
            self.binding_for(optimizer).rebind(self.buckets)

    @phase
    def finish_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer updated the shards: all-gather parameters, sync buffers, close the window."""
        if self.debug_collectives:
            self.check_collective_sequence()
        buckets = self.binding_for(optimizer).buckets
        for b in reversed(buckets):  # forward order: the first layers' parameters arrive first
            b.launch_gather(async_op=True)
        if self.overlap_param_gather:
            self._pending_gathers += [b for b in buckets if b.spec.gathers_after_step]
        else:
            self._wait(buckets)
        for b in buckets:
            b.end_window()
        if self.broadcast_buffers and self.total_world > 1:
            buffers = [t for t in self.module.buffers() if t.is_floating_point() or t.dtype == torch.long]
            if buffers:
                C.broadcast_coalesced(buffers, None, tag="buffers")

    def skip_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop this window's gradients without updating (e.g. fp16 overflow), identically on every rank."""
        for b in self.binding_for(optimizer).buckets:
            b.end_window()

    # ------------------------------------------------------------------ gradient utilities (grads.py)
    def _shard_grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [b.shard_param.grad for b in self.binding_for(optimizer).buckets if b.shard_param.grad is not None]

    def grad_norm(self, optimizer: torch.optim.Optimizer, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over owned shard elements only (no padding, no replicas), one all-reduce."""
        return grads.grad_norm(self._shard_grads(optimizer), self.buckets[0].device, self.group,
                               self.spec.reduce_scatters and self.world > 1, norm_type)

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        total = self.grad_norm(optimizer, norm_type)
        self.last_grad_norm = float(total)
        grads.scale_to_norm(self._shard_grads(optimizer), total, max_norm)
        return total

    def clip_grad_value_(self, optimizer: torch.optim.Optimizer, clip_value: float) -> None:
        grads.clamp_values(self._shard_grads(optimizer), clip_value)

    def unscale_and_check(self, optimizer: torch.optim.Optimizer, inv_scale: float) -> bool:
        """Multiply shard grads by ``inv_scale``; return True when any rank saw inf/nan (agreed on all ranks)."""
        return grads.unscale(self._shard_grads(optimizer), inv_scale, self.buckets[0].device, self.total_world)

    # ------------------------------------------------------------------ full weights (state_dict.py)
    def gather_full(self) -> dict[str, torch.Tensor]:
        """Full weights by parameter name that the module itself cannot show (:func:`.state_dict.gather_full`)."""
        self.wait_params()
        return state_dict.gather_full(self.module, self.buckets, self.group)

    def load_full(self, state: dict[str, torch.Tensor], masters_only: bool = False) -> list[str]:
        """Load full tensors by name into shards and fp32 masters; the names not found (:func:`.state_dict.load_full`)."""
        return state_dict.load_full(self.module, self.buckets, state, masters_only)

    # ------------------------------------------------------------------ accounting and teardown
    def memory_report(self) -> dict[str, int]:
        """Bytes of model state held by this rank, measured from the tensors."""
        rep = {"params": 0, "gathered_params": 0, "grads": 0, "master": 0, "accumulators": 0, "optimizer_state": 0}
        bucketed = set()
        for b in self.buckets:
            for k, v in b.tensor_bytes().items():
                rep[k] += v
            bucketed.update(id(p) for p in b.params)
        for p in self.module.parameters():
            if id(p) not in bucketed:
                rep["params"] += p.numel() * p.element_size()
                if p.grad is not None:
                    rep["grads"] += p.grad.numel() * p.grad.element_size()
        rep["optimizer_state"] = sum(optimizer_state_bytes(b.optimizer) for b in self.bindings)
        rep["padding_elements"] = sum(b.layout.padding for b in self.buckets) if self.spec.reduce_scatters else 0
        rep["total"] = sum(v for k, v in rep.items() if k != "padding_elements")
        return rep

    def remove_hooks(self) -> None:
        self.wait_params()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.controller is not None:
            self.controller.remove_hooks()


def sync_module_states(module: nn.Module, group: C.Group) -> None:
    """Every rank starts from rank 0's parameters and buffers (as DDP does at construction)."""
    if C.get_world_size(group) > 1:
        C.broadcast_coalesced([p.data for p in module.parameters()] + list(module.buffers()), group, tag="init_states")
