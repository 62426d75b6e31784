"""Composition: drop tokens, then quantize the kept ones ('snapkv:ratio=0.5+kivi:bits=4').

Dropping happens once, at `compress` (the prompt), as in SnapKV and kvpress; appended tokens go
to the quantizer (residual window, then groups) and are not evicted, so the cache grows by the
decoded tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import CompressedKV, Compressor, tensor_bytes
from .dropper import TokenDropper
from .params import CompressorSpecError


@dataclass(eq=False)
class ComposedKV(CompressedKV):
    """The quantized kept slots and their positions (the dropper's index array)."""

    inner: CompressedKV
    """The quantizer's block over the kept slots."""
    slot_positions: torch.Tensor
    """[H, n] int32 original positions of each head's slots."""

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def num_kv_heads(self) -> int:
        return self.inner.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.inner.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def nbytes(self) -> int:
        return self.inner.nbytes() + tensor_bytes(self.slot_positions)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.dense()

    def positions(self) -> torch.Tensor:
        return self.slot_positions.long()

    def attend_lse(self, q: torch.Tensor, sm_scale: float | None = None,
                   logit_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.attend_lse(q, sm_scale, logit_cap)


@dataclass(frozen=True)
class ComposedCompressor(Compressor):
    """A dropper followed by a quantizer; built by `parse_compressor_spec` from 'a+b'."""

    dropper: TokenDropper
    """Selects the kept tokens."""
    quantizer: Compressor
    """Compresses the kept tokens' K/V."""

    name = "composed"
    block_type: ClassVar[type[CompressedKV]] = ComposedKV

    def check(self) -> None:
        if not isinstance(self.dropper, TokenDropper) or isinstance(self.quantizer, TokenDropper):
            raise CompressorSpecError(
                f"composition '{self.spec()}' must be a dropper then a quantizer, e.g. "
                "'snapkv:ratio=0.5+kivi:bits=4'"
            )

    @property
    def needs_scores(self) -> bool:  # type: ignore[override]
        return self.dropper.needs_scores

    def score_window(self) -> int | None:
        return self.dropper.score_window()

    def spec(self) -> str:
        return f"{self.dropper.spec()}+{self.quantizer.spec()}"

    def compress(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scores: torch.Tensor | None = None,
        *,
        layer: int = 0,
    ) -> ComposedKV:
        kept = self.dropper.compress(keys, values, positions, scores, layer=layer)
        kept_keys, kept_values = kept.dense()
        slots = torch.arange(len(kept), device=keys.device)
        inner = self.quantizer.compress(kept_keys, kept_values, slots, layer=layer)
        return ComposedKV(inner, kept.positions().to(torch.int32))

    def _append(
        self,
        block: CompressedKV,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scores: torch.Tensor | None,
    ) -> None:
        self.quantizer.append(block.inner, keys, values, positions)
        new_positions = positions.to(torch.int32)[None].expand(block.num_kv_heads, -1)
        block.slot_positions = torch.cat([block.slot_positions, new_positions], dim=1)
