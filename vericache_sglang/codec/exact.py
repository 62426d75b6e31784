"""The exact part: the KV's own bits, coded given the compressed pool's level.

Each element x is known by the decoder to lie near the pool level's bin (centre `pred`, half
width `half`, both float32 from the stored codes, scales and zeros). On the integers that order
the dtype's bit patterns, that bin is an interval of a few dozen values for most elements: x's
offset in it is coded uniformly (`narrow`). A bin that spans zero covers every tiny magnitude:
there x is coded as exponent (below the bin's largest, with a per layer and kind table), sign
and mantissa (`wide`). Whatever falls outside (fp16 rounding of a zero point, a NaN) is an
escape carrying its raw bits. The decoder recomputes the same intervals and gets x bit for bit.

Per layer the encoder also tries plain lossless coding (zstd of the byte planes) and keeps
whichever is smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from .entropy import Grouping, SymbolReader, SymbolWriter
from .stream import StreamError


@dataclass(frozen=True)
class FloatFormat:
    dtype: torch.dtype
    int_dtype: torch.dtype
    bits: int
    mantissa: int
    margin: int
    """Ordered-integer slack around a bin: float32 rounding in quantization."""


FORMATS = {
    "bfloat16": FloatFormat(torch.bfloat16, torch.int16, 16, 7, 1),
    "float16": FloatFormat(torch.float16, torch.int16, 16, 10, 1),
    "float32": FloatFormat(torch.float32, torch.int32, 32, 23, 4),
}
NARROW_LIMIT = 1 << 22
"""Largest interval coded as an offset (constriction's uniform sizes stay below 2**24)."""
EXP_SYMBOLS = 32
"""Exponents below the bin's largest, 0..30; 31 is the escape."""
ESCAPE = EXP_SYMBOLS - 1


def float_format(dtype: torch.dtype | str) -> FloatFormat:
    name = str(dtype).removeprefix("torch.")
    if name not in FORMATS:
        raise ValueError(f"the KV codec takes {', '.join(FORMATS)}, not {name}")
    return FORMATS[name]


def bit_patterns(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Unsigned bit patterns of x as int64."""
    mask = (1 << fmt.bits) - 1
    return x.contiguous().view(fmt.int_dtype).to(torch.int64) & mask


def from_patterns(u: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    signed = torch.where(u >= 1 << (fmt.bits - 1), u - (1 << fmt.bits), u)
    return signed.to(fmt.int_dtype).view(fmt.dtype)


def ordered(u: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Bit patterns -> integers in the floats' order (-0 just below +0)."""
    sign = 1 << (fmt.bits - 1)
    return torch.where(u >= sign, -1 - (u - sign), u)


def unordered(o: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    return torch.where(o < 0, (-1 - o) + (1 << (fmt.bits - 1)), o)


@dataclass
class _Plan:
    """What the decoder can compute before reading a layer's residual symbols."""

    low: torch.Tensor
    """Ordered integer of each bin's lowest value (narrow elements)."""
    count: torch.Tensor
    narrow: torch.Tensor
    top_exponent: torch.Tensor
    """Exponent field of each wide bin's largest magnitude."""


def _plan(pred: torch.Tensor, half: torch.Tensor, fmt: FloatFormat) -> _Plan:
    lo = (pred - half).to(fmt.dtype)
    hi = (pred + half).to(fmt.dtype)
    low = ordered(bit_patterns(lo, fmt), fmt) - fmt.margin
    count = ordered(bit_patterns(hi, fmt), fmt) + fmt.margin - low + 1
    spans_zero = (lo.float() < 0) & (hi.float() > 0)
    narrow = ~spans_zero & (count <= NARROW_LIMIT)
    top = torch.maximum(lo.float().abs(), hi.float().abs()).to(fmt.dtype)
    top_exponent = bit_patterns(top, fmt) >> fmt.mantissa & ((1 << (fmt.bits - 1 - fmt.mantissa))
                                                            - 1)
    return _Plan(low, count, narrow, top_exponent)


def _raw(writer: SymbolWriter, u: torch.Tensor, fmt: FloatFormat) -> None:
    for shift in range(0, fmt.bits, 16):
        digits = ((u >> shift) & 0xFFFF).numpy()
        writer.uniform(digits, np.full(digits.size, 1 << 16))


def _read_raw(reader: SymbolReader, n: int, fmt: FloatFormat) -> torch.Tensor:
    u = torch.zeros(n, dtype=torch.int64)
    for shift in range(0, fmt.bits, 16):
        u |= torch.from_numpy(reader.uniform(np.full(n, 1 << 16)).astype(np.int64)) << shift
    return u


def encode_residual(x: torch.Tensor, pred: torch.Tensor, half: torch.Tensor,
                    fmt: FloatFormat) -> bytes:
    """x (flat, in fmt's dtype) given the bins (pred, half: float32, same length)."""
    plan = _plan(pred, half, fmt)
    u = bit_patterns(x, fmt)
    offset = ordered(u, fmt) - plan.low
    narrow = plan.narrow
    inside = narrow & (offset >= 0) & (offset < plan.count)
    writer = SymbolWriter()
    # narrow: the offset, or `count` for an escape
    n_off = torch.where(inside, offset, plan.count)[narrow]
    writer.uniform(n_off.numpy(), (plan.count[narrow] + 1).numpy())
    # wide: exponent below the top (table), then sign and mantissa
    wide = ~narrow
    exp_bits = fmt.bits - 1 - fmt.mantissa
    exponent = u >> fmt.mantissa & ((1 << exp_bits) - 1)
    below = plan.top_exponent - exponent
    ok = wide & (exponent > 0) & (below >= 0) & (below < ESCAPE)
    symbols = torch.where(ok, below, torch.full_like(below, ESCAPE))[wide].numpy()
    table = writer.grouped(symbols, Grouping.single(symbols.size), EXP_SYMBOLS)
    signs = (u[ok] >> (fmt.bits - 1)).numpy()
    writer.uniform(signs, np.full(signs.size, 2))
    mantissas = (u[ok] & ((1 << fmt.mantissa) - 1)).numpy()
    writer.uniform(mantissas, np.full(mantissas.size, 1 << fmt.mantissa))
    _raw(writer, u[(narrow & ~inside) | (wide & ~ok)], fmt)
    return table.tobytes() + writer.finish()


def decode_residual(data: memoryview, pred: torch.Tensor, half: torch.Tensor,
                    fmt: FloatFormat) -> torch.Tensor:
    """Inverse of `encode_residual`."""
    plan = _plan(pred, half, fmt)
    table = np.frombuffer(data[:EXP_SYMBOLS], dtype=np.uint8).reshape(1, EXP_SYMBOLS)
    reader = SymbolReader(data[EXP_SYMBOLS:])
    narrow = plan.narrow
    n = narrow.numel()
    o = torch.zeros(n, dtype=torch.int64)
    n_count = plan.count[narrow]
    n_off = torch.from_numpy(reader.uniform((n_count + 1).numpy()).astype(np.int64))
    n_inside = n_off < n_count
    o[narrow] = plan.low[narrow] + n_off
    u = unordered(o, fmt)
    wide = ~narrow
    symbols = torch.from_numpy(reader.grouped(Grouping.single(int(wide.sum())),
                                              table).astype(np.int64))
    w_ok = symbols < ESCAPE
    ok = torch.zeros(n, dtype=torch.bool)
    ok[wide] = w_ok
    count = int(w_ok.sum())
    signs = torch.from_numpy(reader.uniform(np.full(count, 2)).astype(np.int64))
    mantissas = torch.from_numpy(reader.uniform(np.full(count, 1 << fmt.mantissa)).astype(
        np.int64))
    exponent = plan.top_exponent[ok] - symbols[w_ok]
    u[ok] = signs << (fmt.bits - 1) | exponent << fmt.mantissa | mantissas
    escaped = torch.zeros(n, dtype=torch.bool)
    escaped[narrow] = ~n_inside
    escaped |= wide & ~ok
    u[escaped] = _read_raw(reader, int(escaped.sum()), fmt)
    return from_patterns(u, fmt)


def encode_planes(x: torch.Tensor, level: int) -> bytes:
    """Plain lossless coding: zstd of the byte planes of x (all first bytes, then seconds...)."""
    raw = x.contiguous().view(torch.uint8).reshape(-1, x.element_size()).T.contiguous()
    return zstandard.ZstdCompressor(level=level).compress(raw.numpy().tobytes())


def decode_planes(data: memoryview, n: int, fmt: FloatFormat) -> torch.Tensor:
    width = fmt.bits // 8
    try:
        raw = zstandard.ZstdDecompressor().decompress(bytes(data), max_output_size=n * width)
    except zstandard.ZstdError as e:
        raise StreamError(f"KV stream byte planes unreadable: {e}") from None
    if len(raw) != n * width:
        raise StreamError("KV stream byte planes have the wrong length")
    planes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(width, n)
    return planes.T.contiguous().view(fmt.dtype).reshape(n)
