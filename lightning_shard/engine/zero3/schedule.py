"""The schedule: the order every rank gathers the units in, forward and backward, whatever each rank runs.

Forward follows the units' registration order in the first step, then the order recorded in it, merged over the
ranks (:func:`merge_orders`, by :mod:`.discovery`). Backward meets the units where their forwards *end*, reversed
(:func:`completion_order`), and only those that can need a backward: from the first trainable unit on, plus what the
first backward found. Units gathered with another one (``Unit.host``) and the step's units (the root, gathered
around the whole step) are not scheduled on their own."""

from __future__ import annotations

from typing import Optional

from torch import nn

from .unit import Unit


class Schedule:
    def __init__(self, module: nn.Module, units: list[Unit], root: Optional[Unit]) -> None:
        self.units = units
        self.step_units: list[Unit] = [root] if root is not None else []  # gathered around the step
        self.plan = [u.index for u in units if u.module is not None]  # registration order
        self.backward_plan: set[int] = set()  # units before the first trainable one that need a backward
        self._module_pos = {name: k for k, (name, _) in enumerate(module.named_modules())}
        self.fwd_order: list[int] = []  # unit indices, forward
        self.fpos: dict[int, int] = {}  # unit index -> position in fwd_order
        self.bwd_order: list[int] = []  # unit indices, backward
        self.bpos: dict[int, int] = {}  # unit index -> position in bwd_order
        self.set(self.plan)

    def set(self, order: list[int]) -> None:
        """The forward schedule from ``order`` (unit indices), and the backward schedule that follows from it."""
        self.fwd_order = [i for i in order if self.units[i].host is None and self.units[i] not in self.step_units]
        self.fpos = {u: k for k, u in enumerate(self.fwd_order)}
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
        self.bwd_order = [i for i in reversed(done) if i in self.backward_plan or (
            (self.fpos[i] >= first or dpos[i] > last_needed) and i not in early)]
        self.bpos = {u: k for k, u in enumerate(self.bwd_order)}

    def _frozen_before_first_trainable(self, first: Unit) -> set[int]:
        pos = self._module_pos
        trainable = [n.rsplit(".", 1)[0] if "." in n else "" for u in first.group for b in u.trainable
                     for n in b.names]
        start = min((pos.get(m, len(pos)) for m in trainable), default=len(pos))
        inside = first.name + "."
        return {i for i in self.fwd_order if self.units[i].name.startswith(inside)
                and not any(x.trainable for x in self.units[i].group) and pos.get(self.units[i].name, 0) < start}


def enclosing(a: str, b: str) -> str:
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
