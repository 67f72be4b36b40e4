"""The sharding engine: the wiring of one ZeRO stage (0-3) around a module and its optimizers, calling the rooms in
the order of a training step: set-up (:mod:`.health`, :mod:`.buckets.plan`, :mod:`.build`, stage 3's
:mod:`.zero3`), backward (gradient hooks into :mod:`.buckets`, :mod:`.buckets.sync` launching the reductions),
step (:func:`.buckets.optim.leave_out_unused`, the optimizer on shard chunks, :mod:`.buckets.param_gather`),
and the utilities (:mod:`.norms`, :mod:`.state_dict`, :mod:`.memory`). What a stage means: :class:`.spec.ShardSpec`.
"""

from __future__ import annotations

import dataclasses
import warnings
from functools import cached_property
from typing import Optional

import torch
from torch import nn

from ..options import ZeroOptions
from . import health, memory, mixed, norms, state_dict
from .buckets.bucket import Bucket
from .buckets.context import BucketContext
from .buckets.optim import OptimizerBinding, leave_out_unused, validate_optimizer
from .buckets.param_gather import PostStepGathers
from .buckets.plan import Owner, param_owners
from .buckets.sync import GradSync
from .build import build_flat, build_units, unit_of
from .comm import collectives as C
from .comm.choices import CommChoices
from .comm.groups import Groups
from .labels import phase
from .mixed import parse_dtype, parse_param_dtype
from .spec import ShardSpec
from .states import AccumulationPolicy, GradState, SyncState
from .zero3.controller import ParamShardController
from .zero3.deferred import DeferredInit
from .zero3.plan import describe_plan, plan_units
from .zero3.unit import Unit


class ShardEngine:
    """The engine of one strategy: ``options`` (:mod:`lightning_shard.options`, validated by whoever made them: the
    strategies, :func:`lightning_shard.options.options_for`) say what to build, ``groups`` over which ranks.
    ``options.accumulation`` must be resolved (not ``"auto"``). ``deferred``: a meta-device model to materialize
    unit by unit (stage 3). ``comm``: how collectives run on this backend (None: the engine's per-backend choice,
    :class:`.comm.choices.CommChoices`; the benchmarks and tests compare the other forms through it)."""

    def __init__(self, module: nn.Module, optimizers: list[torch.optim.Optimizer], options: ZeroOptions,
                 groups: Optional[Groups] = None, *, deferred: Optional[DeferredInit] = None,
                 comm: Optional[CommChoices] = None) -> None:
        groups = dataclasses.replace(groups) if groups is not None else Groups()
        tuning, compression = options.tuning, options.compression
        self.options, self.module, self.deferred = options, module, deferred
        self.spec = ShardSpec(options.stage, C.get_world_size(groups.shard))  # what the stage means, per bucket
        self.policy = self._parse_policy(options.accumulation)
        if not optimizers:
            raise ValueError("no optimizer to shard: configure_optimizers() returned nothing")
        # hybrid sharding: ``groups.shard`` shards (inside an island), ``groups.replicate`` holds the copies of this
        # rank's shard in the other islands; gradients are averaged over both, i.e. over every rank
        self.rank = C.get_rank(groups.shard)
        replicas = C.get_world_size(groups.replicate) if groups.replicate is not None else 1
        self.total_world = self.spec.world * replicas
        comm = comm or CommChoices()
        if compression.reduce_quant != "none" and comm.reduce_scatter not in ("auto", "all_to_all"):
            raise ValueError(f"reduce_quant={compression.reduce_quant!r} sends quantized pieces in an all-to-all: "
                             f"reduce_scatter={comm.reduce_scatter!r} cannot apply")
        param_dtype = parse_param_dtype(options.param_dtype)
        first = next(module.parameters(), None)
        if options.offload_optimizer and first is not None and first.device.type == "cpu":
            warnings.warn("offload_optimizer on CPU parameters: host memory is the device memory here, so nothing is "
                          "saved; the fp32 master shard and the gradient shard it copies out cost 8 bytes per "
                          "parameter / N more. It is meant for accelerators.", stacklevel=3)
        self._warned_unused: set[str] = set()
        for opt in optimizers:
            validate_optimizer(opt, options.safety.allow_custom_optimizer)
        self.bindings = [OptimizerBinding(i, opt) for i, opt in enumerate(optimizers)]
        health.check_same_model(self.module, self.deferred)
        self._ledger_mark = C.LEDGER.mark()
        if deferred is None:  # deferred init: every rank computes the same values from the same RNG state
            sync_module_states(self.module, None)
        elif not self.spec.shards_params:
            raise ValueError("deferred (meta-device) initialization needs parameter sharding: use zero3 or fsdp_shard")
        owner = self._owner = self._param_owners()
        if param_dtype is not None:
            mixed.check_module(module, owner, self.spec.shards_params, param_dtype)
        self.controller: Optional[ParamShardController] = None
        self.units: list[Unit] = []
        self.plan_summary = ""
        # parameter gathers get a process group of their own (plain sharding: a copy of the world group; hybrid
        # layouts pass a copy of each shard group). Stage 3: ranks that run different modules issue them at different
        # times relative to the gradient reductions. Stages 1/2: the post-step all-gather runs in the background
        # until the next forward needs it, and a collective issued on the same group in between (Lightning
        # broadcasts a SIGTERM flag from rank 0 before every batch, on the world group) would otherwise wait for the
        # whole gather, leaving nothing for the forward to overlap
        if (self.spec.shards_params or self.spec.gathers_after_step) and groups.gather is None \
                and groups.shard is None and C.get_world_size() > 1:
            groups.gather = C.duplicate_group(None, "gather")
        if groups.gather is None:
            groups.gather = groups.shard
        self.groups = groups
        reduce_dtype = parse_dtype(compression.reduce_dtype)
        if param_dtype is not None and reduce_dtype is None:
            reduce_dtype = torch.float32  # the policy computes in param_dtype and reduces in fp32 by default
        self.context = BucketContext(
            spec=self.spec, rank=self.rank, group=groups.shard, replicate_group=groups.replicate,
            gather_group=groups.gather, secondary_group=groups.island,
            chunk_numel=max(1, int(tuning.optim_chunk_mb * 2**20) // 4),  # fp32 elements (masters are fp32)
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, offload=options.offload_optimizer,
            offload_params=getattr(options, "offload_params", False), gather_quant=compression.gather_quant,
            reduce_quant=compression.reduce_quant, quant_block=compression.block,
            error_feedback=compression.error_feedback, comm=comm)
        if self.spec.shards_params:
            granularity = options.granularity or "zero3"
            specs = plan_units(module, granularity, getattr(options, "wrap_classes", None),
                               getattr(options, "min_params", None),
                               numel=deferred.numel if deferred is not None else (lambda p: p.numel()),
                               leaf_modules=options.leaf_modules, min_unit_bytes=tuning.min_unit_mb * 2**20)
            self.plan_summary = describe_plan(specs, granularity)
            health.agree("unit plan", [(s.name, len(s.params)) for s in specs], "wrap policy or model structure")
            self.buckets, self.units = build_units(specs, owner, deferred, self._bucket)
        else:
            self.buckets = build_flat(module, owner, int(tuning.bucket_mb * 2**20), self._bucket)
        self.sync = GradSync([b for b in self.buckets if b.trainable], self.policy, tuning.overlap)
        if self.units:
            self.controller = ParamShardController(module, self.units, self.sync, tuning.reshard_after_forward,
                                                   tuning.prefetch(granularity))
        for binding in self.bindings:
            binding.rebind(self.buckets)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(b, i))
                       for b in self.sync.buckets for i, p in enumerate(b.params)]
        # stages 1/2: the all-gather after a step runs in the background and each module waits for its own
        # buckets in a forward pre-hook, so the gather overlaps the next forward (see finish_step)
        self.gathers = PostStepGathers(module, self.buckets, tuning.overlap_param_gather)
        self._hooks += self.gathers.handles
        if param_dtype is not None:  # modules holding cast parameters compute in param_dtype
            self._hooks += mixed.cast_inputs(module, [p for b in self.buckets if b.cast for p in b.params],
                                             param_dtype)
        self.last_grad_norm: Optional[float] = None
        self._switched: list[nn.Parameter] = []  # module parameters switched off for the backward in progress
        # an optimizer of which some rank owns no element (fewer elements than ranks): that rank has no chunk whose
        # requires_grad a toggle_optimizer could set, so the ranks agree on the toggles at each backward (one byte
        # per optimizer, only then); every rank computes this from the same layouts
        self._toggle_blind = self.total_world > 1 and any(
            all(b.layout.owned_range(r)[0] >= b.layout.owned_range(r)[1] for b in binding.buckets)
            for binding in self.bindings for r in range(self.spec.num_shards))
        self._restored = False  # restore_source_dtype() ran

    def _parse_policy(self, accumulation: str) -> AccumulationPolicy:
        policy = AccumulationPolicy.parse(accumulation)
        stage = self.spec.stage
        if policy is AccumulationPolicy.PER_MICRO_BATCH and not self.spec.frees_grads:
            raise ValueError(f"accumulation='per_micro_batch' needs sharded gradients (stage 2 or 3); stage {stage} "
                             "holds full gradients anyway, so use accumulation='defer'.")
        if policy is AccumulationPolicy.KEEP_PARAMS and not self.spec.shards_params:
            raise ValueError(f"accumulation='keep_params' is about sharded parameters (stage 3); stage {stage} "
                             "never frees its parameters: use accumulation='defer'.")
        return policy

    def set_policy(self, accumulation: str) -> None:
        """The accumulation policy from the next window on (the accumulation changed between windows). Every
        gradient bucket must be empty: the previous window has stepped."""
        policy = self._parse_policy(accumulation)
        busy = [b.index for b in self.sync.buckets if b.state is not GradState.EMPTY]
        if busy or self.sync.state is not SyncState.IDLE:
            raise RuntimeError(f"rank {self.rank}: the accumulation policy can change only between windows, but "
                               f"bucket(s) {busy} still hold this window's gradients; change accumulate_grad_batches "
                               "where a window ends (GradientAccumulationScheduler does: at an epoch's start)")
        self.policy = self.sync.policy = policy  # stage 3 reads keep_params from here too

    # ------------------------------------------------------------------ health (health.py)
    def check_collective_sequence(self) -> None:
        """Debug (``debug_collectives=True``): all ranks issued the same collectives since the last check."""
        self._ledger_mark = health.check_collective_sequence(self._ledger_mark)

    def find_nonfinite(self, optimizer: torch.optim.Optimizer) -> Optional[str]:
        """Name of the first parameter with a non-finite gradient on any rank (agreed on every rank), or None."""
        rank = self.rank if self.total_world == self.spec.world else C.get_rank()
        return health.find_nonfinite(self.binding_for(optimizer).buckets, rank, self.total_world,
                                     self.buckets[0].device)

    # ------------------------------------------------------------------ buckets (plan.py)
    def _param_owners(self) -> dict[int, Owner]:
        """``id(param) -> (optimizer index, param group index)``, validating the optimizers' parameters."""
        owner = param_owners(self.module, [b.orig_groups for b in self.bindings])
        if not any(p.requires_grad and id(p) in owner for p in self.module.parameters()):
            raise ValueError("the model has no trainable parameter that an optimizer updates: nothing to shard. "
                             "Check requires_grad and the parameters passed to the optimizer.")
        return owner

    def _bucket(self, index: int, params: list[nn.Parameter], names: list[str], opt_index: Optional[int],
                unit: Optional[str]) -> Bucket:
        groups = None if opt_index is None else [self._owner[id(p)][1] for p in params]
        return Bucket(self.context, index, params, names, opt_index, groups, unit)

    def watch_step(self):
        """Around the code of a training step (stages 1/2): :meth:`.param_gather.PostStepGathers.watch`."""
        return self.gathers.watch()

    def wait_params(self) -> None:
        """Finish every parameter all-gather still in flight (before anything reads or writes parameters
        outside a forward: the optimizer step, checkpoints, evaluation, teardown)."""
        self.gathers.wait_all()

    @cached_property
    def _unit_of(self) -> dict[int, Unit]:
        return unit_of(self.units)  # stage 3: ``id(bucket) -> its unit`` (the bucket does not point back)

    def _make_hook(self, bucket: Bucket, i: int):
        grads, unit = bucket.grads, self._unit_of.get(id(bucket))

        def hook(_: torch.Tensor) -> None:
            if grads.grad_buf is None:
                if not grads.lazy:  # a backward that did not go through pre_backward
                    return
                grads.attach()  # the bucket's first gradient of this backward: allocate now
            grads.adopt(i)
            if unit is not None and unit.pending == 0:
                self.controller.backward.on_grads_ready(unit)
            self.sync.bucket_ready(bucket)
        return hook

    # ------------------------------------------------------------------ the backward (sync.py)
    def no_sync(self):
        """Micro-batches run inside this context are not an accumulation boundary."""
        return self.sync.no_sync()

    @phase
    def pre_backward(self) -> None:
        self.wait_params()
        self.sync.begin(self._switch_off_toggled())
        for b in self.sync.active:
            if self.spec.shards_params:  # parameters are sharded now: views attach when the unit is gathered
                b.pending = len(b.params)
            elif self.spec.frees_grads and b.grad_buf is None:  # ZeRO-2: full gradients only while needed
                b.expect_grads()
            else:
                b.attach_grads()
        if self.controller is not None:
            self.controller.begin_backward()

    @phase
    def post_backward(self) -> None:
        if self.controller is not None:
            self.controller.backward.close()
        self.sync.reduce_rest()
        if self.controller is not None:
            self.controller.end_backward()
        self.sync.end()
        self._switch_on_toggled()

    def _switch_off_toggled(self) -> list[Bucket]:
        """Lightning's ``toggle_optimizer(opt)`` sets ``requires_grad=False`` on the other optimizers' parameters,
        which here are shard chunks (:mod:`.optim`): their module parameters are switched off for this backward too
        (autograd then accumulates nothing into them, as under DDP, where the forward left them out), and their
        buckets keep their state. Returns the buckets this backward may give gradients to."""
        self._switch_on_toggled()  # a backward that raised left them off
        flags = [binding.toggled_off() for binding in self.bindings]
        if self._toggle_blind:  # a rank holding no element of an optimizer cannot see its toggle: the others say
            agreed = torch.tensor(flags, dtype=torch.uint8, device=self.buckets[0].device)
            C.all_reduce(agreed, op="max", group=None, tag="toggled")
            flags = [bool(x) for x in agreed.tolist()]
        off = {id(b) for binding, flag in zip(self.bindings, flags) if flag for b in binding.buckets}
        if not off:
            return self.sync.buckets
        self._switched = [p for b in self.sync.buckets if id(b) in off for p in b.params if p.requires_grad]
        for p in self._switched:
            p.requires_grad_(False)
        return [b for b in self.sync.buckets if id(b) not in off]

    def _switch_on_toggled(self) -> None:
        for p in self._switched:
            p.requires_grad_(True)
        self._switched = []

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
        self.final_grads(optimizer)
        buckets = self.binding_for(optimizer).buckets
        for b in buckets:
            b.wait_offload()  # offload on CUDA: the gradient shards have reached host memory
        self._leave_out_unused(optimizer)
        if self.controller is not None:
            self.controller.before_step()

    @phase
    def _leave_out_unused(self, optimizer: torch.optim.Optimizer) -> None:
        """Parameters no rank gave a gradient in this window step as torch steps a ``.grad`` of None: not at all
        (:func:`.buckets.optim.leave_out_unused`)."""
        binding, find_unused = self.binding_for(optimizer), self.options.tuning.find_unused_parameters
        if leave_out_unused(binding, find_unused, self.total_world, self._warned_unused):
            binding.rebind(self.buckets)  # parameters treated apart got chunks of their own: the optimizer sees them

    @phase
    def finish_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer updated the shards: all-gather parameters, sync buffers, close the window."""
        if self.options.safety.debug_collectives:
            self.check_collective_sequence()
        buckets = self.binding_for(optimizer).buckets
        self.gathers.launch(buckets)
        # the module's parameters changed where autograd cannot see it (the optimizer stepped shard chunks): a graph
        # built before this step and backwarded after it (retain_graph=True) is refused as torch refuses it for a
        # parameter updated in place (DDP raises the same), instead of differentiating through the new values
        torch.autograd.graph.increment_version([p for b in buckets for p in b.params])
        for b in buckets:
            b.end_window()
        if self.controller is not None:
            self.controller.after_step()
        if self.options.tuning.broadcast_buffers and self.total_world > 1:
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

    def final_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """This optimizer's shard gradients are final: what no boundary backward reduced is reduced now (manual
        optimization clips with ``clip_gradients(opt, ...)`` before ``opt.step()``)."""
        self.wait_params()
        self.sync.reduce_now(self.binding_for(optimizer).buckets)

    def grad_norm(self, optimizer: torch.optim.Optimizer, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over owned shard elements only (no padding, no replicas), one all-reduce."""
        self.final_grads(optimizer)
        return norms.grad_norm(self._shard_grads(optimizer), self.buckets[0].device, self.groups.shard,
                               self.spec.reduce_scatters and self.spec.world > 1, norm_type)

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0,
                        total: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Scale the shard gradients to a global norm of at most ``max_norm``; ``total``: the norm when the caller
        already has it from :meth:`grad_norm` (saves its all-reduce)."""
        total = self.grad_norm(optimizer, norm_type) if total is None else total
        self.last_grad_norm = float(total)
        norms.scale_to_norm(self._shard_grads(optimizer), total, max_norm)
        return total

    def clip_grad_value_(self, optimizer: torch.optim.Optimizer, clip_value: float) -> None:
        self.final_grads(optimizer)
        norms.clamp_values(self._shard_grads(optimizer), clip_value)

    def unscale_and_check(self, optimizer: torch.optim.Optimizer, inv_scale: float) -> bool:
        """Multiply shard grads by ``inv_scale``; return True when any rank saw inf/nan (agreed on all ranks)."""
        return norms.unscale(self._shard_grads(optimizer), inv_scale, self.buckets[0].device, self.total_world)

    # ------------------------------------------------------------------ full weights (state_dict.py)
    def gather_full(self) -> dict[str, torch.Tensor]:
        """Full weights by parameter name that the module itself cannot show (:func:`.state_dict.gather_full`)."""
        self.wait_params()
        return state_dict.gather_full(self.module, self.buckets, self.groups.shard)

    def load_full(self, state: dict[str, torch.Tensor], masters_only: bool = False) -> list[str]:
        """Load full tensors by name into shards and fp32 masters; the names not found
        (:func:`.state_dict.load_full`)."""
        return state_dict.load_full(self.module, self.buckets, state, masters_only)

    # ------------------------------------------------------------------ accounting and teardown
    def memory_report(self) -> dict[str, int]:
        """Bytes of model state held by this rank, measured from the tensors."""
        return memory.memory_report(self.module, self.buckets, self.bindings, self.options.offload_optimizer,
                                    self.spec.reduce_scatters)

    def restore_source_dtype(self) -> None:
        """End of training with ``param_dtype``: the module's parameters become the full fp32 masters again, so
        ``model.state_dict()`` after fit holds what was trained (collective: every rank must call)."""
        self.wait_params()
        cast = [b for b in self.buckets if b.cast]
        if self._restored or not cast:
            return
        self._restored = True
        mixed.restore(self.module, cast, state_dict.gather_full(self.module, cast, self.groups.shard))

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
