"""KIVI (Liu et al., 2024): asymmetric low-bit KV quantization with a full-precision window.

Keys are quantized per channel over groups of `group` tokens, values per token over groups of
gcd(group, head_dim) channels, each group with an fp16 scale and zero point; codes are packed
8 // bits per byte. The newest `residual`..`residual + group - 1` tokens stay at full precision.
"""

from __future__ import annotations

from dataclasses import dataclass

from vericache_kernels import SUPPORTED_BITS

from .params import param
from .quant import KiviQuantizer, QuantPlan
from .registry import register_compressor


@register_compressor("kivi")
@dataclass(frozen=True)
class Kivi(KiviQuantizer):
    """One bit width for every layer and token."""

    bits: int = param(4, choices=SUPPORTED_BITS)
    """Bits per quantized K/V element."""
    group: int = param(32, ge=4, le=4096, multiple_of=4)
    """Tokens per key group (keys share a scale per channel within it); also the value group."""
    residual: int = param(128, ge=0)
    """Newest tokens kept at full precision before their groups are quantized."""

    def plan(self, layer: int) -> QuantPlan:
        return QuantPlan(self.bits, self.bits, 0, self.group, self.residual)
