"""Property tests (hypothesis): flat sharding round-trips, padding never reaches optimizer state or
checkpoints, and the topology parser either parses a mutated real capture or raises its own error."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_shard.engine.buckets.flat import flat_layout, flatten_into, slot_views
from lightning_shard.topology import TopologyParseError, parse_topo

shapes = st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple), min_size=1, max_size=8)
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])
worlds = st.integers(1, 8)


@settings(max_examples=200, deadline=None)
@given(shapes, dtypes, worlds)
def test_flat_layout_round_trips_exactly(shape_list, dtype, world):
    names = [(f"p{i}", s) for i, s in enumerate(shape_list)]
    layout = flat_layout(names, world)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g).to(dtype) for _, s in names]
    flat = torch.full((layout.padded_numel,), float("nan"), dtype=dtype)
    flatten_into(layout, tensors, flat)
    for t, v in zip(tensors, slot_views(layout, flat)):
        assert v.shape == t.shape and torch.equal(v, t)
    assert layout.padded_numel % world == 0 and 0 <= layout.padding < world
    assert torch.count_nonzero(flat[layout.numel:]) == 0  # padding is zero, never garbage
    # shards partition the padded buffer; owned (optimizer / checkpoint) ranges partition the real elements
    shards = [layout.shard_range(r) for r in range(world)]
    assert shards[0][0] == 0 and shards[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
    owned = [layout.owned_range(r) for r in range(world)]
    assert sum(hi - lo for lo, hi in owned) == layout.numel
    assert all(hi <= layout.numel for _, hi in owned)


@settings(max_examples=200, deadline=None)
@given(shapes, worlds)
def test_checkpoint_pieces_cover_each_parameter_once(shape_list, world):
    """What each rank writes (its owned range intersected with each parameter) covers every element of every
    parameter exactly once, and never a padding element."""
    layout = flat_layout([(f"p{i}", s) for i, s in enumerate(shape_list)], world)
    for slot in layout.slots:
        covered = []
        for r in range(world):
            lo, hi = layout.owned_range(r)
            a, b = max(lo, slot.offset), min(hi, slot.end)
            if a < b:
                covered.append((a - slot.offset, b - slot.offset))
        covered.sort()
        total = sum(b - a for a, b in covered)
        assert total == slot.numel
        assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))


CAPTURES = sorted((Path(__file__).parents[1] / "assets" / "topology").glob("*.txt"))
texts = [p.read_text() for p in CAPTURES]


@st.composite
def mutated_capture(draw):
    text = draw(st.sampled_from(texts))
    lines = text.splitlines()
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["drop_line", "dup_line", "cut", "swap_token", "junk", "del_chars"]))
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        if kind == "drop_line":
            lines.pop(i)
        elif kind == "dup_line":
            lines.insert(i, lines[i])
        elif kind == "cut":
            lines = lines[:i]
        elif kind == "swap_token":
            tok = lines[i].split()
            if tok:
                j = draw(st.integers(0, len(tok) - 1))
                tok[j] = draw(st.sampled_from(["NV4", "X", "SYS", "N/A", "PIX", "NODENODE", "0-11", "GPU9", "??"]))
                lines[i] = "\t".join(tok)
        elif kind == "junk":
            lines.insert(i, draw(st.text(max_size=30)))
        else:
            k = draw(st.integers(0, max(0, len(lines[i]) - 1)))
            lines[i] = lines[i][:k] + lines[i][k + 3:]
    return "\n".join(lines)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_capture())
def test_parser_parses_or_raises_its_own_error(text):
    try:
        topo = parse_topo(text, source="<mutated>")
    except TopologyParseError:
        return
    assert len(topo.devices) >= 1  # a parse that succeeds yields a usable topology
    for isl in topo.islands:
        assert isl.devices
