"""The ledger: every collective this process issued (op, group, bytes, ring wire bytes, tag, whether autograd was
running), with running totals. Written by :mod:`.collectives`, the one caller of ``torch.distributed``, which
tells it each group's name and size; read by the tests, the planner's checks and the callbacks."""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..states import autograd_running

Group = Any  # a torch.distributed process group, or None for the world

@dataclass(frozen=True)
class LedgerEntry:
    """One collective call as seen by this rank."""

    op: str  # "all_reduce" | "reduce_scatter" | "all_to_all" | "all_gather" | "broadcast" | ... | "barrier"
    group: str  # "world" or the name given to :func:`new_group`
    world: int  # ranks in the group
    bytes: int  # bytes of the full (unsharded) tensor the collective is about
    wire_bytes: float  # bytes a ring moves per rank for this call (see module docstring)
    tag: str  # free text from the caller, e.g. "grad_bucket3"
    dtype: str
    in_backward: bool = False  # issued while autograd ran (overlapped with backward: a gradient hook's collective)
    via: str = ""  # built from other calls: "broadcast" (an all-gather as N broadcasts, comm/gather.py)

    @property
    def calls(self) -> list[str]:
        """The ``torch.distributed`` calls this entry stands for: itself, or the N broadcasts of an all-gather."""
        return [self.via] * self.world if self.via else [self.op]


def ring_wire_bytes(op: str, nbytes: int, world: int) -> float:
    """Bytes per rank of a ring collective over ``world`` ranks (nccl-tests busbw factors)."""
    if world <= 1:
        return 0.0
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return nbytes * (world - 1) / world
    if op == "all_reduce":
        return 2.0 * nbytes * (world - 1) / world
    if op in ("broadcast", "broadcast_object"):
        return float(nbytes)
    if op == "all_gather_object":
        return float(nbytes * (world - 1))
    if op == "barrier":
        return 0.0
    raise ValueError(f"unknown collective op {op!r}")


class Ledger:
    """Thread-safe record of collectives issued by this process (gradient hooks run off the main thread).

    Bounded: the last ``max_entries`` calls are kept (enough for many optimizer steps of any model), plus
    running totals per (op, group) since the start; a long run does not grow memory."""

    def __init__(self, describe: Callable[[Any], tuple[str, int]], max_entries: int = 20_000) -> None:
        self._describe = describe  # group -> (its name in the ledger, its size): collectives.py asks torch
        self._entries: deque[LedgerEntry] = deque(maxlen=max_entries)
        self._count = 0  # entries ever recorded: marks are positions in this sequence
        self.totals: dict[tuple[str, str], dict[str, float]] = {}
        self._lock = threading.Lock()

    def set_max_entries(self, n: int) -> None:
        """Keep at most ``n`` recent entries (running totals are unaffected)."""
        with self._lock:
            self._entries = deque(self._entries, maxlen=n)

    def record(self, op: str, group: Group, tensor: torch.Tensor, tag: str = "",
               full_numel: Optional[int] = None, via: str = "") -> None:
        numel = tensor.numel() if full_numel is None else full_numel
        self.record_bytes(op, group, numel * tensor.element_size(), tag, str(tensor.dtype).replace("torch.", ""),
                          via)

    def record_bytes(self, op: str, group: Group, nbytes: int, tag: str = "", dtype: str = "object",
                     via: str = "") -> None:
        name, world = self._describe(group)
        entry = LedgerEntry(op, name, world, nbytes, ring_wire_bytes(op, nbytes, world), tag, dtype,
                            autograd_running(), via)
        with self._lock:
            self._entries.append(entry)
            self._count += 1
            row = self.totals.setdefault((entry.op, entry.group), {"count": 0, "bytes": 0, "wire_bytes": 0.0})
            row["count"] += 1
            row["bytes"] += entry.bytes
            row["wire_bytes"] += entry.wire_bytes

    def mark(self) -> int:
        """Position to pass to :meth:`since` later."""
        with self._lock:
            return self._count

    def since(self, mark: int = 0) -> list[LedgerEntry]:
        """Entries recorded after ``mark`` (those still kept: at most ``max_entries``)."""
        with self._lock:
            first = self._count - len(self._entries)
            skip = max(0, mark - first)
            return list(self._entries)[skip:]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.totals.clear()
            self._count = 0

    @staticmethod
    def summarize(entries: list[LedgerEntry]) -> dict[tuple[str, str], dict[str, float]]:
        """``{(op, group): {"count", "bytes", "wire_bytes"}}`` over ``entries``."""
        out: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0, "wire_bytes": 0.0})
        for e in entries:
            row = out[(e.op, e.group)]
            row["count"] += 1
            row["bytes"] += e.bytes
            row["wire_bytes"] += e.wire_bytes
        return dict(out)

    def wire_bytes(self, mark: int = 0, op: Optional[str] = None) -> float:
        return sum(e.wire_bytes for e in self.since(mark) if op is None or e.op == op)

    def count(self, mark: int = 0, op: Optional[str] = None) -> int:
        return sum(1 for e in self.since(mark) if op is None or e.op == op)
