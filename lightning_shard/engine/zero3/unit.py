"""A ZeRO-3/FSDP unit at run time (its buckets, who it is gathered with), one forward pass's progress through
the gather schedule, and merging the forward orders ranks recorded into one schedule."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from ..buckets.bucket import Bucket
from ..states import ParamState
from .guard import ShardedUseGuard
from .plan import UnitSpec


class ControllerState(enum.Enum):
    """What the parameter-sharding controller does with the units."""

    TRAINING = "training"  # hooks gather and free units along the schedule
    FULL_PARAMS = "full_params"  # inside full_params(): every unit gathered, hooks idle (generation, export)
    RELEASED = "released"  # after release_to_module(): the module owns full parameters for good, hooks removed


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

    def unshard(self, async_op: bool, exact: bool = False) -> None:
        for b in self.buckets:
            b.unshard(async_op, exact)

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


def completion_order(order: list[int], names: dict[int, str]) -> list[int]:
    """The order in which units' forwards *end*, from the order they start (``order``) and module nesting: a unit
    whose module encloses the next one's (by FQN) is still running when it starts, and ends after it. Backward
    meets the units in the reverse of this order. (A module called outside its parent's forward breaks the
    assumption; the cost is a unit gathered earlier in backward than needed, never a wrong gather.)"""
    done: list[int] = []
    running: list[int] = []
    for u in order:
        while running and not names[u].startswith(names[running[-1]] + "."):
            done.append(running.pop())
        running.append(u)
    return done + running[::-1]


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
