"""StreamingLLM (Xiao et al., 2024): attention sinks plus a window of the most recent tokens.

The first `sink` tokens absorb attention mass the softmax must put somewhere; keeping them with
the newest tokens keeps a model fluent on a bounded cache. Needs no attention scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dropper import TokenDropper
from .params import param
from .registry import register_compressor


@register_compressor("streaming")
@dataclass(frozen=True)
class StreamingLLM(TokenDropper):
    """Keep `sink` first tokens and the newest ones, `ratio` of the tokens seen in all."""

    sink: int = param(4, ge=0)
    """Oldest tokens always kept (attention sinks)."""
    ratio: float = param(0.25, gt=0.0, le=1.0)
    """Kept fraction of the tokens seen (never fewer than `sink`)."""

    def score(
        self, keys: torch.Tensor, values: torch.Tensor, acc: torch.Tensor | None
    ) -> torch.Tensor:
        # Slots are in position order, so recency is the slot index.
        recency = torch.arange(keys.shape[0], dtype=torch.float32, device=keys.device)
        return recency[None].expand(keys.shape[1], -1)

    def protected(self, budget: int) -> tuple[int, int]:
        return self.sink, 0

    def min_keep(self) -> int:
        return self.sink
