"""Block quantization for compressed communication (``gather_quant``, ``reduce_quant``).

A tensor of ``pieces x numel`` values (one piece per destination or source rank) is cut, piece by piece, into blocks
of ``block`` elements. Each block is stored as signed integers with one fp32 scale, ``absmax / levels``
(symmetric, round to nearest): int8 keeps 127 levels a side, int4 keeps 7 (two values per byte). A piece travels as
one byte string, the integers first and the block scales after them, so one collective moves both and its bytes are
the real payload::

    piece_bytes = nblocks * block * bits / 8 + 4 * nblocks,    nblocks = ceil(numel / block)

A dequantized element differs from its input by at most half a step, ``absmax(block) / (2 * levels)``; a block holding
an inf or a nan dequantizes to nan everywhere (the non-finite checks downstream still see it). The engine uses this
for the stage-3 parameter all-gather (buckets/gather.py ``ParamGather.unshard``) and for the gradient reduce-scatter
as an all-to-all of quantized pieces summed in fp32 on arrival, with error feedback (comm/reduce.py
``QuantizedAllToAll``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = {"int8": 8, "int4": 4}
LEVELS = {8: 127, 4: 7}


def check_block(block: object) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 8 or block % 8:
        raise ValueError(f"quant_block must be an integer >= 8 and a multiple of 8 (elements per scale), got {block!r}")
    return block


@dataclass(frozen=True)
class QuantLayout:
    """How one piece of ``numel`` elements is laid out as bytes."""

    bits: int
    block: int
    numel: int

    def __post_init__(self) -> None:
        if self.bits not in LEVELS:
            raise ValueError(f"quantization to {self.bits} bits: only 8 and 4 are built")
        check_block(self.block)

    @classmethod
    def of(cls, kind: str, block: int, numel: int) -> "QuantLayout":
        if kind not in BITS:
            raise ValueError(f"quantization kind must be one of {tuple(BITS)}, got {kind!r}")
        return cls(BITS[kind], block, numel)

    @property
    def levels(self) -> int:
        return LEVELS[self.bits]

    @property
    def nblocks(self) -> int:
        return -(-self.numel // self.block)

    @property
    def qbytes(self) -> int:
        """Bytes of the integers (a multiple of 4: ``block`` is a multiple of 8)."""
        return self.nblocks * self.block * self.bits // 8

    @property
    def piece_bytes(self) -> int:
        return self.qbytes + 4 * self.nblocks


def piece_bytes(kind: str, block: int, numel: int) -> int:
    """Bytes on the wire for one piece of ``numel`` elements (the formula of the module docstring)."""
    return QuantLayout.of(kind, block, numel).piece_bytes


def quantize(x: torch.Tensor, q: QuantLayout, out: torch.Tensor) -> torch.Tensor:
    """Quantize ``x`` (``pieces x numel``, any float dtype) into ``out`` (``pieces x piece_bytes``, uint8, contiguous);
    returns the dequantized values (``pieces x numel``, fp32), what the receivers will see: the error feedback's
    ``x - returned``."""
    pieces = x.shape[0]
    if x.shape != (pieces, q.numel) or out.shape != (pieces, q.piece_bytes) or out.dtype != torch.uint8:
        raise ValueError(f"quantize: x {tuple(x.shape)} / out {tuple(out.shape)} {out.dtype} do not fit {q}")
    padded = q.nblocks * q.block
    xb = x.float()
    if padded != q.numel:
        xb = torch.nn.functional.pad(xb, (0, padded - q.numel))
    xb = xb.reshape(pieces, q.nblocks, q.block)
    scale = xb.abs().amax(dim=2).div_(q.levels)  # (pieces, nblocks); inf/nan propagate
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    ints = torch.round(xb * inv.unsqueeze(2)).clamp_(-q.levels, q.levels)
    deq = (ints * scale.unsqueeze(2)).reshape(pieces, padded)[:, :q.numel]
    ints = ints.to(torch.int8)
    if q.bits == 8:
        payload = ints.view(torch.uint8).reshape(pieces, q.qbytes)
    else:  # two values per byte: low nibble the even element, high nibble the odd one, each offset by 8
        u = (ints + 8).to(torch.uint8).reshape(pieces, q.qbytes, 2)
        payload = u[..., 0] | (u[..., 1] << 4)
    out[:, :q.qbytes].copy_(payload)
    out[:, q.qbytes:].view(torch.float32).copy_(scale)
    return deq


def dequantize(buf: torch.Tensor, q: QuantLayout, out: torch.Tensor) -> torch.Tensor:
    """The values of ``buf`` (``pieces x piece_bytes`` uint8, from :func:`quantize`) written into ``out``
    (``pieces x numel``, any float dtype); returns ``out``."""
    pieces = buf.shape[0]
    if buf.shape != (pieces, q.piece_bytes) or out.shape != (pieces, q.numel):
        raise ValueError(f"dequantize: buf {tuple(buf.shape)} / out {tuple(out.shape)} do not fit {q}")
    payload = buf[:, :q.qbytes]
    if q.bits == 8:
        ints = payload.contiguous().view(torch.int8).float()
    else:
        p = payload.to(torch.int16)
        ints = torch.stack(((p & 15) - 8, (p >> 4) - 8), dim=2).float()
    scale = buf[:, q.qbytes:].contiguous().view(torch.float32)
    vals = ints.reshape(pieces, q.nblocks, q.block).mul_(scale.unsqueeze(2))
    out.copy_(vals.reshape(pieces, q.nblocks * q.block)[:, :q.numel])
    return out


__all__ = ["BITS", "LEVELS", "QuantLayout", "check_block", "dequantize", "piece_bytes", "quantize"]
