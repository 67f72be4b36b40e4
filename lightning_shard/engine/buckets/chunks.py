"""What the optimizer sees of a bucket: its owned shard cut into chunks (views), split where parameters differ.

A torch optimizer keeps state per tensor and skips a tensor whose ``.grad`` is None. One process steps every
parameter on its own, so a parameter that got no gradient in a step gets no momentum, no weight decay and no
Adam step (its own step count, and so its own bias correction). A flat shard has to give the same result.

Chunks start large (``chunk_numel`` elements, several parameters each: few tensors, so a CPU optimizer step
stays fast and in cache), cut where the bucket's param groups change (a bucket holds every group of its
optimizer, each group one contiguous run), and are split at parameter boundaries the first time the parameters
they hold are treated differently: when some got a gradient in a window and others did not (:meth:`leave_out`),
or when a checkpoint gives them different step counts (:meth:`set_slot_state`). The invariant: all parameters
(slots) of a chunk belong to one param group and have the same history, so a chunk's state is exactly each of its
parameters' torch state, sliced, and its hyperparameters are its group's.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any, Optional

import torch
from torch import nn


def elementwise(value: Any, numel: int) -> bool:
    """An optimizer state tensor with one entry per element (exp_avg, momentum_buffer ...), not a scalar."""
    return torch.is_tensor(value) and value.dim() >= 1 and value.numel() == numel


class OptimizerChunks:
    def __init__(self, shard: torch.Tensor, slot_ranges: dict[int, tuple[int, int]], chunk_numel: int,
                 trainable: bool, slot_groups: list[int]) -> None:
        """``shard``: the owned elements (the tensor the optimizer updates, through views); ``slot_ranges``:
        slot index -> the slot's piece in shard coordinates, in order; ``slot_groups``: each slot's param group."""
        self.shard, self.slot_ranges, self.trainable = shard, slot_ranges, trainable
        self.slot_groups = slot_groups
        self._slots = sorted(slot_ranges)
        self._starts = [slot_ranges[s][0] for s in self._slots]
        n, step = shard.numel(), max(1, chunk_numel)
        self.ranges: list[tuple[int, int]] = [(i, min(i + step, n)) for i in range(0, n, step)]
        self.chunks: list[nn.Parameter] = [self._view(i, j) for i, j in self.ranges]
        self._shown: Optional[tuple[torch.Tensor, int, list[torch.Tensor]]] = None  # show_pending's placeholders
        self._split(lambda s: slot_groups[s], {})

    def grouped(self) -> list[tuple[int, nn.Parameter]]:
        """``(param group, chunk)`` for every chunk, in order: what the optimizer's param groups hold."""
        return [(self.slot_groups[self.slots_in(i, j)[0]], c) for c, (i, j) in zip(self.chunks, self.ranges)]

    def _view(self, i: int, j: int) -> nn.Parameter:
        return nn.Parameter(self.shard.data[i:j], requires_grad=self.trainable)

    def slots_in(self, i: int, j: int) -> list[int]:
        """Slots with elements in shard range ``[i, j)``, in order."""
        k = max(0, bisect_right(self._starts, i) - 1)
        out = []
        while k < len(self._slots) and self._starts[k] < j:
            s = self._slots[k]
            if self.slot_ranges[s][1] > i:
                out.append(s)
            k += 1
        return out

    # ------------------------------------------------------------------ gradients
    def set_grads(self, grad: Optional[torch.Tensor]) -> None:
        self._shown = None
        for c, (i, j) in zip(self.chunks, self.ranges):
            c.grad = None if grad is None else grad[i:j]

    # What the optimizer is shown between steps is how the engine learns what the user's ``opt.zero_grad()`` did (torch
    # has no zero_grad hook, and the optimizer may be the raw one, Lightning's or Fabric's wrapper): EMPTY shows None,
    # REDUCED the published gradient (whatever the user then does to it is what the next backward adds to), and a
    # window still held unreduced shows zero placeholders, which zero_grad() replaces by None or zeroes in place.
    def show_pending(self) -> None:
        """Each chunk's ``.grad`` becomes a zero placeholder (one scalar, broadcast: no memory); see :meth:`touched`.
        A no-op while the placeholders shown last are untouched."""
        if self._shown is not None and self.touched() is None:
            return
        zero = torch.zeros((), dtype=self.shard.dtype, device=self.shard.device)
        views = []
        for c in self.chunks:
            c.grad = zero.expand(c.shape)
            views.append(c.grad)
        self._shown = (zero, zero._version, views)

    def touched(self) -> Optional[str]:
        """Since :meth:`show_pending`: None (untouched), ``"none"`` (every chunk's gradient set to None:
        ``zero_grad()``) or ``"zeroed"`` (changed otherwise: ``zero_grad(set_to_none=False)`` zeroes in place)."""
        if self._shown is None:
            return None
        zero, version, views = self._shown
        if all(c.grad is None for c in self.chunks):
            return "none"
        if zero._version != version or any(c.grad is not v for c, v in zip(self.chunks, views)):
            return "zeroed"
        return None

    def held_grads(self) -> Optional[torch.Tensor]:
        """The gradient the optimizer holds now, over the whole shard (a copy; a chunk without one reads zeros), or
        None when no chunk has one."""
        if all(c.grad is None for c in self.chunks):
            return None
        out = torch.zeros(self.shard.numel(), dtype=self.shard.dtype, device=self.shard.device)
        for c, (i, j) in zip(self.chunks, self.ranges):
            if c.grad is not None:
                out[i:j].copy_(c.grad.reshape(-1))
        return out

    def leave_out(self, unused: set[int], opt_state: dict) -> bool:
        """Chunks of parameters without a gradient in this window get ``grad=None``; a chunk holding both kinds
        is split first. Returns True when the chunks changed (the optimizer's param groups must be rebound)."""
        if not unused:
            return False
        changed = self._split(lambda s: s in unused, opt_state)
        for c, (i, j) in zip(self.chunks, self.ranges):
            if self.slots_in(i, j)[0] in unused:
                c.grad = None
        return changed

    def _split(self, key: Any, opt_state: dict) -> bool:
        """Split every chunk into runs of consecutive slots with equal ``key(slot)``, moving state with it."""
        ranges, chunks, changed = [], [], False
        for c, (i, j) in zip(self.chunks, self.ranges):
            slots = self.slots_in(i, j)
            cuts = [max(self.slot_ranges[b][0], i) for a, b in zip(slots, slots[1:]) if key(a) != key(b)]
            if not cuts:
                ranges.append((i, j))
                chunks.append(c)
                continue
            changed = True
            state = opt_state.pop(c, None)
            for a, b in zip([i, *cuts], [*cuts, j]):
                piece = self._view(a, b)
                piece.grad = None if c.grad is None else c.grad[a - i:b - i]
                if state:
                    opt_state[piece] = {k: (v[a - i:b - i].clone() if elementwise(v, j - i) else
                                            (v.clone() if torch.is_tensor(v) else v)) for k, v in state.items()}
                ranges.append((a, b))
                chunks.append(piece)
        self.ranges, self.chunks = ranges, chunks
        return changed

    # ------------------------------------------------------------------ optimizer state per parameter
    def slot_state(self, opt_state: dict) -> dict[int, dict[str, Any]]:
        """This rank's optimizer state per parameter (slot): element-wise tensors over the slot's owned piece,
        scalars (``step``) as its chunks hold them. Slots whose parameter never stepped are absent."""
        pieces: dict[int, list[tuple[dict, int, int, int]]] = {}
        for c, (i, j) in zip(self.chunks, self.ranges):
            st = opt_state.get(c)
            if not st:
                continue
            for s in self.slots_in(i, j):
                a, e = self.slot_ranges[s]
                pieces.setdefault(s, []).append((st, max(a, i) - i, min(e, j) - i, j - i))
        out: dict[int, dict[str, Any]] = {}
        for s, parts in pieces.items():
            first = parts[0][0]
            out[s] = {k: (torch.cat([st[k].reshape(-1)[x:y] for st, x, y, _ in parts]) if elementwise(v, parts[0][3])
                          else v) for k, v in first.items()}
        return out

    def set_slot_state(self, opt_state: dict, states: dict[int, dict[str, Any]]) -> bool:
        """Inverse of :meth:`slot_state` (element-wise tensors cover each slot's owned piece). Chunks are split
        first where the parameters they hold come with different scalars (step counts). Returns True when the
        chunks changed."""
        def signature(s: int) -> Any:
            st = states.get(s)
            if not st:
                return None
            n = self.slot_ranges[s][1] - self.slot_ranges[s][0]
            return tuple(sorted((k, float(v) if torch.is_tensor(v) and v.numel() == 1 and not elementwise(v, n)
                                 else (None if elementwise(v, n) else repr(v))) for k, v in st.items()))

        for c in self.chunks:
            opt_state.pop(c, None)
        changed = self._split(signature, {})
        for c, (i, j) in zip(self.chunks, self.ranges):
            slots = self.slots_in(i, j)
            first = states.get(slots[0])
            if not first:
                continue
            entry: dict[str, Any] = {}
            for k, v in first.items():
                n0 = self.slot_ranges[slots[0]][1] - self.slot_ranges[slots[0]][0]
                if not elementwise(v, n0):
                    entry[k] = v.clone() if torch.is_tensor(v) else v
                    continue
                parts = []
                for s in slots:
                    a, e = self.slot_ranges[s]
                    parts.append(states[s][k].reshape(-1)[max(a, i) - a:min(e, j) - a])
                entry[k] = torch.cat(parts).clone().to(c.device)
            opt_state[c] = entry
        return changed
