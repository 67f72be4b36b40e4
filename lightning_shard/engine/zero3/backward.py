"""The backward schedule: each unit gathered again before its gradients are computed, the next ``prefetch_depth``
units of the reversed schedule issued ahead, zero contributions from units that did not run on this rank, and a
unit freed once its gradients and its inputs' gradients are computed.

Entered from autograd: the multi-grad hooks :mod:`.forward` puts on each unit's outputs call :meth:`pre_backward`
(with the first pass's guard looking away), the engine's gradient hooks call :meth:`on_grads_ready`, and activation
checkpointing's recomputation calls :meth:`recompute` from the unit's forward pre-hook."""

from __future__ import annotations

from ..buckets.sync import GradSync
from ..states import AccumulationPolicy, ParamState
from .discovery import Discovery
from .schedule import Schedule
from .unit import Gathers, Unit


class BackwardSchedule:
    def __init__(self, schedule: Schedule, gathers: Gathers, discovery: Discovery, sync: GradSync,
                 prefetch_depth: int) -> None:
        self.schedule, self.gathers, self.discovery, self.sync = schedule, gathers, discovery, sync
        self.prefetch_depth = prefetch_depth
        self.cursor = 0  # backward schedule positions [0, cursor) have had their gather issued in this backward
        self.idle: list[Unit] = []  # gathered for the schedule, no gradient will come on this rank

    def keeps(self) -> bool:
        """``keep_params`` keeps parameters (and full gradients) gathered until the window's boundary."""
        return self.sync.policy is AccumulationPolicy.KEEP_PARAMS and not self.sync.boundary

    def begin(self) -> None:
        """A backward starts: the schedule from its first position; the step's units, gathered, expect gradients."""
        self.cursor = 0
        for u in self.schedule.step_units:
            if u.state is ParamState.UNSHARDED:
                self._prepare(u)

    # ------------------------------------------------------------------ gathering ahead
    def _advance_to(self, unit: Unit) -> None:
        """Issue the backward schedule up to ``unit`` (and the prefetch after it), in schedule order."""
        q = self.schedule.bpos.get(unit.index)
        if q is None:
            return
        if q >= self.cursor:
            for k in range(self.cursor, q):
                self._catch_up(self.schedule.units[self.schedule.bwd_order[k]])
            self.gathers.issue(unit, "gather")
            self.cursor = q + 1
        self._prefetch(q)

    def _prefetch(self, q: int) -> None:
        """Keep ``prefetch_depth`` units of the backward schedule issued ahead of position ``q`` (-1: backward
        starts). A prefetched unit moves the window too: each unit after the first is gathered behind the backward
        of the ones before it, not only every (prefetch_depth + 1)-th."""
        order = self.schedule.bwd_order
        for k in range(self.cursor, min(len(order), q + 1 + self.prefetch_depth)):
            self._catch_up(self.schedule.units[order[k]])
            self.cursor = k + 1

    def _catch_up(self, unit: Unit) -> None:
        self.gathers.issue(unit)
        if not unit.ran and not unit.backward_prepared:
            self.idle.append(unit)  # no gradient will come here; the gather is for the ranks that ran it

    def _settle_idle(self) -> None:
        idle, self.idle = self.idle, []
        for u in idle:
            for x in u.group:
                x.wait()
                for b in x.trainable:
                    if b.pending and self.sync.is_active(b):
                        b.attach_grads()
                        b.pending = 0
                        self.sync.bucket_ready(b)
            if not self.keeps():
                self.gathers.free(u)

    # ------------------------------------------------------------------ entered from autograd
    def pre_backward(self, unit: Unit) -> None:
        """The first gradient reached ``unit``'s outputs: gather it (and those ahead of it) for its backward."""
        step_unit = unit in self.schedule.step_units
        if step_unit:
            # the loss's gradient reaches the step's root unit first: the first units of the schedule are gathered
            # behind the backward of what runs before them (the loss, an LM head in the root unit), as every later
            # unit is behind the one before it. Issued here, inside autograd, not in begin: the ledger counts them
            # as the backward's gathers
            self._prefetch(-1)
        if unit.backward_prepared:
            return
        self._settle_idle()
        if step_unit:  # every rank's loss reaches the step's root unit first
            self.gathers.materialize(unit)
        elif unit.host is not None or unit.index not in self.schedule.bpos:
            self.discovery.unplanned(unit, "it got a backward it did not get in the first step", backward=True)
        else:
            self._advance_to(unit)
            self.gathers.materialize(unit)
        self._prepare(unit)
        self._settle_idle()

    def recompute(self, unit: Unit) -> None:
        """Activation checkpointing runs ``unit``'s forward again inside backward (a module of a checkpointed block;
        the block's own hooks stay outside the checkpoint). Its weights are needed now, so it is gathered in the
        order of the backward schedule, at most once per backward: a unit whose backward came first (fsdp_shard's
        block unit) is already gathered, and the others of a zero3 block are issued as the recomputation reaches
        them, then used by their own backward without a second gather. Nothing is freed here (the post-forward hook
        returns too) and no output is hooked: backward frees the unit as without checkpointing. A unit outside the
        schedule (a frozen unit before the first trainable one, which needs no backward of its own) joins it in the
        first backward like any unit that turned out to need one, so later steps prefetch it in order."""
        while unit.host is not None:  # gathered with the unit whose code uses it
            unit = unit.host
        if unit in self.schedule.step_units:
            self.gathers.materialize(unit)
        elif unit.index not in self.schedule.bpos:
            self.discovery.unplanned(unit, "a checkpointed block recomputed it in backward", backward=True)
        else:
            self._advance_to(unit)
            self.gathers.materialize(unit)

    def _prepare(self, unit: Unit) -> None:
        unit.backward_prepared = True
        self.gathers.materialize(unit)
        for u in unit.group:
            u.backward_prepared = True
            for b in u.trainable:
                if b.grad_buf is None:  # allocated when this backward's first gradient arrives (the engine's hook)
                    b.expect_grads()
                else:  # a buffer kept from an earlier micro-batch (keep_unsharded_grads, keep_params)
                    b.attach_grads()

    def on_grads_ready(self, unit: Unit) -> None:
        """All of ``unit``'s gradients are accumulated for this backward (the engine's gradient hook)."""
        self.maybe_free(unit.host or unit)

    def maybe_free(self, unit: Unit) -> None:
        """Free ``unit`` once every gradient of its group is in and its inputs' gradients are computed."""
        if unit in self.schedule.step_units or not unit.backward_prepared or self.keeps():
            return
        if unit.input_waits == 0 and all(u.pending == 0 for u in unit.group):
            self.gathers.free(unit)

    # ------------------------------------------------------------------ the end of backward
    def close(self) -> None:
        """Autograd is done: gather what the backward schedule has left (other ranks may have needed it), with
        zero gradients here, before the engine launches its last reductions."""
        order = self.schedule.bwd_order
        for k in range(self.cursor, len(order)):
            u = self.schedule.units[order[k]]
            self.gathers.issue(u, "participate")
            if not u.backward_prepared:
                self.idle.append(u)
        self.cursor = len(order)
        self._settle_idle()

    def end(self, keep: list[Unit]) -> None:
        """The backward is over: free every unit but ``keep`` (unless ``keep_params`` holds them all)."""
        keep_all = self.keeps()
        for u in self.schedule.units:
            u.backward_prepared = False
            if u.state is ParamState.GATHERING:  # prefetched but never used in this backward
                u.wait()
            if not keep_all and u not in keep:
                u.reshard()
