"""KIVI with bits allocated by layer and by token age (CacheGen, KIVI).

Early layers get `bits_early`, the rest `bits_late` (errors in early layers propagate through the
whole network); the `recent` most recently quantized tokens get max(recent_bits, layer bits),
since recent tokens draw most of the attention. As tokens age out of the recent tier they are
requantized to the layer's bits. The newest `residual` tokens stay at full precision.
"""

from __future__ import annotations

from dataclasses import dataclass

from vericache_kernels import SUPPORTED_BITS

from .params import param
from .quant import KiviQuantizer, QuantPlan
from .registry import register_compressor


@register_compressor("kivi_mixed")
@dataclass(frozen=True)
class KiviMixed(KiviQuantizer):
    """Layer-wise and age-wise bit allocation on the KIVI layout."""

    bits_early: int = param(4, choices=SUPPORTED_BITS)
    """Bits of old tokens in layers [0, early_layers)."""
    bits_late: int = param(2, choices=SUPPORTED_BITS)
    """Bits of old tokens in the remaining layers."""
    early_layers: int = param(4, ge=0)
    """How many of the first layers count as early."""
    recent_bits: int = param(4, choices=SUPPORTED_BITS)
    """Bits of the `recent` newest quantized tokens (never fewer than the layer's bits)."""
    recent: int = param(256, ge=0)
    """Newest quantized tokens kept at `recent_bits`; a multiple of `group`."""
    group: int = param(32, ge=4, le=4096, multiple_of=4)
    """Tokens per key group (keys share a scale per channel within it); also the value group."""
    residual: int = param(128, ge=0)
    """Newest tokens kept at full precision before their groups are quantized."""

    def check(self) -> None:
        if self.recent % self.group:
            raise self.invalid("recent", f"= {self.recent} must be a multiple of group "
                               f"(= {self.group})")

    def plan(self, layer: int) -> QuantPlan:
        bits = self.bits_early if layer < self.early_layers else self.bits_late
        return QuantPlan(bits, max(self.recent_bits, bits), self.recent, self.group,
                         self.residual)
