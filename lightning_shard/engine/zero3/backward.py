"""Backward of the parameter-sharding controller: the reversed schedule, gathering units ahead of their
gradients, zero contributions from units that did not run on this rank, and freeing a unit once its gradients
and its inputs' gradients are computed."""

from __future__ import annotations

from ..comm import collectives as C
from ..states import ParamState
from .unit import Unit


class BackwardSchedule:
    """Part of :class:`~.param_shard.ParamShardController` (its state and gather/free methods)."""

    def begin_backward(self) -> None:
        self.end_pass()  # manual optimization: backward inside training_step
        self._bcur = 0
        for u in self.step_units:
            if u.state is ParamState.UNSHARDED:
                self._prepare_backward(u)

    def _advance_backward_to(self, unit: Unit) -> None:
        """Issue the backward schedule up to ``unit`` (and the prefetch after it), in schedule order."""
        q = self._bpos.get(unit.index)
        if q is None:
            return
        if q >= self._bcur:
            for k in range(self._bcur, q):
                self._catch_up_backward(self.units[self.bwd_order[k]])
            self._issue(unit, "gather")
            self._bcur = q + 1
        self._prefetch_backward(q)

    def _prefetch_backward(self, q: int) -> None:
        """Keep ``prefetch_depth`` units of the backward schedule issued ahead of position ``q`` (-1: backward
        starts). A prefetched unit moves the window too: each unit after the first is gathered behind the backward
        of the ones before it, not only every (prefetch_depth + 1)-th."""
        for k in range(self._bcur, min(len(self.bwd_order), q + 1 + self.prefetch_depth)):
            self._catch_up_backward(self.units[self.bwd_order[k]])
            self._bcur = k + 1

    def _recompute(self, unit: Unit) -> None:
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
        if unit in self.step_units:
            self._materialize(unit)
        elif unit.index not in self._bpos:
            self._unplanned(unit, "a checkpointed block recomputed it in backward", backward=True)
        else:
            self._advance_backward_to(unit)
            self._materialize(unit)

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
                    if b.pending and self.sync.is_active(b):
                        b.attach_grads()
                        b.pending = 0
                        self.sync.bucket_ready(b)
            if not self._keep_after_backward():
                self._free(u)

    def _pre_backward(self, unit: Unit) -> None:
        if unit in self.step_units:
            # the loss's gradient reaches the step's root unit first: the first units of the schedule are gathered
            # behind the backward of what runs before them (the loss, an LM head in the root unit), as every later
            # unit is behind the one before it. Issued here, inside autograd, not in begin_backward: the ledger
            # counts them as the backward's gathers
            with self._quiet():
                self._prefetch_backward(-1)
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
                if b.grad_buf is None:  # allocated when this backward's first gradient arrives (the engine's hook)
                    b.expect_grads()
                else:  # a buffer kept from an earlier micro-batch (keep_unsharded_grads, keep_params)
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
            if not keep and not (self.in_step and u in self.step_units):  # (the step goes on: its code needs them)
                u.reshard()
