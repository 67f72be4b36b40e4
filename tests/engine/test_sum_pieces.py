"""``sum_pieces_into`` (comm/reduce.py): the local half of the all-to-all reduce-scatter sums the ranks' pieces
in rank order, bit for bit, in place into the output it is given (a slice of a larger buffer included)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_shard.engine.comm.reduce import sum_pieces_into


def _row_order(pieces: torch.Tensor) -> torch.Tensor:
    out = pieces[0].clone()
    for j in range(1, pieces.shape[0]):
        out += pieces[j]
    return out


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 8), numel=st.integers(1, 3000), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 2**31 - 1))
def test_full_precision_pieces_are_added_in_rank_order(rows, numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    pieces = (torch.randn(rows, numel, generator=g, dtype=torch.float64) * 10 ** torch.randint(-3, 4, (rows, 1),
                                                                                             generator=g)).to(dtype)
    out = torch.full((numel,), float("nan"), dtype=dtype)
    assert sum_pieces_into(pieces, out) is out
    assert torch.equal(out, _row_order(pieces))


def test_the_output_may_be_a_slice_of_a_larger_buffer():
    pieces = torch.randn(3, 100)
    buf = torch.full((300,), -7.0)
    sum_pieces_into(pieces, buf[100:200])
    assert torch.equal(buf[100:200], _row_order(pieces))
    assert bool((buf[:100] == -7).all()) and bool((buf[200:] == -7).all())


@pytest.mark.parametrize("rows", [2, 3, 5])
def test_sixteen_bit_pieces_round_once(rows):
    """Two rows: one add, rounded once (what torch.sum gives too); more rows accumulate in float32 and round once, as
    torch.sum does, not after every add."""
    pieces = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    out = torch.empty(4096, dtype=torch.bfloat16)
    sum_pieces_into(pieces, out)
    assert torch.equal(out, pieces.float().sum(dim=0).to(torch.bfloat16))

