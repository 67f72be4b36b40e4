"""Parameter sharding (ZeRO-3 / FSDP-style): when each unit's parameters are gathered and freed.

**Collectives follow the plan, not what happened to execute.** Every rank must issue the same all-gathers in
the same order, yet ranks can run different modules (a mixture-of-experts layer runs an expert only where
tokens are routed to it). So the gathers of a forward pass follow one *schedule*, the units in forward order
(registration order in the first step, then the order recorded in it, merged over ranks): when a unit's
forward starts, every scheduled unit up to it is gathered, including the ones this rank skipped, which are
freed again when a later unit's forward ends; at the end of the pass the rest of the schedule is gathered and
freed. Backward does the same over the reversed schedule (only units that can need a backward: from the first
trainable unit on), and a unit that did not run here contributes zeros to its reduction. Parameter gathers use
a process group of their own, so that their order and that of the gradient reductions cannot interleave
differently on different ranks.

Forward: a unit's pre-forward hook gathers it (prefetching the next ``prefetch_depth`` scheduled units), its
post-forward hook frees it (``reshard_after_forward``) and hooks its outputs so that backward gathers it again
(prefetching the units before it). In backward a unit is freed once all of its trainable gradients are in
**and** the gradients of its inputs are computed: frozen weights (LoRA's base) are needed for the latter.

Parameters used outside their unit's forward are found in the first step (:mod:`.guard`) and their unit is
gathered with its user from then on (``Unit.host``). The root unit (tied weights, parameters no unit claims) is
gathered around the whole step.

Policies across an accumulation window (DESIGN.md section 3):
``per_micro_batch``/``keep_unsharded_grads``: gather in forward and backward of every micro-batch;
``keep_params``: gather once per window, keep parameters (and full gradients) until the boundary.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from . import collectives as C
from .bucket import Bucket, Gauge
from .guard import ShardedUseGuard
from .state import AccumulationPolicy, ParamState
from .units import UnitSpec

if TYPE_CHECKING:
    from .engine import ShardEngine

log = logging.getLogger(__name__)


class Unit:
    def __init__(self, index: int, spec: UnitSpec, buckets: list[Bucket]) -> None:
        self.index, self.name, self.module, self.buckets = index, spec.name, spec.module, buckets
        self.trainable = [b for b in buckets if b.trainable]
        self.attached: list[Unit] = []  # units gathered and freed together with this one
        self.host: Optional[Unit] = None  # the unit this one is gathered with (found in the first step)
        self.backward_prepared = False
        self.ran = False  # its forward ran with gradients in the current pass, on this rank
        self.input_waits = 0  # input-gradient hooks of this pass still to fire
        self.resident = False  # run more than once per pass (found in the first step): gathered until the pass ends
        for b in buckets:
            b.unit = self

    @property
    def group(self) -> list["Unit"]:
        """This unit and those gathered with it (transitively)."""
        return [self, *(u for a in self.attached for u in a.group)]

    @property
    def state(self) -> ParamState:
        return self.buckets[0].param_state

    @property
    def pending(self) -> int:
        return sum(b.pending for b in self.trainable)

    @property
    def full_bytes(self) -> int:
        return sum(b.layout.padded_numel * b.itemsize for b in self.buckets)

    def unshard(self, async_op: bool) -> None:
        for b in self.buckets:
            b.unshard(async_op)

    def wait(self) -> None:
        for b in self.buckets:
            b.wait_unshard()

    def reshard(self) -> None:
        for b in self.buckets:
            b.reshard()


@dataclass
class _Pass:
    """One forward pass (a training/validation step's forward) and where its gathers have got to."""

    grad: bool
    cursor: int = 0  # schedule positions [0, cursor) have had their gather issued in this pass
    # issued by catch-up or prefetch, forward not run yet -> the module at whose forward's end it is freed once a
    # later unit has run (None: not passed yet). That module encloses both, so out-of-order calls inside it
    # (a layer norm registered after the block it precedes) still find the unit gathered.
    waiting: dict[Unit, Optional[str]] = field(default_factory=dict)
    extra: list[Unit] = field(default_factory=list)  # gathered because the guard saw them used
    guard: Optional[ShardedUseGuard] = None


def _enclosing(a: str, b: str) -> str:
    """The innermost module enclosing modules ``a`` and ``b`` (FQNs; "" is the LightningModule)."""
    common = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


def merge_orders(orders: list[list[int]], plan: list[int]) -> list[int]:
    """One schedule from the forward orders ranks recorded: rank 0's, with what others saw inserted after their
    predecessor, and units nobody ran after their predecessor in the plan (registration order)."""
    merged: list[int] = []
    for order in [*orders, plan]:
        for i, u in enumerate(order):
            if u in merged:
                continue
            prev = next((order[j] for j in range(i - 1, -1, -1) if order[j] in merged), None)
            merged.insert(0 if prev is None else merged.index(prev) + 1, u)
    return merged


class ParamShardController:
    def __init__(self, engine: "ShardEngine", units: list[Unit], reshard_after_forward: bool,
                 prefetch_depth: int) -> None:
        self.engine, self.units = engine, units
        self.reshard_after_forward, self.prefetch_depth = reshard_after_forward, prefetch_depth
        self.root: Optional[Unit] = next((u for u in units if u.module is None), None)
        self.step_units: list[Unit] = [self.root] if self.root is not None else []  # gathered around the step
        self.plan = [u.index for u in units if u.module is not None]
        self.fwd_order: list[int] = []
        self._backward_plan: set[int] = set()  # units before the first trainable one that need a backward
        self._set_schedule(self.plan)
        self._recording = True  # the first pass with gradients records the forward order
        self._seen: list[int] = []
        # the first pass of each kind (with/without gradients) and the first backward *discover* the plan: the
        # guard runs, gathers outside the schedule are allowed and recorded, and the ranks agree on the findings
        self._discover = {True: True, False: True}
        self._discover_backward = True
        self._found: dict[int, int] = {}  # unit index -> index of the unit whose code used it (-1: the step)
        self._repeated: set[int] = set()  # units run again in one pass after their forward had ended
        self._backward_extra: set[int] = set()  # units outside the backward schedule that got a backward
        self._pass: Optional[_Pass] = None
        self._bcur = 0
        self._idle: list[Unit] = []  # backward: gathered for the schedule, no gradient will come on this rank
        self._stack: list[Unit] = []  # units whose forward is running
        self._param_unit = {id(p): u for u in units for b in u.buckets for p in b.params}
        self.gauge = Gauge()
        for u in units:
            for b in u.buckets:
                b.gauge = self.gauge
        self.events: list[tuple[str, int]] = []  # ("gather"|"prefetch"|"wait"|..., unit index), for tests
        self.record_events = False
        self._handles_paused = False  # inside full_params(): plain forward, no gather/free
        self.released = False  # release_to_module() ran: the module owns full parameters again
        self._handles = []
        for u in units:
            if u.module is not None:
                self._handles.append(u.module.register_forward_pre_hook(self._pre_forward_hook(u), with_kwargs=True))
                self._handles.append(u.module.register_forward_hook(self._post_forward_hook(u)))
        # modules enclosing units: the end of their forward frees the units skipped inside them
        names = {u.name for u in units if u.module is not None}
        enclosing = {n.rsplit(".", k)[0] for n in names for k in range(1, n.count(".") + 1)} - names
        for name, m in engine.module.named_modules():
            if name in enclosing:
                self._handles.append(m.register_forward_hook(lambda mod, a, o, name=name: self._end_of(name)))

    # ------------------------------------------------------------------ schedule
    def _set_schedule(self, order: list[int]) -> None:
        self.fwd_order = [i for i in order if self.units[i].host is None and self.units[i] not in self.step_units]
        self._fpos = {u: k for k, u in enumerate(self.fwd_order)}
        first = next((k for k, i in enumerate(self.fwd_order) if any(x.trainable for x in self.units[i].group)),
                     len(self.fwd_order))
        # frozen units before the first trainable one need no backward (their inputs need no gradient), unless
        # the first backward showed otherwise (e.g. inputs that require grad)
        self.bwd_order = [i for k, i in reversed(list(enumerate(self.fwd_order)))
                          if k >= first or i in self._backward_plan]
        self._bpos = {u: k for k, u in enumerate(self.bwd_order)}

    # ------------------------------------------------------------------ bookkeeping
    def _event(self, what: str, unit: Unit) -> None:
        if self.record_events:
            self.events.append((what, unit.index))

    def gathered_bytes(self) -> int:
        return self.gauge.now

    @property
    def peak_gathered_bytes(self) -> int:
        return self.gauge.peak

    def _keep_params(self) -> bool:
        """In a training forward under ``keep_params``: parameters stay for the rest of the window."""
        return self.engine.policy is AccumulationPolicy.KEEP_PARAMS and torch.is_grad_enabled()

    def _keeps_after_forward(self, grad: bool) -> bool:
        return grad and (not self.reshard_after_forward or self.engine.policy is AccumulationPolicy.KEEP_PARAMS)

    def _keep_after_backward(self) -> bool:
        return self.engine.policy is AccumulationPolicy.KEEP_PARAMS and not self.engine.boundary_backward

    @contextmanager
    def _quiet(self) -> Iterator[None]:
        """Our own work inside a hook is not a use of a sharded parameter."""
        guard = self._pass.guard if self._pass is not None else None
        if guard is not None:
            guard.paused += 1
        try:
            yield
        finally:
            if guard is not None:
                guard.paused -= 1

    # ------------------------------------------------------------------ gather / free (a unit and its attached)
    def _issue(self, unit: Unit, what: str = "prefetch") -> None:
        for u in unit.group:
            if u.state is ParamState.SHARDED:
                self._event(what, u)
                u.unshard(async_op=True)

    def _materialize(self, unit: Unit) -> None:
        for u in unit.group:
            if u.state is ParamState.SHARDED:
                self._event("gather", u)
                u.unshard(async_op=False)
            if u.state is ParamState.GATHERING:
                u.wait()
                self._event("ready", u)

    def _unplanned(self, unit: Unit, why: str, backward: bool = False) -> None:
        """A gather the schedule did not foresee. Allowed while the plan is being discovered (every rank runs the
        same code there) and made part of the plan; refused afterwards: whether the other ranks issue the same
        gather now cannot be known, and if they do not, the collectives mismatch (a crash or a hang)."""
        if any(u.state is ParamState.SHARDED for u in unit.group):
            discovering = self._discover_backward if backward else (self._pass is None or self._discover[self._pass.grad])
            if not discovering:
                raise RuntimeError(
                    f"rank {C.get_rank()}: lightning_shard must gather unit {unit.name!r} outside the schedule the "
                    f"ranks agreed in the first step: {why}. If every rank did the same this would be safe, but "
                    "it cannot be known here, and if ranks differ the collectives mismatch (a crash or a hang). "
                    "Make the module that runs it one unit with leaf_modules=[...] (its class or FQN), or run "
                    "generation/export inside strategy.gathered_params().")
            (self._backward_extra if backward else self._repeated).add(unit.index)
            log.debug("unit %s gathered outside the schedule (%s)", unit.name, why)
        self._materialize(unit)

    def _free(self, unit: Unit) -> None:
        for u in unit.group:
            if u.state is ParamState.GATHERING:
                u.wait()
            u.reshard()

    # ------------------------------------------------------------------ forward
    def _pre_forward_hook(self, unit: Unit):
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if self._handles_paused:
                return
            with self._quiet():
                if torch._C._current_graph_task_id() != -1:  # recomputation in backward (activation checkpointing)
                    self._advance_backward_to(unit)
                    self._materialize(unit)  # gathered again if it was freed, e.g. a nested unit of the block
                    return
                self._stack.append(unit)
                p = self._pass
                if p is None:  # a forward outside a step (no schedule): gather on demand
                    self._materialize(unit)
                elif unit.index not in self._fpos:  # gathered with its host, used on its own here
                    self._unplanned(unit, "its module ran outside the unit it is gathered with")
                else:
                    if unit.resident:
                        p.extra.append(unit)
                    if p.grad:
                        unit.ran = True
                        if self._recording and unit.index not in self._seen:
                            self._seen.append(unit.index)
                    p.waiting.pop(unit, None)
                    pos = self._fpos[unit.index]
                    if pos >= p.cursor:
                        for k in range(p.cursor, pos):  # scheduled before this unit: gathered even if skipped here
                            self._issue(self.units[self.fwd_order[k]], "catch_up")
                            p.waiting[self.units[self.fwd_order[k]]] = None
                        self._issue(unit, "gather")
                        p.cursor = pos + 1
                        for k in range(p.cursor, min(len(self.fwd_order), p.cursor + self.prefetch_depth)):
                            self._issue(self.units[self.fwd_order[k]])
                            p.waiting[self.units[self.fwd_order[k]]] = None
                            p.cursor = k + 1
                        self._materialize(unit)
                    else:
                        self._unplanned(unit, "its module ran again after its forward had ended in this step, or "
                                              "out of the order recorded in the first step")
                    for w, at in p.waiting.items():  # passed over by this unit: freed when their enclosure ends
                        if at is None and self._fpos[w.index] < pos:
                            p.waiting[w] = _enclosing(w.name, unit.name)
                if p is not None and p.grad and self._has_frozen(unit):
                    self._watch_inputs(unit, args, kwargs)
        return hook

    @staticmethod
    def _has_frozen(unit: Unit) -> bool:
        """A unit with trainable parameters only is done in backward when its last gradient is accumulated (every
        node that used one of its weights has run); frozen weights are used by nodes that accumulate nothing."""
        owner = unit.host or unit
        return any(not b.trainable for u in owner.group for b in u.buckets)

    def _watch_inputs(self, unit: Unit, args: Any, kwargs: Any) -> None:
        """Backward frees the unit only after the gradients of these inputs exist: computing them needs the
        unit's frozen weights too, after its trainable gradients are already in."""
        owner = unit.host or unit
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        owner.input_waits += 1

        def done(_: Any) -> None:
            owner.input_waits -= 1
            self._maybe_free_after_backward(owner)

        torch.autograd.graph.register_multi_grad_hook(tensors, done, mode="all")

    def _post_forward_hook(self, unit: Unit):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._handles_paused:
                return
            if torch._C._current_graph_task_id() != -1:
                # activation checkpointing recomputes this forward inside backward: the unit is gathered for
                # its backward already and must stay so; its outputs are not a new backward entry point
                return
            with self._quiet():
                if self._stack and self._stack[-1] is unit:
                    self._stack.pop()
                self._event("forward_done", unit)
                self._hook_backward(unit, output)
                p = self._pass
                grad = torch.is_grad_enabled() if p is None else p.grad
                if self._keeps_after_forward(grad) or unit in self._stack or unit.host is not None \
                        or unit in self.step_units or unit.resident:  # freed with their host, the step, the pass
                    return
                self._free(unit)
                self._end_of(unit.name)
        return hook

    def _end_of(self, name: str) -> None:
        """The forward of module ``name`` ended: units skipped inside it will not run in it any more."""
        p = self._pass
        if p is None or self._handles_paused or self._keeps_after_forward(p.grad) or \
                torch._C._current_graph_task_id() != -1:
            return
        with self._quiet():
            for w in [w for w, at in p.waiting.items() if at == name]:
                del p.waiting[w]
                self._free(w)

    def _hook_backward(self, unit: Unit, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._pre_backward(unit), mode="any")

    # ------------------------------------------------------------------ the pass around a step
    def step_pre_forward(self) -> None:
        """Around the LightningModule's step (the root unit is not inside any module forward we can hook)."""
        if self._handles_paused:
            return
        self.abort_pass()
        p = _Pass(grad=torch.is_grad_enabled())
        if p.grad:
            for u in self.units:
                u.ran, u.input_waits = False, 0
        if self._discover[p.grad]:
            p.guard = ShardedUseGuard(self._sharded_unit_of, self._on_sharded_use)
            p.guard.__enter__()
        self._pass = p
        with self._quiet():
            for u in self.step_units:
                self._materialize(u)

    def step_post_forward(self, output: Any) -> None:
        if self._handles_paused:
            return
        self.end_pass()
        if not self.step_units:
            return
        for u in self.step_units:
            self._hook_backward(u, output)
        if not torch.is_grad_enabled() or (self.reshard_after_forward and not self._keep_params()):
            for u in self.step_units:
                self._free(u)

    def end_pass(self) -> None:
        """The forward of the step is over: gather the rest of the schedule (other ranks may need it), free what
        this pass no longer needs, and after the first pass of a kind agree on the order and the findings."""
        p, self._pass = self._pass, None
        if p is None:
            return
        try:
            for k in range(p.cursor, len(self.fwd_order)):
                self._issue(self.units[self.fwd_order[k]], "participate")
                p.waiting[self.units[self.fwd_order[k]]] = ""
            if not self._keeps_after_forward(p.grad):
                for u in [*p.waiting, *p.extra]:
                    self._free(u)
        finally:
            if p.guard is not None:
                p.guard.__exit__(None, None, None)
            self._stack.clear()
        if self._discover[p.grad]:
            self._discover[p.grad] = False
            self._agree(p.grad)

    def abort_pass(self) -> None:
        """A step raised: leave no guard installed (the error propagates)."""
        p, self._pass = self._pass, None
        if p is not None and p.guard is not None:
            p.guard.__exit__(None, None, None)
        self._stack.clear()

    def _agree(self, grad: bool) -> None:
        order = list(self._seen) if grad and self._recording else None
        mine = (order, sorted(self._found.items()), sorted(self._repeated))
        everyone = C.all_gather_object(mine, tag="unit_discovery") if C.get_world_size() > 1 else [mine]
        homes: dict[int, set[int]] = {}
        for _, f, repeated in everyone:
            for ui, hi in f:
                homes.setdefault(ui, set()).add(hi)
            for ui in repeated:
                self.units[ui].resident = True
        for ui, hs in sorted(homes.items()):
            unit = self.units[ui]
            if unit.host is not None or unit in self.step_units:
                continue
            host_index = hs.pop() if len(hs) == 1 else -1
            host = self.units[host_index] if host_index >= 0 else None
            while host is not None and host.host is not None:
                host = host.host
            if host is unit:
                continue
            unit.host = host
            if host is None:
                self.step_units.append(unit)
            else:
                host.attached.append(unit)
            log.info("lightning_shard: parameters of unit %s are used by the code of %s, outside the unit's own "
                     "forward; they are gathered together from now on (found in the first step; declare it with "
                     "leaf_modules=[...] to decide this up front)", unit.name, host.name if host else "the step")
        self._found.clear()
        self._repeated.clear()
        if order is not None:
            self._recording = False
            self._set_schedule(merge_orders([o for o, _, _ in everyone], self.plan))
        else:
            self._set_schedule(self.fwd_order)

    # ------------------------------------------------------------------ the guard (first pass of a kind)
    def _sharded_unit_of(self, t: torch.Tensor) -> Optional[Unit]:
        u = self._param_unit.get(id(t))
        return u if u is not None and u.state is not ParamState.UNSHARDED else None

    def _on_sharded_use(self, unit: Unit, t: torch.Tensor, func: Any) -> None:
        user = self._stack[-1] if self._stack else None
        while user is not None and user.host is not None:
            user = user.host
        self._found.setdefault(unit.index, user.index if user is not None else -1)
        p = self._pass
        if p is not None and unit.index in self._fpos and self._fpos[unit.index] >= p.cursor:
            for k in range(p.cursor, self._fpos[unit.index] + 1):  # still ahead in the schedule: stay in order
                self._issue(self.units[self.fwd_order[k]], "catch_up")
                p.waiting[self.units[self.fwd_order[k]]] = None
            p.cursor = self._fpos[unit.index] + 1
            self._materialize(unit)
        else:
            self._unplanned(unit, "its parameter was used outside the unit's forward")
        if p is not None:
            p.waiting.pop(unit, None)
            p.extra.append(unit)

    # ------------------------------------------------------------------ backward
    def begin_backward(self) -> None:
        self.end_pass()  # manual optimization: backward inside training_step
        self._bcur = 0
        for u in self.step_units:
            if u.state is ParamState.UNSHARDED:
                self._prepare_backward(u)

    def _advance_backward_to(self, unit: Unit) -> None:
        """Issue the backward schedule up to ``unit`` (and the prefetch after it), in schedule order."""
        q = self._bpos.get(unit.index)
        if q is None or q < self._bcur:
            return
        for k in range(self._bcur, q):
            self._catch_up_backward(self.units[self.bwd_order[k]])
        self._issue(unit, "gather")
        self._bcur = q + 1
        for k in range(self._bcur, min(len(self.bwd_order), self._bcur + self.prefetch_depth)):
            self._catch_up_backward(self.units[self.bwd_order[k]])
            self._bcur = k + 1

    def _catch_up_backward(self, unit: Unit) -> None:
        self._issue(unit)
        if not unit.ran and not unit.backward_prepared:
            self._idle.append(unit)  # no gradient will come here; the gather is for the ranks that ran it

    def _settle_idle(self) -> None:
        idle, self._idle = self._idle, []
        for u in idle:
            for x in u.group:
                x.wait()
                for b in x.trainable:
                    if b.pending:
                        b.attach_grads()
                        b.pending = 0
                        self.engine.bucket_ready(b)
            if not self._keep_after_backward():
                self._free(u)

    def _pre_backward(self, unit: Unit) -> None:
        if unit.backward_prepared:
            return
        with self._quiet():
            self._settle_idle()
            if unit in self.step_units:  # every rank's loss reaches the step's root unit first
                self._materialize(unit)
            elif unit.host is not None or unit.index not in self._bpos:
                self._unplanned(unit, "it got a backward it did not get in the first step", backward=True)
            else:
                self._advance_backward_to(unit)
                self._materialize(unit)
            self._prepare_backward(unit)
            self._settle_idle()

    def _prepare_backward(self, unit: Unit) -> None:
        unit.backward_prepared = True
        self._materialize(unit)
        for u in unit.group:
            u.backward_prepared = True
            for b in u.trainable:
                b.attach_grads()

    def on_grads_ready(self, unit: Unit) -> None:
        """All of ``unit``'s gradients are accumulated for this backward."""
        self._maybe_free_after_backward(unit.host or unit)

    def _maybe_free_after_backward(self, unit: Unit) -> None:
        if unit in self.step_units or not unit.backward_prepared or self._keep_after_backward():
            return
        if unit.input_waits == 0 and all(u.pending == 0 for u in unit.group):
            self._free(unit)

    def close_backward_schedule(self) -> None:
        """Autograd is done: gather what the backward schedule has left (other ranks may have needed it), with
        zero gradients here, before the engine launches its last reductions."""
        for k in range(self._bcur, len(self.bwd_order)):
            u = self.units[self.bwd_order[k]]
            self._issue(u, "participate")
            if not u.backward_prepared:
                self._idle.append(u)
        self._bcur = len(self.bwd_order)
        self._settle_idle()

    def end_backward(self) -> None:
        if self._discover_backward:  # the first backward: units outside the schedule that needed one join it
            self._discover_backward = False
            extra = sorted(self._backward_extra)
            everyone = C.all_gather_object(extra, tag="unit_discovery") if C.get_world_size() > 1 else [extra]
            self._backward_plan = {ui for e in everyone for ui in e if self.units[ui].host is None
                                   and self.units[ui] not in self.step_units}
            self._backward_extra.clear()
            self._set_schedule(self.fwd_order)
        keep = self._keep_after_backward()
        for u in self.units:
            u.backward_prepared = False
            if u.state is ParamState.GATHERING:  # prefetched but never used in this backward
                u.wait()
            if not keep:
                u.reshard()

    def before_step(self) -> None:
        """The optimizer is about to update the shards: no stale full copy may survive."""
        for u in self.units:
            if u.state is ParamState.GATHERING:
                u.wait()
            u.reshard()

    @contextmanager
    def full_params(self) -> Iterator[None]:
        """Every unit gathered for the duration (generation, export); resharded on exit. Collective.
        After :meth:`release_to_module` (the end of fit) the module already holds full parameters: a no-op."""
        if self.released:
            yield
            return
        for u in self.units:
            u.unshard(async_op=True)
        for u in self.units:
            u.wait()
        paused, self._handles_paused = self._handles_paused, True
        try:
            yield
        finally:
            self._handles_paused = paused
            for u in self.units:
                u.reshard()

    def release_to_module(self) -> None:
        """End of training: gather every unit for good, so the plain module works without the engine."""
        if self.released:
            return
        self.released = True
        self.remove_hooks()
        for u in self.units:
            for b in u.buckets:
                b.gauge = Gauge()  # the module owns them from now on: not training's gathered bytes
            u.unshard(async_op=True)
        for u in self.units:
            u.wait()
            for b in u.buckets:
                b.detach_full()

    def remove_hooks(self) -> None:
        self.abort_pass()
        for h in self._handles:
            h.remove()
        self._handles = []
