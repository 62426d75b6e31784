"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention plus the newest tokens.

Each KV head keeps the slots with the largest attention accumulated over all queries seen (its
GQA group's query heads summed) and a recent window. On append, the new queries' attention is
added to the accumulator (when given) and the lowest slots are evicted to stay within budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import round_half_up
from .dropper import TokenDropper
from .params import param
from .registry import register_compressor


@register_compressor("h2o")
@dataclass(frozen=True)
class H2O(TokenDropper):
    """Heavy hitters plus a recent window, `ratio` of the tokens seen in all."""

    ratio: float = param(0.2, gt=0.0, le=1.0)
    """Kept fraction of the tokens seen."""
    recent: float = param(0.5, ge=0.0, le=1.0)
    """Fraction of the kept slots reserved for the newest tokens; the rest are heavy hitters."""

    needs_scores: ClassVar[bool] = True
    keeps_scores: ClassVar[bool] = True

    def score(
        self, keys: torch.Tensor, values: torch.Tensor, acc: torch.Tensor | None
    ) -> torch.Tensor:
        assert acc is not None, "compress checks that scores were given; blocks keep acc"
        return acc

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, round_half_up(self.recent * budget)
