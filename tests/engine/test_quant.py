"""Block quantization (comm/quant.py): round-trip bounds, the byte layout on the wire, non-finite values, the knob
rules."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_shard.engine.comm import quant as Q
from lightning_shard.engine.comm.reduce import sum_quantized_pieces
from lightning_shard.options import Compression

KINDS = ("int8", "int4")


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(KINDS), block=st.sampled_from([8, 16, 64, 256]), pieces=st.integers(1, 4),
       numel=st.integers(1, 700), scale=st.floats(1e-6, 1e4), seed=st.integers(0, 2**31 - 1))
def test_round_trip_error_is_at_most_half_a_step_of_its_block(kind, block, pieces, numel, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(pieces, numel, generator=g) * scale
    x[x.abs() < scale * 0.01] = 0.0  # some exact zeros too
    q = Q.QuantLayout.of(kind, block, numel)
    buf = torch.empty(pieces, q.piece_bytes, dtype=torch.uint8)
    sent = Q.quantize(x, q, buf)
    back = Q.dequantize(buf, q, torch.empty(pieces, numel))
    assert torch.equal(sent, back)  # what the sender computes as sent is what every receiver decodes
    padded = torch.nn.functional.pad(x, (0, q.nblocks * block - numel)).view(pieces, q.nblocks, block)
    half_step = padded.abs().amax(dim=2, keepdim=True) / (2 * q.levels)
    err = torch.nn.functional.pad(x - back, (0, q.nblocks * block - numel)).view(pieces, q.nblocks, block).abs()
    assert bool((err <= half_step * (1 + 1e-5) + 1e-30).all()), (err - half_step).max()
    assert bool((back[x == 0] == 0).all())  # zeros stay zero
    # the largest magnitude of each block is represented exactly up to fp32 rounding (it defines the scale)
    i = x.abs().argmax()
    assert math.isclose(back.view(-1)[i].item(), x.view(-1)[i].item(), rel_tol=1e-5)


@pytest.mark.parametrize("kind,bits", [("int8", 8), ("int4", 4)])
@pytest.mark.parametrize("numel,block", [(1000, 256), (256, 256), (5, 8), (4097, 64)])
def test_piece_bytes_are_the_integers_plus_one_fp32_scale_per_block(kind, bits, numel, block):
    nblocks = -(-numel // block)
    assert Q.piece_bytes(kind, block, numel) == nblocks * block * bits // 8 + 4 * nblocks
    q = Q.QuantLayout.of(kind, block, numel)
    buf = torch.empty(2, q.piece_bytes, dtype=torch.uint8)
    Q.quantize(torch.randn(2, numel), q, buf)  # fills exactly that layout (shape checked inside)


def test_int8_bytes_are_a_quarter_of_fp32_and_half_of_bf16_plus_scales():
    numel, block = 1 << 20, 256
    fp32, bf16 = 4 * numel, 2 * numel
    int8 = Q.piece_bytes("int8", block, numel)
    assert int8 == numel + 4 * numel // block
    assert int8 / fp32 == pytest.approx(0.25 + 1 / block)
    assert int8 / bf16 == pytest.approx(0.5 + 2 / block)
    assert Q.piece_bytes("int4", block, numel) / fp32 == pytest.approx(0.125 + 1 / block)


def test_a_block_holding_a_non_finite_value_arrives_as_nan_and_the_others_are_untouched():
    x = torch.tensor([[float("inf")] + [1.0] * 7 + [2.0] * 8, [float("nan")] + [0.0] * 7 + [-3.0] * 8])
    for kind in KINDS:
        q = Q.QuantLayout.of(kind, 8, 16)
        buf = torch.empty(2, q.piece_bytes, dtype=torch.uint8)
        Q.quantize(x, q, buf)
        back = Q.dequantize(buf, q, torch.empty(2, 16))
        assert bool(back[:, :8].isnan().all())  # skip_nonfinite / the fp16 overflow check still see it
        assert torch.equal(back[:, 8:], x[:, 8:])


def test_sum_pieces_is_the_fp32_rank_order_sum_of_the_decoded_pieces_in_any_output_dtype():
    q = Q.QuantLayout.of("int8", 64, 300)
    buf = torch.empty(4, q.piece_bytes, dtype=torch.uint8)
    sent = Q.quantize(torch.randn(4, 300), q, buf)
    in_rank_order = ((sent[0] + sent[1]) + sent[2]) + sent[3]
    out = sum_quantized_pieces(buf, q, torch.empty(300))
    assert torch.equal(out, in_rank_order)
    half = sum_quantized_pieces(buf, q, torch.empty(300, dtype=torch.bfloat16))
    assert torch.equal(half, in_rank_order.to(torch.bfloat16))


@pytest.mark.parametrize("args,match", [
    ((3, "int16", "none", 256), "gather_quant must be one of"),
    ((3, "none", "fp8", 256), "reduce_quant must be one of"),
    ((3, "int8", "none", 100), "multiple of 8"),
    ((3, "int8", "none", True), "multiple of 8"),
    ((2, "int8", "none", 256), "only stage 3 has"),
    ((0, "none", "int8", 256), "zero0 all-reduces"),
])
def test_option_rules_name_the_option_and_the_fix(args, match):
    stage, gather, reduce, block = args
    with pytest.raises(ValueError, match=match):
        Compression(gather_quant=gather, reduce_quant=reduce, block=block).validate(stage)


def test_reduce_quant_refuses_reduce_dtype_and_a_path_that_sums_on_the_way():
    with pytest.raises(ValueError, match="set one of them"):
        Compression(reduce_quant="int8", reduce_dtype="bf16").validate(2)
    Compression(reduce_quant="int4", block=64).validate(1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_quantizes_to_the_same_bytes_as_the_cpu(kind):
    """What one rank quantizes on a GPU, another decodes to the same values (the byte layout is device-free)."""
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(0)) * 3
    q = Q.QuantLayout.of(kind, 256, 5000)
    cpu, gpu = torch.empty(3, q.piece_bytes, dtype=torch.uint8), torch.empty(3, q.piece_bytes, dtype=torch.uint8,
                                                                            device="cuda")
    Q.quantize(x, q, cpu)
    Q.quantize(x.cuda(), q, gpu)
    assert torch.equal(cpu, gpu.cpu())
    back = Q.dequantize(gpu, q, torch.empty(3, 5000, device="cuda", dtype=torch.bfloat16))
    assert torch.equal(back.cpu(), Q.dequantize(cpu, q, torch.empty(3, 5000, dtype=torch.bfloat16)))
