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

Policies across an accumulation window (docs/architecture.md, "Design rules" 6):
``per_micro_batch``/``keep_unsharded_grads``: gather in forward and backward of every micro-batch;
``keep_params``: gather once per window, keep parameters (and full gradients) until the boundary.

The controller is the step around the schedule; each concern is one object it is made of, and they reach each other
only through what they are handed at construction:

* :class:`~.unit.Gathers` (``unit.py``): issue, materialize and free a unit with those gathered with it; the
  controller's state, the gathered-bytes gauge, the events tests read;
* :class:`~.schedule.Schedule` (``schedule.py``): the agreed order, forward and backward, and the step's units;
* :class:`~.discovery.Discovery` (``discovery.py``): the first passes' findings, the ranks agreeing on them;
* :class:`~.forward.ForwardSchedule` (``forward.py``): the module hooks and one pass through the schedule (with the
  first pass's guard);
* :class:`~.backward.BackwardSchedule` (``backward.py``): the reversed schedule, entered from autograd.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..buckets.bucket import Gauge
from ..buckets.sync import GradSync
from ..states import ControllerState, ParamState
from .backward import BackwardSchedule
from .discovery import Discovery
from .forward import ForwardSchedule
from .schedule import Schedule
from .unit import Gathers, Unit


class ParamShardController:
    """Gathers and frees units along the agreed schedule: the step's start and end, the backward's start and end,
    the optimizer step, full parameters on demand and at the end of fit."""

    def __init__(self, module: nn.Module, units: list[Unit], sync: GradSync, reshard_after_forward: bool,
                 prefetch_depth: int) -> None:
        self.units = units
        self.root: Optional[Unit] = next((u for u in units if u.module is None), None)
        self.schedule = Schedule(module, units, self.root)
        self.gathers = Gathers(units)
        self.discovery = Discovery(self.schedule, self.gathers)
        self.backward = BackwardSchedule(self.schedule, self.gathers, self.discovery, sync, prefetch_depth)
        self.forward = ForwardSchedule(self.schedule, self.gathers, self.discovery, self.backward, sync,
                                       reshard_after_forward, prefetch_depth)
        # inside a step whose backwards run in it (manual optimization: forwards, backwards and optimizer steps in one
        # training_step): the step's units stay gathered between its backwards and are gathered again after an
        # optimizer step, for the forwards that follow (step_pre_forward to step_post_forward)
        self.in_step = False
        self._handles = self.forward.register(module)

    def gathered_bytes(self) -> int:
        return self.gathers.gauge.now

    @property
    def peak_gathered_bytes(self) -> int:
        return self.gathers.gauge.peak

    # ------------------------------------------------------------------ the pass around a step
    def step_pre_forward(self, backward_inside: bool = False) -> None:
        """Around the LightningModule's step (the root unit is not inside any module forward we can hook).
        ``backward_inside``: the step runs its own backwards and optimizer steps (manual optimization)."""
        if self.gathers.state is not ControllerState.TRAINING:
            return
        self.abort_pass()
        self.in_step = backward_inside and torch.is_grad_enabled()
        self.forward.begin(grad=torch.is_grad_enabled())
        with self.forward.quiet():
            for u in self.schedule.step_units:
                self.gathers.issue(u, "gather")
            self.forward.prefetch(-1)  # the first units, behind the root's gather and the code before them
            for u in self.schedule.step_units:
                self.gathers.materialize(u)

    def step_post_forward(self, output: Any) -> None:
        if self.gathers.state is not ControllerState.TRAINING:
            return
        self.forward.end()
        backward_inside, self.in_step = self.in_step, False
        step_units = self.schedule.step_units
        if not step_units:
            return
        if not torch.is_grad_enabled() or backward_inside:  # no backward follows
            for u in step_units:
                self.gathers.free(u)
            return
        for u in step_units:
            self.forward.hook_backward(u, output)
        # with gradients the step's units stay gathered: the loss's backward needs them first (an LM head), so
        # freeing them here would gather them again at once, with nothing allocated in between (FSDP2 keeps its root
        # too); backward frees them with the others (end_backward), the optimizer step at the latest (before_step)

    def abort_pass(self) -> None:
        """A step raised: leave no guard installed (the error propagates)."""
        self.in_step = False
        self.forward.abort()

    # ------------------------------------------------------------------ backward (the engine's pre/post_backward)
    def begin_backward(self) -> None:
        self.forward.end()  # manual optimization: backward inside training_step
        self.backward.begin()

    def end_backward(self) -> None:
        self.discovery.after_backward()
        # inside a step that goes on, its units stay gathered: its code needs them
        self.backward.end(keep=self.schedule.step_units if self.in_step else [])

    # ------------------------------------------------------------------ the optimizer step
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
        if self.in_step and self.gathers.state is ControllerState.TRAINING:
            with self.forward.quiet():
                for u in self.schedule.step_units:
                    self.gathers.materialize(u)

    # ------------------------------------------------------------------ full parameters
    @contextmanager
    def full_params(self) -> Iterator[None]:
        """Every unit gathered for the duration (generation, export); resharded on exit. Collective.
        After :meth:`release_to_module` (the end of fit) the module already holds full parameters: a no-op."""
        if self.gathers.state is ControllerState.RELEASED:
            yield
            return
        for u in self.units:
            u.unshard(async_op=True, exact=True)  # export / generation: the values, not their quantization
        for u in self.units:
            u.wait()
        previous, self.gathers.state = self.gathers.state, ControllerState.FULL_PARAMS
        try:
            yield
        finally:
            self.gathers.state = previous
            for u in self.units:
                u.reshard()

    def release_to_module(self) -> None:
        """End of training: gather every unit for good, so the plain module works without the engine."""
        if self.gathers.state is ControllerState.RELEASED:
            return
        self.gathers.state = ControllerState.RELEASED
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
        return self.gathers.state is ControllerState.RELEASED
