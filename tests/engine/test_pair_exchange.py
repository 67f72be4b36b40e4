"""The all-to-all reduce-scatter on a group of two ranks (``C.exchange_pair``, comm/reduce.py ``PairExchange``): the
other rank's piece arrives straight into the shard output and this rank's own piece is added to it, with no full-size
pieces buffer. What it must give: exactly the rank-order sum that the N-piece path (``sum_pieces_into``) gives, at
stage 1 (reduced in place into the bucket's own range) and stage 2 (a fresh shard), in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_shard.engine.buckets.bucket import Bucket
from lightning_shard.engine.buckets.context import BucketContext
from lightning_shard.engine.comm import collectives as C
from lightning_shard.engine.comm.choices import CommChoices
from lightning_shard.engine.comm.reduce import PairExchange, sum_pieces_into
from lightning_shard.engine.spec import ShardSpec
from lightning_shard.engine.states import GradState


@pytest.fixture(scope="module")
def w(worlds):
    return worlds(2)


def exchanged(n: int) -> dict[str, torch.Tensor]:
    """``exchange_pair`` alone: what arrives, and what should."""
    rank = C.get_rank()
    full = torch.arange(2 * n, dtype=torch.float32) + 1000 * rank
    out = torch.full((n,), -1.0)
    work = C.exchange_pair(out, full, async_op=True, tag="test_pair")
    work.wait()
    everyone = [torch.empty(2 * n) for _ in range(2)]
    torch.distributed.all_gather(everyone, full)
    return {"out": out, "expected": everyone[1 - rank][rank * n:(rank + 1) * n]}


def test_exchange_pair_delivers_the_other_ranks_piece_of_mine(w):
    for r in w.run(exchanged, 1000):
        assert torch.equal(r["out"], r["expected"])


def reduced(stage: int, dtype: torch.dtype, numel: int) -> dict[str, torch.Tensor]:
    """One bucket of one parameter, a gradient set by hand, reduced by the engine's path; against the rank-order sum
    of every rank's gradient (``sum_pieces_into``, the N-piece path's local half) divided by the world size."""
    rank, world = C.get_rank(), C.get_world_size()
    p = nn.Parameter(torch.zeros(numel, dtype=dtype))
    ctx = BucketContext(ShardSpec(stage, world), rank, reduce_dtype=dtype,
                        comm=CommChoices(reduce_scatter="all_to_all"))
    b = Bucket(ctx, 0, [p], ["w"], 0, [0])
    g = torch.Generator().manual_seed(11 + rank)
    grad = torch.randn(numel, generator=g).to(dtype)
    p.grad = grad.clone()
    b.attach_grads()
    b.grads.launch(async_op=True)
    in_flight = b.grads.in_flight
    assert isinstance(in_flight.form, PairExchange) and in_flight.pieces is None  # no full-size pieces buffer
    in_place = in_flight.out.data_ptr() == b.grad_buf[b.shard_start:].data_ptr()
    b.grads.finish(boundary=True, accumulate=False)
    got = b.shard_param.grad.clone()
    b.grads.set_state(GradState.EMPTY)
    everyone = [torch.empty(b.layout.padded_numel, dtype=dtype) for _ in range(world)]
    padded = torch.zeros(b.layout.padded_numel, dtype=dtype)
    padded[:numel] = grad
    torch.distributed.all_gather(everyone, padded)
    pieces = torch.stack([e[b.shard_start:b.shard_end] for e in everyone])
    want = sum_pieces_into(pieces, torch.empty(pieces.shape[1], dtype=dtype))[: b.owned_numel].div_(world)
    return {"got": got, "want": want, "in_place": torch.tensor(in_place)}


@pytest.mark.parametrize("stage,dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_pair_reduction_is_the_rank_order_sum_bit_for_bit(w, stage, dtype):
    for r in w.run(reduced, stage, dtype, 4099):
        assert torch.equal(r["got"], r["want"])
        # stage 1 reduces into its own range of the bucket (its piece must survive until it is added); stage 2 into
        # a fresh shard that the other rank's piece fills
        assert bool(r["in_place"]) == (stage == 1)


def test_exchange_pair_needs_two_ranks():
    with pytest.raises(ValueError, match="needs a group of 2 ranks, got 1"):
        C.exchange_pair(torch.empty(4), torch.empty(8))
