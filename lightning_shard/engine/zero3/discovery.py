"""What the first passes find out about the model, and the ranks agreeing on it.

The first pass of each kind (with and without gradients) and the first backward *discover* the plan: the forward
order is recorded (by :mod:`.forward`), :class:`~.guard.ShardedUseGuard` (installed by :mod:`.forward` for that
pass) finds parameters used outside their unit's forward, and gathers the schedule did not foresee are allowed and
remembered (a unit run twice in one pass, a unit that got a backward it was not scheduled for). At the end of that
pass the ranks exchange their findings (one ``all_gather_object``), every rank applies all of them the same way, and
the schedule is set from them. From then on an unforeseen gather is refused: whether the other ranks issue the same
one cannot be known, and if they do not, the collectives mismatch.
"""

from __future__ import annotations

import logging
from typing import Optional

from ..comm import collectives as C
from ..states import ParamState
from .schedule import Schedule, merge_orders
from .unit import Gathers, Unit

log = logging.getLogger(__name__)


class Discovery:
    def __init__(self, schedule: Schedule, gathers: Gathers) -> None:
        self.schedule, self.gathers = schedule, gathers
        self.first_pass = {True: True, False: True}  # with / without gradients: no pass of the kind has ended yet
        self.first_backward = True
        self.recording = True  # the first pass with gradients records the forward order
        self.found: dict[int, int] = {}  # unit index -> index of the unit whose code used it (-1: the step)
        self.repeated: set[int] = set()  # units run again in one pass after their forward had ended
        self.backward_extra: set[int] = set()  # units outside the backward schedule that got a backward

    # ------------------------------------------------------------------ findings
    def record_use(self, unit: Unit, user: Optional[Unit]) -> None:
        """The guard saw ``unit``'s parameter used by ``user``'s code (None: the step's own code)."""
        while user is not None and user.host is not None:
            user = user.host
        self.found.setdefault(unit.index, user.index if user is not None else -1)

    def unplanned(self, unit: Unit, why: str, backward: bool = False, grad: Optional[bool] = None) -> None:
        """Gather ``unit`` now, a gather the schedule did not foresee (``grad``: the kind of the pass in progress,
        None outside one). Allowed while the plan is being discovered (every rank runs the same code there) and made
        part of the plan; refused afterwards: whether the other ranks issue the same gather now cannot be known, and
        if they do not, the collectives mismatch (a crash or a hang)."""
        if any(u.state is ParamState.SHARDED for u in unit.group):
            discovering = self.first_backward if backward else (grad is None or self.first_pass[grad])
            if not discovering:
                raise RuntimeError(
                    f"rank {C.get_rank()}: lightning_shard must gather unit {unit.name!r} outside the schedule the "
                    f"ranks agreed in the first step: {why}. If every rank did the same this would be safe, but "
                    "it cannot be known here, and if ranks differ the collectives mismatch (a crash or a hang). "
                    "Make the module that runs it one unit with leaf_modules=[...] (its class or FQN), or run "
                    "generation/export inside strategy.gathered_params().")
            (self.backward_extra if backward else self.repeated).add(unit.index)
            log.debug("unit %s gathered outside the schedule (%s)", unit.name, why)
        self.gathers.materialize(unit)

    # ------------------------------------------------------------------ agreement
    def after_pass(self, grad: bool, seen: Optional[list[int]]) -> None:
        """A pass ended (its guard is off): after the first of its kind, agree on the order and the findings.
        ``seen``: unit indices in the order their forwards started, when this pass recorded them (``recording``)."""
        if not self.first_pass[grad]:
            return
        self.first_pass[grad] = False
        schedule = self.schedule
        order = list(seen) if seen is not None else None
        mine = (order, sorted(self.found.items()), sorted(self.repeated))
        everyone = C.all_gather_object(mine, tag="unit_discovery") if C.get_world_size() > 1 else [mine]
        homes: dict[int, set[int]] = {}
        for _, f, repeated in everyone:
            for ui, hi in f:
                homes.setdefault(ui, set()).add(hi)
            for ui in repeated:
                schedule.units[ui].resident = True
        for ui, hs in sorted(homes.items()):
            unit = schedule.units[ui]
            if unit.host is not None or unit in schedule.step_units:
                continue
            host_index = hs.pop() if len(hs) == 1 else -1
            host = schedule.units[host_index] if host_index >= 0 else None
            while host is not None and host.host is not None:
                host = host.host
            if host is unit:
                continue
            unit.host = host
            if host is None:
                schedule.step_units.append(unit)
            else:
                host.attached.append(unit)
            log.info("lightning_shard: parameters of unit %s are used by the code of %s, outside the unit's own "
                     "forward; they are gathered together from now on (found in the first step; declare it with "
                     "leaf_modules=[...] to decide this up front)", unit.name, host.name if host else "the step")
        self.found.clear()
        self.repeated.clear()
        if order is not None:
            self.recording = False
            schedule.set(merge_orders([o for o, _, _ in everyone], schedule.plan))
        else:
            schedule.set(schedule.fwd_order)

    def after_backward(self) -> None:
        """After the first backward: the units outside the backward schedule that needed one (on any rank) join it."""
        if not self.first_backward:
            return
        self.first_backward = False
        schedule = self.schedule
        extra = sorted(self.backward_extra)
        everyone = C.all_gather_object(extra, tag="unit_discovery") if C.get_world_size() > 1 else [extra]
        schedule.backward_plan = {ui for e in everyone for ui in e if schedule.units[ui].host is None
                                  and schedule.units[ui] not in schedule.step_units}
        self.backward_extra.clear()
        schedule.set(schedule.fwd_order)
