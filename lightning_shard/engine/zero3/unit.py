"""A ZeRO-3/FSDP unit at run time (:class:`Unit`: its buckets, who it is gathered with, its progress in a pass) and
the three things done to one together with the units gathered with it (:class:`Gathers`: issue, materialize, free).
Which modules are units is decided before, at set-up (:mod:`.plan`); in what order they are gathered, by
:mod:`.schedule`."""

from __future__ import annotations

from typing import Optional

from ..buckets.bucket import Bucket, Gauge
from ..states import ControllerState, ParamState
from .plan import UnitSpec


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

    @property
    def group(self) -> list["Unit"]:
        """This unit and those gathered with it (transitively)."""
        return [self, *(u for a in self.attached for u in a.group)]

    @property
    def state(self) -> ParamState:
        return self.buckets[0].gather.param_state

    @property
    def pending(self) -> int:
        return sum(b.pending for b in self.trainable)

    @property
    def full_bytes(self) -> int:
        return sum(b.layout.padded_numel * b.itemsize for b in self.buckets)

    def unshard(self, async_op: bool, exact: bool = False) -> None:
        for b in self.buckets:
            b.gather.unshard(async_op, exact)

    def wait(self) -> None:
        for b in self.buckets:
            b.gather.wait_unshard()

    def reshard(self) -> None:
        for b in self.buckets:
            b.gather.reshard()


class Gathers:
    """Gathers and frees a unit together with the units gathered with it (``Unit.group``): every gather and free of
    the schedule goes through it (``full_params`` and the end of fit gather every unit directly). It also holds what
    the parts of :class:`~.controller.ParamShardController` share: the controller's state (``ControllerState``: the
    hooks act only while ``TRAINING``), one :class:`~..buckets.bucket.Gauge` of gathered bytes for every bucket, and,
    when ``record_events`` is set (tests), each gather, wait and end of forward in the order it happened."""

    def __init__(self, units: list[Unit]) -> None:
        self.state = ControllerState.TRAINING
        self.gauge = Gauge()
        for u in units:
            for b in u.buckets:
                b.gauge = self.gauge
        self.events: list[tuple[str, int]] = []  # ("gather"|"prefetch"|"ready"|..., unit index)
        self.record_events = False

    def event(self, what: str, unit: Unit) -> None:
        if self.record_events:
            self.events.append((what, unit.index))

    def issue(self, unit: Unit, what: str = "prefetch") -> None:
        """Launch the all-gathers of ``unit``'s group that are not launched yet; they run while the caller goes on."""
        for u in unit.group:
            if u.state is ParamState.SHARDED:
                self.event(what, u)
                u.unshard(async_op=True)

    def materialize(self, unit: Unit) -> None:
        """``unit``'s group usable on return: gathered now where nothing was launched, waited where it was."""
        for u in unit.group:
            if u.state is ParamState.SHARDED:
                self.event("gather", u)
                u.unshard(async_op=False)
            if u.state is ParamState.GATHERING:
                u.wait()
                self.event("ready", u)

    def free(self, unit: Unit) -> None:
        """Back to shards; a gather still in flight is waited first (a bucket frees only gathered parameters)."""
        for u in unit.group:
            if u.state is ParamState.GATHERING:
                u.wait()
            u.reshard()
