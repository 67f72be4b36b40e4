"""The forward schedule: one pass (a step's forward) through the units, driven by their module hooks.

A unit's pre-forward hook gathers it, first issuing every scheduled unit before it that has not been issued (other
ranks may run units this rank skips), and keeps the next ``prefetch_depth`` scheduled units issued; its
post-forward hook frees it (``reshard_after_forward``) and hooks its outputs, so that backward gathers it again
(:mod:`.backward`). A unit issued but not run here is freed when the module enclosing it and the unit that passed
it ends its forward; the end of the pass gathers and frees what the schedule has left."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..buckets.sync import GradSync
from ..states import AccumulationPolicy, ControllerState, ParamState, autograd_running, eager
from .backward import BackwardSchedule
from .discovery import Discovery
from .guard import ShardedUseGuard
from .schedule import Schedule, enclosing
from .unit import Gathers, Unit


@dataclass
class _Pass:
    """One forward pass (a training/validation step's forward) and where its gathers have got to."""

    grad: bool
    record: bool = False  # the first pass with gradients records the order its units start in
    cursor: int = 0  # schedule positions [0, cursor) have had their gather issued in this pass
    # issued by catch-up or prefetch, forward not run yet -> the module at whose forward's end it is freed once a
    # later unit has run (None: not passed yet). That module encloses both, so out-of-order calls inside it
    # (a layer norm registered after the block it precedes) still find the unit gathered.
    waiting: dict[Unit, Optional[str]] = field(default_factory=dict)
    extra: list[Unit] = field(default_factory=list)  # gathered because the guard saw them used
    guard: Optional[ShardedUseGuard] = None  # the first pass of each kind runs under it (:mod:`.guard`)


class ForwardSchedule:
    def __init__(self, schedule: Schedule, gathers: Gathers, discovery: Discovery, backward: BackwardSchedule,
                 sync: GradSync, reshard_after_forward: bool, prefetch_depth: int) -> None:
        self.schedule, self.gathers, self.discovery, self.backward = schedule, gathers, discovery, backward
        self.sync = sync  # read for its accumulation policy (keep_params keeps units gathered over the window)
        self.reshard_after_forward, self.prefetch_depth = reshard_after_forward, prefetch_depth
        self.current: Optional[_Pass] = None  # the pass in progress
        self.stack: list[Unit] = []  # units whose forward is running
        self.seen: list[int] = []  # unit indices, in the order their forwards started in the recording pass
        self._param_unit = {id(p): u for u in schedule.units for b in u.buckets for p in b.params}  # for the guard

    def register(self, module: nn.Module) -> list[Any]:
        """The hooks: pre/post-forward per unit, and the end of each module enclosing units, which frees the units
        skipped inside it. Every hook runs eagerly, even in a ``torch.compile``'d module (``states.eager``)."""
        handles = []
        units = [u for u in self.schedule.units if u.module is not None]
        for u in units:
            handles.append(u.module.register_forward_pre_hook(eager(self._pre_forward_hook(u)), with_kwargs=True))
            handles.append(u.module.register_forward_hook(eager(self._post_forward_hook(u))))
        names = {u.name for u in units}
        around = {n.rsplit(".", k)[0] for n in names for k in range(1, n.count(".") + 1)} - names
        for name, m in module.named_modules():
            if name in around:
                handles.append(m.register_forward_hook(eager(lambda mod, a, o, name=name: self._end_of(name))))
        return handles

    def keeps(self, grad: bool) -> bool:
        """Units stay gathered from their forward into backward (``reshard_after_forward=False``, ``keep_params``)."""
        return grad and (not self.reshard_after_forward or self.sync.policy is AccumulationPolicy.KEEP_PARAMS)

    # ------------------------------------------------------------------ the pass
    def begin(self, grad: bool) -> None:
        """A step's forward starts (``grad``: with gradients); the first pass of its kind runs under the guard."""
        p = _Pass(grad=grad, record=grad and self.discovery.recording)
        if p.grad:
            for u in self.schedule.units:
                u.ran, u.input_waits = False, 0
        if self.discovery.first_pass[p.grad]:
            p.guard = ShardedUseGuard(self._sharded_unit_of, self._on_sharded_use)
            p.guard.__enter__()
        self.current = p

    def end(self) -> None:
        """The forward of the step is over: gather the rest of the schedule (other ranks may need it), free what
        this pass no longer needs, and after the first pass of a kind agree on the order and the findings."""
        p, self.current = self.current, None
        if p is None:
            return
        units, order = self.schedule.units, self.schedule.fwd_order
        try:
            for k in range(p.cursor, len(order)):
                self.gathers.issue(units[order[k]], "participate")
                p.waiting[units[order[k]]] = ""
            if not self.keeps(p.grad):
                for u in [*p.waiting, *p.extra]:
                    self.gathers.free(u)
        finally:
            if p.guard is not None:
                p.guard.__exit__(None, None, None)
            self.stack.clear()
        self.discovery.after_pass(p.grad, self.seen if p.record else None)

    def abort(self) -> None:
        """A step raised: leave no guard installed (the error propagates)."""
        p, self.current = self.current, None
        if p is not None and p.guard is not None:
            p.guard.__exit__(None, None, None)
        self.stack.clear()

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """The controller's own work inside a hook is not a use of a sharded parameter (the guard looks away)."""
        guard = self.current.guard if self.current is not None else None
        if guard is not None:
            guard.paused += 1
        try:
            yield
        finally:
            if guard is not None:
                guard.paused -= 1

    def prefetch(self, pos: int) -> None:
        """Keep ``prefetch_depth`` scheduled units issued ahead of schedule position ``pos`` (the unit whose forward
        starts; -1: the pass starts). Every unit's start moves the window, the prefetched ones' too, so that each unit
        after the first is gathered behind the compute of the ones before it. Issues follow the schedule's order, so
        every rank issues the same gathers in the same order whatever it runs."""
        p, units, order = self.current, self.schedule.units, self.schedule.fwd_order
        for k in range(p.cursor, min(len(order), pos + 1 + self.prefetch_depth)):
            self.gathers.issue(units[order[k]])
            p.waiting[units[order[k]]] = None
            p.cursor = k + 1

    def _catch_up_to(self, pos: int) -> None:
        """Issue the scheduled units before position ``pos`` not issued yet: gathered even if skipped here."""
        p, units, order = self.current, self.schedule.units, self.schedule.fwd_order
        for k in range(p.cursor, pos):
            self.gathers.issue(units[order[k]], "catch_up")
            p.waiting[units[order[k]]] = None

    # ------------------------------------------------------------------ the hooks
    def _pre_forward_hook(self, unit: Unit):
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if self.gathers.state is not ControllerState.TRAINING:
                return
            with self.quiet():
                if autograd_running():  # a checkpointed block's forward recomputed inside backward
                    self.backward.recompute(unit)  # in the backward schedule; not a forward of the pass
                    return
                self.stack.append(unit)
                p = self.current
                if p is None:  # a forward outside the step's pass (no schedule): gather on demand
                    # (manual optimization: a forward after a backward of the same step; a backward may follow)
                    unit.ran = unit.ran or torch.is_grad_enabled()
                    self.gathers.materialize(unit)
                elif unit.index not in self.schedule.fpos:  # gathered with its host, used on its own here
                    self.discovery.unplanned(unit, "its module ran outside the unit it is gathered with", grad=p.grad)
                else:
                    if unit.resident:
                        p.extra.append(unit)
                    if p.grad:
                        unit.ran = True
                        if p.record and unit.index not in self.seen:
                            self.seen.append(unit.index)
                    p.waiting.pop(unit, None)
                    pos = self.schedule.fpos[unit.index]
                    if pos >= p.cursor:
                        self._catch_up_to(pos)
                        self.gathers.issue(unit, "gather")
                        p.cursor = pos + 1
                        self.prefetch(pos)
                        self.gathers.materialize(unit)
                    else:  # prefetched (or, if it was freed, run again / out of order: refused once agreed)
                        self.prefetch(pos)
                        self.discovery.unplanned(unit, "its module ran again after its forward had ended in this "
                                                       "step, or out of the order recorded in the first step",
                                                 grad=p.grad)
                    for w, at in p.waiting.items():  # passed over by this unit: freed when their enclosure ends
                        if at is None and self.schedule.fpos[w.index] < pos:
                            p.waiting[w] = enclosing(w.name, unit.name)
                if p is not None and p.grad and self._has_frozen(unit):
                    self._watch_inputs(unit, args, kwargs)
        return hook

    def _post_forward_hook(self, unit: Unit):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.gathers.state is not ControllerState.TRAINING:
                return
            if autograd_running():
                # activation checkpointing recomputes this forward inside backward: the unit is gathered for
                # its backward already and must stay so; its outputs are not a new backward entry point
                return
            with self.quiet():
                if self.stack and self.stack[-1] is unit:
                    self.stack.pop()
                self.gathers.event("forward_done", unit)
                self.hook_backward(unit, output)
                p = self.current
                grad = torch.is_grad_enabled() if p is None else p.grad
                # freed with their host, the step, the pass
                if self.keeps(grad) or unit in self.stack or unit.host is not None \
                        or unit in self.schedule.step_units or unit.resident:
                    return
                self.gathers.free(unit)
                self._end_of(unit.name)
        return hook

    def _end_of(self, name: str) -> None:
        """The forward of module ``name`` ended: units skipped inside it will not run in it any more."""
        p = self.current
        if p is None or self.gathers.state is not ControllerState.TRAINING or self.keeps(p.grad) or \
                autograd_running():
            return
        with self.quiet():
            for w in [w for w, at in p.waiting.items() if at == name]:
                del p.waiting[w]
                self.gathers.free(w)

    # ------------------------------------------------------------------ the guard (the first pass of each kind)
    def _sharded_unit_of(self, t: torch.Tensor) -> Optional[Unit]:
        u = self._param_unit.get(id(t))
        return u if u is not None and u.state is not ParamState.UNSHARDED else None

    def _on_sharded_use(self, unit: Unit, t: torch.Tensor, func: Any) -> None:
        """The guard saw a parameter of ``unit`` used while the unit is sharded: gather it here, in schedule order if
        it is still ahead, and remember who used it (agreed at the end of the pass)."""
        self.discovery.record_use(unit, self.stack[-1] if self.stack else None)
        p = self.current
        pos = self.schedule.fpos.get(unit.index)
        if p is not None and pos is not None and pos >= p.cursor:
            self._catch_up_to(pos + 1)  # still ahead in the schedule: stay in order
            p.cursor = pos + 1
            self.gathers.materialize(unit)
        else:
            self.discovery.unplanned(unit, "its parameter was used outside the unit's forward",
                                     grad=p.grad if p is not None else None)
        if p is not None:
            p.waiting.pop(unit, None)
            p.extra.append(unit)

    # ------------------------------------------------------------------ into backward
    def hook_backward(self, unit: Unit, output: Any) -> None:
        """The first gradient that reaches ``output`` starts ``unit``'s backward (gathers it again)."""
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._pre_backward(unit), mode="any")

    def _pre_backward(self, unit: Unit) -> None:
        with self.quiet():  # a backward inside the pass (a gradient penalty): the guard is still on
            self.backward.pre_backward(unit)

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
            self.backward.maybe_free(owner)

        torch.autograd.graph.register_multi_grad_hook(tensors, done, mode="all")
