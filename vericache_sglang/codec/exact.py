"""The exact part: the KV's own bits, coded given the compressed pool's level.

Each element x is known by the decoder to lie near its pool bin (code * scale + zero, +- scale
/ 2, float32 from the stored codes, scales and zeros). On the integers that order the dtype's
bit patterns, that bin is an interval of a few dozen values for most elements: x's offset in it
is coded uniformly (`narrow`). A bin that spans zero covers every tiny magnitude: there x is
coded as exponent (below the bin's largest, with a per-layer table), sign and mantissa (`wide`).
Whatever falls outside (fp16 rounding of a zero point, a NaN) is an escape carrying its raw
bits. The decoder recomputes the same intervals and gets x bit for bit: the element model is
`vericache_kernels.rans_ref.plan`, coded in rANS lanes (`vericache_kernels.rans_cpu`).

Per layer the encoder also tries plain lossless coding (zstd of the byte planes) and keeps
whichever is smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from vericache_kernels import rans_ref

from .stream import StreamForeign


@dataclass(frozen=True)
class FloatFormat:
    dtype: torch.dtype
    int_dtype: torch.dtype
    bits: int
    mantissa: int
    margin: int
    """Ordered-integer slack around a bin: float32 rounding in quantization."""
    kind: int
    """`rans_ref`'s name of the format (BF16, FP16, FP32)."""

    @property
    def model(self) -> tuple[int, int, int, int]:
        """What the lane coders take: (kind, bits, mantissa, margin)."""
        return self.kind, self.bits, self.mantissa, self.margin


FORMATS = {name: FloatFormat(getattr(torch, name), torch.int32 if bits == 32 else torch.int16,
                             bits, mantissa, margin, kind)
           for name, (kind, bits, mantissa, margin) in rans_ref.FORMATS.items()}


def float_format(dtype: torch.dtype | str) -> FloatFormat:
    name = str(dtype).removeprefix("torch.")
    if name not in FORMATS:
        raise ValueError(f"the KV codec takes {', '.join(FORMATS)}, not {name}")
    return FORMATS[name]


def unsigned(x: torch.Tensor, fmt: FloatFormat) -> np.ndarray:
    """Bit patterns of x as non-negative int64 (what the lane coders take)."""
    return x.contiguous().view(fmt.int_dtype).numpy().astype(np.int64) & ((1 << fmt.bits) - 1)


def floats(u: np.ndarray, fmt: FloatFormat) -> torch.Tensor:
    """Unsigned bit patterns (any integer dtype) -> floats of fmt's dtype."""
    unsigned_ = u.astype(f"u{fmt.bits // 8}", copy=False)
    return torch.from_numpy(unsigned_.view(f"i{fmt.bits // 8}")).view(fmt.dtype)


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
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(width, n)
    # each plane shifted into its byte of a word (half the time of writing byte columns, and
    # torch's transpose took 30 times longer); plane i is byte i of a little-endian word
    word = np.dtype(f"<u{width}")
    out = planes[0].astype(word)
    for plane in range(1, width):
        out |= planes[plane].astype(word) << (8 * plane)
    return torch.from_numpy(out.view(f"<i{width}")).view(fmt.dtype)
