"""Flat, padded shard layouts.

A shard unit (a "bucket" for ZeRO-1/2) is a list of parameters laid end to end in one flat buffer. The
buffer is padded at the end so that its length divides evenly by the number of shards; rank ``r`` owns the
contiguous slice ``[r * shard_numel, (r + 1) * shard_numel)``. Padding lives only in the last shard(s) and
is never handed to an optimizer, a norm or a checkpoint: :meth:`FlatLayout.owned_range` excludes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside a flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatLayout:
    slots: tuple[ParamSlot, ...]
    numel: int  # sum of parameter numels (no padding)
    num_shards: int

    @property
    def padded_numel(self) -> int:
        return -(-self.numel // self.num_shards) * self.num_shards

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, shard: int) -> tuple[int, int]:
        """Padded range ``[start, end)`` of ``shard`` in the flat buffer."""
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard index {shard} out of range for {self.num_shards} shards")
        return shard * self.shard_numel, (shard + 1) * self.shard_numel

    def owned_range(self, shard: int) -> tuple[int, int]:
        """Range of real (non-padding) elements owned by ``shard``; may be empty."""
        start, end = self.shard_range(shard)
        return min(start, self.numel), min(end, self.numel)

    def owned_slots(self, lo: int, hi: int) -> dict[int, tuple[int, int]]:
        """``slot index -> (a, e)``: the piece of each parameter inside owned range ``[lo, hi)``, in coordinates of
        that range (``a`` is 0 at ``lo``); parameters with no element there are left out."""
        out = {}
        for i, slot in enumerate(self.slots):
            a, e = max(slot.offset, lo) - lo, min(slot.end, hi) - lo
            if a < e:
                out[i] = (a, e)
        return out

    def slot_intersections(self, start: int, end: int) -> list[tuple[ParamSlot, int, int]]:
        """``(slot, lo, hi)`` for every parameter overlapping flat range ``[start, end)`` (flat coordinates)."""
        out = []
        for slot in self.slots:
            lo, hi = max(start, slot.offset), min(end, slot.end)
            if lo < hi:
                out.append((slot, lo, hi))
        return out


def flat_layout(named_shapes: list[tuple[str, tuple[int, ...]]], num_shards: int) -> FlatLayout:
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    slots, offset = [], 0
    for name, shape in named_shapes:
        n = prod(shape) if len(shape) else 1
        slots.append(ParamSlot(name, tuple(shape), offset, n))
        offset += n
    return FlatLayout(tuple(slots), offset, num_shards)


def flatten_into(layout: FlatLayout, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` (one per slot) into the padded flat buffer ``out``; the padding is zeroed."""
    for slot, t in zip(layout.slots, tensors):
        out[slot.offset:slot.end].copy_(t.reshape(-1))
    out[layout.numel:].zero_()
    return out


def slot_views(layout: FlatLayout, flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each parameter."""
    return [flat[s.offset:s.end].view(s.shape) for s in layout.slots]
