"""checkpoint/dcp.py's cut of a flat range into DCP boxes: exact cover, order, contiguity (hypothesis)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_shard.checkpoint.dcp import boxes


@st.composite
def shape_and_range(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    n = math.prod(shape)
    lo = draw(st.integers(0, n - 1))
    hi = draw(st.integers(lo + 1, n))
    return shape, lo, hi


@settings(max_examples=300, deadline=None)
@given(shape_and_range())
def test_boxes_tile_the_range_in_order(case):
    shape, lo, hi = case
    full = torch.arange(math.prod(shape)).view(shape)
    pos = lo
    for offsets, sizes, start in boxes(shape, lo, hi):
        assert start == pos  # in order, no gap
        region = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        flat = region.reshape(-1)
        assert torch.equal(flat, torch.arange(start, start + flat.numel()))  # contiguous in the flat layout
        pos += flat.numel()
    assert pos == hi  # the whole range, nothing beyond


def test_a_range_inside_one_row_and_whole_rows():
    assert boxes((4, 6), 2, 5) == [((0, 2), (1, 3), 2)]
    assert boxes((4, 6), 6, 18) == [((1, 0), (2, 6), 6)]
    assert boxes((4, 6), 3, 21) == [((0, 3), (1, 3), 3), ((1, 0), (2, 6), 6), ((3, 0), (1, 3), 18)]
