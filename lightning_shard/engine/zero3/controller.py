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

Forward: a unit's pre-forward hook gathers it and keeps the next ``prefetch_depth`` scheduled units issued (the
step's start issues the first ones), its post-forward hook frees it (``reshard_after_forward``) and hooks its outputs
so that backward gathers it again (with the units before it issued ahead the same way; the backward's start issues
the first ones, from the root unit's pre-backward hook). In backward a unit is freed once all of its trainable
gradients are in **and** the gradients of its inputs are computed: frozen weights (LoRA's base) are needed for the
latter.

Parameters used outside their unit's forward are found in the first step (:mod:`.guard`) and their unit is
gathered with its user from then on (``Unit.host``). The root unit (tied weights, parameters no unit claims) is
gathered around the whole step: from the step's start until backward frees it (a forward without gradients frees
it at its end).

Policies across an accumulation window (DESIGN.md section 3):
``per_micro_batch``/``keep_unsharded_grads``: gather in forward and backward of every micro-batch;
``keep_params``: gather once per window, keep parameters (and full gradients) until the boundary.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..buckets.bucket import Gauge
from ..buckets.sync import GradSync
from ..comm import collectives as C
from ..states import AccumulationPolicy, ParamState, eager
from .backward import BackwardSchedule
from .forward import ForwardHooks
from .guard import ShardedUseGuard
from .unit import ControllerState, Unit, _Pass, completion_order, merge_orders

log = logging.getLogger(__name__)


class ParamShardController(ForwardHooks, BackwardSchedule):
    """Gathers and frees units along the agreed schedule; the hooks live in :mod:`.param_shard_forward` and
    :mod:`.param_shard_backward`."""

    def __init__(self, module: nn.Module, units: list[Unit], sync: GradSync, reshard_after_forward: bool,
                 prefetch_depth: int) -> None:
        self.units, self.sync = units, sync
        self.keep_params = sync.policy is AccumulationPolicy.KEEP_PARAMS  # one gather per accumulation window
        self.reshard_after_forward, self.prefetch_depth = reshard_after_forward, prefetch_depth
        self.root: Optional[Unit] = next((u for u in units if u.module is None), None)
        self.step_units: list[Unit] = [self.root] if self.root is not None else []  # gathered around the step
        self.plan = [u.index for u in units if u.module is not None]
        self.fwd_order: list[int] = []
        self._backward_plan: set[int] = set()  # units before the first trainable one that need a backward
        self._module_pos = {name: k for k, (name, _) in enumerate(module.named_modules())}
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
        self.state = ControllerState.TRAINING
        # inside a step whose backwards run in it (manual optimization: forwards, backwards and optimizer steps in one
        # training_step): the step's units stay gathered between its backwards and are gathered again after an
        # optimizer step, for the forwards that follow (step_pre_forward to step_post_forward)
        self.in_step = False
        self._handles = []
        for u in units:
            if u.module is not None:
                pre, post = eager(self._pre_forward_hook(u)), eager(self._post_forward_hook(u))
                self._handles.append(u.module.register_forward_pre_hook(pre, with_kwargs=True))
                self._handles.append(u.module.register_forward_hook(post))
        # modules enclosing units: the end of their forward frees the units skipped inside them
        names = {u.name for u in units if u.module is not None}
        enclosing = {n.rsplit(".", k)[0] for n in names for k in range(1, n.count(".") + 1)} - names
        for name, m in module.named_modules():
            if name in enclosing:
                self._handles.append(m.register_forward_hook(eager(lambda mod, a, o, name=name: self._end_of(name))))

    # ------------------------------------------------------------------ schedule
    def _set_schedule(self, order: list[int]) -> None:
        self.fwd_order = [i for i in order if self.units[i].host is None and self.units[i] not in self.step_units]
        self._fpos = {u: k for k, u in enumerate(self.fwd_order)}
        first = next((k for k, i in enumerate(self.fwd_order) if any(x.trainable for x in self.units[i].group)),
                     len(self.fwd_order))
        # backward runs the forwards' *ends* in reverse: a unit enclosing others (a block holding its small layers,
        # engine/zero3/plan.py) starts before them and ends after them, so its backward comes first
        done = completion_order(self.fwd_order, {u.index: u.name for u in self.units})
        dpos = {u: k for k, u in enumerate(done)}
        last_needed = dpos[self.fwd_order[first]] if first < len(self.fwd_order) else len(done)
        # frozen units that end before the first trainable one starts need no backward (their inputs need no
        # gradient), unless the first backward showed otherwise (e.g. inputs that require grad); nor do the frozen
        # units inside that first trainable unit registered before the module of its first trainable parameter
        # (a LoRA block merged into one unit with its adapters: the frozen base before them)
        early = self._frozen_before_first_trainable(self.units[self.fwd_order[first]]) \
            if first < len(self.fwd_order) else set()
        self.bwd_order = [i for i in reversed(done) if i in self._backward_plan or (
            (self._fpos[i] >= first or dpos[i] > last_needed) and i not in early)]
        self._bpos = {u: k for k, u in enumerate(self.bwd_order)}

    def _frozen_before_first_trainable(self, first: Unit) -> set[int]:
        pos = self._module_pos
        trainable = [n.rsplit(".", 1)[0] if "." in n else "" for u in first.group for b in u.trainable
                     for n in b.names]
        start = min((pos.get(m, len(pos)) for m in trainable), default=len(pos))
        inside = first.name + "."
        return {i for i in self.fwd_order if self.units[i].name.startswith(inside)
                and not any(x.trainable for x in self.units[i].group) and pos.get(self.units[i].name, 0) < start}

    # ------------------------------------------------------------------ bookkeeping
    def _event(self, what: str, unit: Unit) -> None:
        if self.record_events:
            self.events.append((what, unit.index))

    def gathered_bytes(self) -> int:
        return self.gauge.now

    @property
    def peak_gathered_bytes(self) -> int:
        return self.gauge.peak

    def _keeps_after_forward(self, grad: bool) -> bool:
        return grad and (not self.reshard_after_forward or self.keep_params)

    def _keep_after_backward(self) -> bool:
        return self.keep_params and not self.sync.boundary

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
            discovering = self._discover_backward if backward else (self._pass is None or
                                                                    self._discover[self._pass.grad])
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

    # ------------------------------------------------------------------ the pass around a step
    def step_pre_forward(self, backward_inside: bool = False) -> None:
        """Around the LightningModule's step (the root unit is not inside any module forward we can hook).
        ``backward_inside``: the step runs its own backwards and optimizer steps (manual optimization)."""
        if self.state is not ControllerState.TRAINING:
            return
        self.abort_pass()
        self.in_step = backward_inside and torch.is_grad_enabled()
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
                self._issue(u, "gather")
            self._prefetch_forward(-1)  # the first units, behind the root's gather and the code before them
            for u in self.step_units:
                self._materialize(u)

    def step_post_forward(self, output: Any) -> None:
        if self.state is not ControllerState.TRAINING:
            return
        self.end_pass()
        backward_inside, self.in_step = self.in_step, False
        if not self.step_units:
            return
        if not torch.is_grad_enabled() or backward_inside:  # no backward follows
            for u in self.step_units:
                self._free(u)
            return
        for u in self.step_units:
            self._hook_backward(u, output)
        # with gradients the step's units stay gathered: the loss's backward needs them first (an LM head), so
        # freeing them here would gather them again at once, with nothing allocated in between (FSDP2 keeps its root
        # too); backward frees them with the others (end_backward), the optimizer step at the latest (before_step)

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
        self.in_step = False
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

    def before_step(self) -> None:
        """The optimizer is about to update the shards: no stale full copy may survive."""
        for u in self.units:
            if u.state is ParamState.GATHERING:
                u.wait()
            u.reshard()
            for b in u.buckets:
                b.drop_secondary()

    def after_step(self) -> None:
        """The optimizer updated the shards. Inside a step that goes on (manual optimization) the step's units are
        gathered again, updated, for the code that follows (every rank runs the same step code)."""
        if self.in_step and self.state is ControllerState.TRAINING:
            with self._quiet():
                for u in self.step_units:
                    self._materialize(u)

    @contextmanager
    def full_params(self) -> Iterator[None]:
        """Every unit gathered for the duration (generation, export); resharded on exit. Collective.
        After :meth:`release_to_module` (the end of fit) the module already holds full parameters: a no-op."""
        if self.state is ControllerState.RELEASED:
            yield
            return
        for u in self.units:
            u.unshard(async_op=True, exact=True)  # export / generation: the values, not their quantization
        for u in self.units:
            u.wait()
        previous, self.state = self.state, ControllerState.FULL_PARAMS
        try:
            yield
        finally:
            self.state = previous
            for u in self.units:
                u.reshard()

    def release_to_module(self) -> None:
        """End of training: gather every unit for good, so the plain module works without the engine."""
        if self.state is ControllerState.RELEASED:
            return
        self.state = ControllerState.RELEASED
        self.remove_hooks()
        for u in self.units:
            for b in u.buckets:
                b.gauge = Gauge()  # the module owns them from now on: not training's gathered bytes
            u.unshard(async_op=True, exact=True)  # the module keeps the values the optimizer computed
        for u in self.units:
            u.wait()
            for b in u.buckets:
                b.detach_full()

    def remove_hooks(self) -> None:
        self.abort_pass()
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def released(self) -> bool:
        """release_to_module() ran: the module owns full parameters again."""
        return self.state is ControllerState.RELEASED

