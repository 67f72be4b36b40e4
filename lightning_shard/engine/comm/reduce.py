"""How a bucket's gradients are summed over the ranks: the one file that answers it.

A bucket's full gradient buffer (every parameter's gradient end to end, padded) is summed over the shard group;
each rank keeps its own shard of the sum (stages 1-3) or the whole sum (stage 0). A :class:`ReduceForm` is one way
to do it. The engine picks one per backend, once (:func:`reduce_form`, from ``CommChoices.reduce_scatter``,
comm/choices.py), and each bucket binds it to its ranges in a :class:`Reduction` (``Bucket.grads.reduction``):

* :class:`BackendReduceScatter`: the backend's own reduce-scatter (``"auto"`` everywhere but gloo: NCCL's is the
  fast one);
* :class:`AllToAllSum`: an all-to-all of the buffer (rank j receives every rank's j-th 1/N) and the sum of the N
  pieces; ``"auto"`` on gloo, where it is 1.7-7x faster than gloo's reduce-scatter and 1.3-10x faster than an
  all-reduce of the bucket (but 0.95x at 256 KiB on 2 ranks), at 64 KiB to 25 MiB on 2 and 4 CPU ranks, torch 2.13
  (the collectives benchmark), and moves the reduce-scatter's (N-1)/N of the bucket per rank; it costs a second
  full-size buffer (the pieces) while the reduction is in flight;
* :class:`PairExchange`: the all-to-all form on a group of 2 ranks: the other rank's piece arrives straight into the
  shard and this rank's own piece is added to it (:func:`collectives.exchange_pair`), no pieces buffer;
* :class:`InPlaceAllReduce`: an in-place all-reduce of the bucket, each rank keeping its range (twice the bytes; the
  default on gloo before the all-to-all form was measured).

Two forms are not a backend choice, :class:`Reduction` puts them in its place: :class:`AllReduce` is stage 0's (every
rank keeps the whole sum), and :class:`QuantizedAllToAll` a bucket's own under ``reduce_quant`` (comm/quant.py:
quantized pieces in an all-to-all, summed in fp32 on arrival, with error feedback). Gradients travel in
:func:`reduce_dtype_for`'s dtype. The sums are the same up to the order of floating-point additions;
the ledger records the collective that runs and its bytes.

:meth:`Reduction.launch` issues the collective and returns an :class:`InFlight`; :meth:`InFlight.wait` waits, runs
the local half (the sum of the pieces) and returns this rank's owned elements of the sum; at the window's boundary
:meth:`Reduction.average` turns that sum into the average (hybrid: the cross-island all-reduce first). When a
bucket reduces, and what it does with the result, is buckets/grads.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ...options import Compression
from ..labels import label
from ..spec import ShardSpec
from . import collectives as C
from . import quant as Q

REDUCE_SCATTER_VIA = ("auto", "reduce_scatter", "all_reduce", "all_to_all")
Alloc = Callable[[int, torch.dtype], torch.Tensor]  # a buffer allocated every step (huge pages on CPU: hostmem.py)


def reduce_dtype_for(bucket_dtype: torch.dtype, configured: Optional[torch.dtype]) -> torch.dtype:
    """The dtype a bucket's gradients travel in: ``reduce_dtype`` where set, else fp32 for half precision (the sum of
    N half-precision pieces would round N times), else the bucket's own."""
    if configured is not None:
        return configured
    return torch.float32 if bucket_dtype in (torch.float16, torch.bfloat16) else bucket_dtype


def sum_pieces_into(pieces: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` = the sum of the rows of ``pieces`` (N x n: rank j's piece in row j), added in row order, the same on
    every rank: the local half of the all-to-all reduce-scatter.

    Row by row (``out = p0 + p1``, then ``out += p2`` ...) rather than ``torch.sum(pieces, dim=0)``: on CPU, torch
    2.13, one thread, the adds were 2.2-2.8x faster for 2 rows of 0.75-12 MiB float32, 0.97-7.2x (median 2.1x) over
    2-8 rows, 10x for 2 rows of bfloat16, and they are the row-order sum bit for bit. Two rows of any dtype (one
    rounding either way) and float32/float64 are added so; more rows of a 16-bit dtype keep ``torch.sum``, which
    accumulates in float32 and rounds once."""
    rows = pieces.shape[0]
    if rows == 1:
        return out.copy_(pieces[0])
    if rows > 2 and pieces.dtype not in (torch.float32, torch.float64):
        return torch.sum(pieces, dim=0, out=out)
    torch.add(pieces[0], pieces[1], out=out)
    for j in range(2, rows):
        out.add_(pieces[j])
    return out


def sum_quantized_pieces(buf: torch.Tensor, q: Q.QuantLayout, out: torch.Tensor) -> torch.Tensor:
    """The sum over pieces (in piece order, the same on every rank) of the dequantized ``buf``, in fp32, written into
    ``out`` (``numel``, any float dtype)."""
    vals = Q.dequantize(buf, q, torch.empty(buf.shape[0], q.numel, dtype=torch.float32, device=buf.device))
    if out.dtype == torch.float32:
        return sum_pieces_into(vals, out)
    return out.copy_(sum_pieces_into(vals, torch.empty(q.numel, dtype=torch.float32, device=buf.device)))


@dataclass
class InFlight:
    """A reduction launched and not waited yet, with the buffers it needs until then."""

    form: "ReduceForm"
    work: Any  # the collective's work; None: nothing to wait for (a group of one rank, a synchronous call)
    src: torch.Tensor  # the buffer sent (kept alive until waited)
    out: torch.Tensor  # where the sum of this rank's range lands (stage 0: the whole sum)
    mine: tuple[int, int]  # this rank's owned elements in ``out``
    pieces: Optional[torch.Tensor] = None  # all-to-all forms: every rank's piece of this rank's range, one per row
    recv: Optional[torch.Tensor] = None  # the pair exchange: where the other rank's piece of this rank's range lands
    own: Optional[torch.Tensor] = None  # the pair exchange: this rank's own piece (in ``src``), added on arrival

    def wait(self, what: str) -> torch.Tensor:
        """Wait (``what``: the message of a failure), finish the sum here, and return this rank's owned elements."""
        if self.work is not None:
            with label("reduce_wait"):
                C.wait(self.work, what)
        self.form.finish(self)
        return self.out[self.mine[0]:self.mine[1]]


class ReduceForm:
    """One way of summing a bucket's gradient buffer over the shard group. Engine-wide forms hold no state."""

    name = ""
    # the shard of the sum is a slice of the full buffer, which would stay alive with it: copied out where the stage
    # frees the full buffer after the reduction (the in-place all-reduce)
    shard_in_full_buffer = False

    def launch(self, r: "Reduction", full: torch.Tensor, async_op: bool, tag: str) -> InFlight:
        src = full if full.dtype == r.dtype else full.to(r.dtype)
        if r.world == 1:  # a group of one rank: the sum is the buffer itself, no collective to wait for
            return InFlight(LOCAL, None, src, src[r.shard[0]:r.shard[1]] if r.scatters else src, r.mine)
        return self.issue(r, full, src, async_op, tag)

    def issue(self, r: "Reduction", full: torch.Tensor, src: torch.Tensor, async_op: bool, tag: str) -> InFlight:
        raise NotImplementedError

    def finish(self, f: InFlight) -> None:
        """The local half, after the wait (nothing for the backend's own collectives)."""

    @staticmethod
    def shard_out(r: "Reduction", full: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Where the shard of the sum lands: stage 1 keeps its full buffer anyway, so a reduction in the buffer's
        own dtype lands in place, in this rank's range of it (NCCL's in-place layout; gloo too), and the averaged
        shard costs no buffer of its own; otherwise a fresh shard."""
        if src is full and r.keeps_full:
            return full[r.shard[0]:r.shard[1]]
        return r.alloc(r.shard[1] - r.shard[0], r.dtype)


class _Local(ReduceForm):
    name = "local"


LOCAL = _Local()  # what a group of one rank runs: nothing


class AllReduce(ReduceForm):
    """Stage 0: an in-place all-reduce of the buffer; every rank keeps the whole sum."""

    name = "all_reduce"

    def issue(self, r: "Reduction", full: torch.Tensor, src: torch.Tensor, async_op: bool, tag: str) -> InFlight:
        return InFlight(self, C.all_reduce(src, group=r.group, async_op=async_op, tag=tag), src, src, r.mine)


class BackendReduceScatter(ReduceForm):
    name = "reduce_scatter"

    def issue(self, r: "Reduction", full: torch.Tensor, src: torch.Tensor, async_op: bool, tag: str) -> InFlight:
        out = self.shard_out(r, full, src)
        return InFlight(self, C.reduce_scatter(out, src, group=r.group, async_op=async_op, tag=tag), src, out, r.mine)


class InPlaceAllReduce(ReduceForm):
    """The whole buffer is summed in place; this rank's range of it is its shard."""

    name = "all_reduce"
    shard_in_full_buffer = True

    def issue(self, r: "Reduction", full: torch.Tensor, src: torch.Tensor, async_op: bool, tag: str) -> InFlight:
        work = C.all_reduce(src, group=r.group, async_op=async_op, tag=tag)
        return InFlight(self, work, src, src[r.shard[0]:r.shard[1]], r.mine)


class AllToAllSum(ReduceForm):
    """Every rank's piece of this rank's range arrives (a full-size buffer of pieces); summed on arrival, in rank
    order: the same sum on every rank."""

    name = "all_to_all"

    def issue(self, r: "Reduction", full: torch.Tensor, src: torch.Tensor, async_op: bool, tag: str) -> InFlight:
        out = self.shard_out(r, full, src)
        pieces = r.alloc(src.numel(), src.dtype)
        work = C.all_to_all(pieces, src, group=r.group, async_op=async_op, tag=tag)
        return InFlight(self, work, src, out, r.mine, pieces=pieces.view(r.world, -1))

    def finish(self, f: InFlight) -> None:
        sum_pieces_into(f.pieces, f.out)


class PairExchange(ReduceForm):
    """The all-to-all form on two ranks: the other rank's piece of this rank's range arrives, and this rank's own
    piece (still in the buffer sent) is added to it on arrival; no full-size pieces buffer, no local copy. Two
    pieces: a + b is b + a bit for bit, so this is the rank-order sum too."""

    name = "all_to_all"

    def issue(self, r: "Reduction", full: torch.Tensor, src: torch.Tensor, async_op: bool, tag: str) -> InFlight:
        out = recv = self.shard_out(r, full, src)
        if out.data_ptr() == src[r.shard[0]:].data_ptr():
            # stage 1 in place: its own piece must not be overwritten before it is added
            recv = r.alloc(out.numel(), src.dtype)
        work = C.exchange_pair(recv, src, group=r.group, async_op=async_op, tag=tag)
        return InFlight(self, work, src, out, r.mine, recv=recv, own=src[r.shard[0]:r.shard[1]])

    def finish(self, f: InFlight) -> None:
        f.out.add_(f.own if f.recv is f.out else f.recv)


class QuantizedAllToAll(ReduceForm):
    """``reduce_quant``, one per bucket: this rank's gradient plus the error it has not sent yet, quantized piece by
    piece (piece j is rank j's range), in an all-to-all; the pieces that arrive are dequantized and summed in fp32.
    What quantization loses stays in ``residual`` for the next reduction (``error_feedback``), so over many steps the
    gradients applied sum to the gradients computed, within one step's quantization error."""

    name = "all_to_all"

    def __init__(self, q: Q.QuantLayout, error_feedback: bool) -> None:
        self.q, self.error_feedback = q, error_feedback
        self.residual: Optional[torch.Tensor] = None  # this rank's error not yet sent (fp32, the full buffer)

    def launch(self, r: "Reduction", full: torch.Tensor, async_op: bool, tag: str) -> InFlight:
        q, world = self.q, r.world
        x = r.alloc(full.numel(), torch.float32).copy_(full)
        if self.residual is not None:
            x.add_(self.residual)
        nbytes = world * q.piece_bytes
        send = r.alloc(nbytes, torch.uint8).view(world, -1)
        sent = Q.quantize(x.view(world, -1), q, send)
        if self.error_feedback:
            # a non-finite gradient (an fp16 overflow, a step skip_nonfinite skips) leaves no error to carry: without
            # this a nan would stay in the residual and poison every later reduction
            self.residual = x.view(world, -1).sub_(sent).view(-1).nan_to_num_(0.0, 0.0, 0.0)
        pieces = r.alloc(nbytes, torch.uint8).view(world, -1)
        if full.dtype == torch.float32 and r.keeps_full:
            out = full[r.shard[0]:r.shard[1]]  # stage 1: into its own range, as unquantized
        else:
            out = r.alloc(r.shard[1] - r.shard[0], torch.float32)
        work = C.all_to_all(pieces.view(-1), send.view(-1), group=r.group, async_op=async_op, tag=tag)
        return InFlight(self, work, send, out, r.mine, pieces=pieces)

    def finish(self, f: InFlight) -> None:
        sum_quantized_pieces(f.pieces, self.q, f.out)


def reduce_form(choice: str, group: C.Group = None) -> ReduceForm:
    """The form the gradient reduce-scatters on ``group`` run as (``CommChoices.reduce_scatter``): ``"auto"`` is
    :class:`AllToAllSum` on gloo (:class:`PairExchange` on 2 ranks), the backend's reduce-scatter elsewhere."""
    if choice == "auto":  # (a choice CommChoices validated)
        choice = "all_to_all" if C.backend(group) == "gloo" else "reduce_scatter"
    if choice == "all_to_all":
        return PAIR_EXCHANGE if C.get_world_size(group) == 2 else ALL_TO_ALL_SUM
    return IN_PLACE_ALL_REDUCE if choice == "all_reduce" else BACKEND_REDUCE_SCATTER


ALL_REDUCE, BACKEND_REDUCE_SCATTER, IN_PLACE_ALL_REDUCE = AllReduce(), BackendReduceScatter(), InPlaceAllReduce()
ALL_TO_ALL_SUM, PAIR_EXCHANGE = AllToAllSum(), PairExchange()


class Reduction:
    """One bucket's gradient reduction: its form (the engine's ``form``; stage 0's :class:`AllReduce`; under
    ``reduce_quant`` where a collective runs, a :class:`QuantizedAllToAll` of its own), bound to the bucket's ranges,
    group and reduce dtype (:func:`reduce_dtype_for` its ``dtype`` and the configured ``reduce_dtype``)."""

    def __init__(self, spec: ShardSpec, form: ReduceForm, *, group: C.Group, shard: tuple[int, int],
                 own: tuple[int, int], dtype: torch.dtype, alloc: Alloc, reduce_dtype: Optional[torch.dtype] = None,
                 reduce_quant: str = "none", quant_block: int = Compression.block, error_feedback: bool = True,
                 replicate_group: C.Group = None, total_world: int = 1) -> None:
        if not spec.reduce_scatters:
            form = ALL_REDUCE
        elif reduce_quant != "none" and spec.world > 1:
            form = QuantizedAllToAll(Q.QuantLayout.of(reduce_quant, quant_block, shard[1] - shard[0]), error_feedback)
        self.form, self.group, self.world, self.alloc = form, group, spec.world, alloc
        self.dtype = reduce_dtype_for(dtype, reduce_dtype)
        self.shard = shard  # this rank's padded range of the full buffer
        self.scatters = spec.reduce_scatters  # each rank keeps its shard of the sum; stage 0 keeps the whole
        # this rank's owned (not padding) elements in the result: the start of its shard, or its range of the whole
        self.mine = (0, own[1] - own[0]) if self.scatters else own
        self.keeps_full = not spec.frees_grads  # the stage keeps its full gradient buffer: results may land in it
        self.replicate_group, self.total_world = replicate_group, total_world

    def launch(self, full: torch.Tensor, async_op: bool, tag: str) -> InFlight:
        """Start summing ``full`` (the bucket's gradient buffer) over the group."""
        return self.form.launch(self, full, async_op, tag)

    @property
    def residual(self) -> Optional[torch.Tensor]:
        """``reduce_quant``'s error not yet sent (error feedback), or None."""
        return getattr(self.form, "residual", None)

    def average(self, mine: torch.Tensor, dtype: torch.dtype, tag: str) -> torch.Tensor:
        """The window's sum of this rank's owned elements (``mine``, from :meth:`InFlight.wait`, accumulated)
        as the average over every rank, in ``dtype``: hybrid sharding first sums it over the other islands (one
        all-reduce of the shard, at the boundary)."""
        if self.replicate_group is not None:
            C.all_reduce(mine, group=self.replicate_group, tag=tag)
        if mine.dtype != dtype:
            mine = mine.to(dtype)
        if self.total_world > 1:  # (x / 1 is x: at world 1 the pass over the shard is skipped, bit for bit the same)
            mine.div_(self.total_world)
        return mine
