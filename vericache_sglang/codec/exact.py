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
from .stream import StreamForeign


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


def _signed(x: torch.Tensor, fmt: FloatFormat) -> np.ndarray:
    """Bit patterns of x as signed int64 (numpy: cheaper than torch for these masked steps)."""
    return x.contiguous().view(fmt.int_dtype).numpy().astype(np.int64)


def _flip(s: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Signed bit patterns <-> integers in the floats' order (-0 just below +0): a negative
    float's magnitude bits are flipped. Its own inverse."""
    return s ^ ((s >> 63) & ((1 << (fmt.bits - 1)) - 1))


def _exponent(u: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    return u >> fmt.mantissa & ((1 << (fmt.bits - 1 - fmt.mantissa)) - 1)


def floats(u: np.ndarray, fmt: FloatFormat) -> torch.Tensor:
    """Unsigned bit patterns (any integer dtype) -> floats of fmt's dtype."""
    unsigned = u.astype(f"u{fmt.bits // 8}", copy=False)
    return torch.from_numpy(unsigned.view(f"i{fmt.bits // 8}")).view(fmt.dtype)


@dataclass
class Plan:
    """What the decoder can compute before reading a layer's residual symbols."""

    low: np.ndarray
    """Ordered integer of each bin's lowest value (narrow elements)."""
    count: np.ndarray
    narrow: np.ndarray
    top_exponent: np.ndarray
    """Exponent field of each wide bin's largest magnitude."""


def bin_plan(pred: torch.Tensor, half: torch.Tensor, fmt: FloatFormat) -> Plan:
    """What both sides derive from the bins (pred, half: float32, flat)."""
    lo = (pred - half).to(fmt.dtype)
    hi = (pred + half).to(fmt.dtype)
    s_lo, s_hi = _signed(lo, fmt), _signed(hi, fmt)
    low = _flip(s_lo, fmt) - fmt.margin
    count = _flip(s_hi, fmt) + fmt.margin - low + 1
    narrow = ~((lo < 0) & (hi > 0)).numpy() & (count <= NARROW_LIMIT)
    # the larger magnitude has the larger exponent field (NaN's being the largest)
    mask = (1 << fmt.bits) - 1
    top_exponent = np.maximum(_exponent(s_lo & mask, fmt), _exponent(s_hi & mask, fmt))
    return Plan(low, count, narrow, top_exponent)


def _raw(writer: SymbolWriter, u: np.ndarray, fmt: FloatFormat) -> None:
    for shift in range(0, fmt.bits, 16):
        digits = (u >> shift) & 0xFFFF
        writer.uniform(digits, np.full(digits.size, 1 << 16))


def _read_raw(reader: SymbolReader, n: int, fmt: FloatFormat) -> np.ndarray:
    u = np.zeros(n, dtype=np.int64)
    for shift in range(0, fmt.bits, 16):
        u |= reader.uniform(np.full(n, 1 << 16)).astype(np.int64) << shift
    return u


def encode_residual(x: torch.Tensor, pred: torch.Tensor, half: torch.Tensor,
                    fmt: FloatFormat) -> bytes:
    """x (flat, in fmt's dtype) given the bins (pred, half: float32, same length)."""
    plan = bin_plan(pred, half, fmt)
    s = _signed(x, fmt)
    u = s & ((1 << fmt.bits) - 1)
    offset = _flip(s, fmt) - plan.low
    narrow = plan.narrow
    inside = narrow & (offset >= 0) & (offset < plan.count)
    writer = SymbolWriter()
    # narrow: the offset, or `count` for an escape
    writer.uniform(np.where(inside, offset, plan.count)[narrow], plan.count[narrow] + 1)
    # wide: exponent below the top (table), then sign and mantissa
    wide = ~narrow
    exponent = _exponent(u, fmt)
    below = plan.top_exponent - exponent
    ok = wide & (exponent > 0) & (below >= 0) & (below < ESCAPE)
    symbols = np.where(ok, below, ESCAPE)[wide]
    table = writer.grouped(symbols, Grouping.single(symbols.size), EXP_SYMBOLS)
    u_ok = u[ok]
    writer.uniform(u_ok >> (fmt.bits - 1), np.full(u_ok.size, 2))
    writer.uniform(u_ok & ((1 << fmt.mantissa) - 1), np.full(u_ok.size, 1 << fmt.mantissa))
    _raw(writer, u[(narrow & ~inside) | (wide & ~ok)], fmt)
    return table.tobytes() + writer.finish()


def decode_residual(data: memoryview, plan: Plan, fmt: FloatFormat) -> np.ndarray:
    """Inverse of `encode_residual`, given the bins' plan: x's unsigned bit patterns (int64)."""
    table = np.frombuffer(data[:EXP_SYMBOLS], dtype=np.uint8).reshape(1, EXP_SYMBOLS)
    reader = SymbolReader(data[EXP_SYMBOLS:])
    narrow = np.flatnonzero(plan.narrow)
    wide = np.flatnonzero(~plan.narrow)
    u = np.empty(plan.narrow.size, dtype=np.int64)
    n_count = plan.count[narrow]
    n_off = reader.uniform(n_count + 1)
    u[narrow] = _flip(plan.low[narrow] + n_off, fmt) & ((1 << fmt.bits) - 1)
    symbols = reader.grouped(Grouping.single(wide.size), table).astype(np.int64)
    w_ok = symbols < ESCAPE
    ok = wide[w_ok]
    signs = reader.uniform(np.full(ok.size, 2)).astype(np.int64)
    mantissas = reader.uniform(np.full(ok.size, 1 << fmt.mantissa)).astype(np.int64)
    exponent = plan.top_exponent[ok] - symbols[w_ok]
    u[ok] = signs << (fmt.bits - 1) | exponent << fmt.mantissa | mantissas
    escaped = np.zeros(plan.narrow.size, dtype=bool)
    escaped[narrow[n_off >= n_count]] = True
    escaped[wide[~w_ok]] = True
    u[escaped] = _read_raw(reader, int(escaped.sum()), fmt)
    return u


def encode_planes(x: torch.Tensor, level: int) -> bytes:
    """Plain lossless coding: zstd of the byte planes of x (all first bytes, then seconds...)."""
    raw = x.contiguous().view(torch.uint8).reshape(-1, x.element_size()).T.contiguous()
    return zstandard.ZstdCompressor(level=level).compress(raw.numpy().tobytes())


def decode_planes(data: memoryview, n: int, fmt: FloatFormat) -> torch.Tensor:
    width = fmt.bits // 8
    try:
        raw = zstandard.ZstdDecompressor().decompress(bytes(data), max_output_size=n * width)
    except zstandard.ZstdError as e:
        raise StreamForeign(f"KV stream byte planes unreadable: {e}") from None
    if len(raw) != n * width:
        raise StreamForeign("KV stream byte planes have the wrong length")
    planes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(width, n)
    return planes.T.contiguous().view(fmt.dtype).reshape(n)
