"""SnapKV (Li et al., 2024): keep what the end of the prompt attends to.

The attention of the last `window` prompt queries, summed over those queries and over the query
heads of each GQA group, is pooled along the tokens (so neighbours of a hit survive with it);
each KV head keeps its top tokens plus the window itself. Decoded tokens are all kept, as in the
paper, which compresses the prompt once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .dropper import TokenDropper
from .params import param
from .registry import register_compressor


@register_compressor("snapkv")
@dataclass(frozen=True)
class SnapKV(TokenDropper):
    """Top tokens by pooled observation-window attention, per KV head, plus the window."""

    ratio: float = param(0.25, gt=0.0, le=1.0)
    """Kept fraction of the prompt (never fewer than `window` tokens)."""
    window: int = param(32, ge=1)
    """Last prompt tokens whose queries score the rest; they are always kept."""
    kernel: int = param(7, ge=1, le=255)
    """Pooling width in tokens (odd, centred)."""
    pooling: str = param("max", choices=("max", "avg"))
    """Pooling of the scores along the tokens."""

    needs_scores: ClassVar[bool] = True
    evicts_on_append: ClassVar[bool] = False

    def check(self) -> None:
        if self.kernel % 2 == 0:
            raise self.invalid("kernel", f"= {self.kernel} must be odd (a centred window)")

    def score(
        self, keys: torch.Tensor, values: torch.Tensor, acc: torch.Tensor | None
    ) -> torch.Tensor:
        assert acc is not None, "compress checks that scores were given"
        prefix = acc[:, : max(acc.shape[1] - self.window, 0)]
        if prefix.shape[1] == 0:
            return acc
        pad = self.kernel // 2
        if self.pooling == "max":
            pooled = F.max_pool1d(prefix[:, None], self.kernel, stride=1, padding=pad)
        else:
            pooled = F.avg_pool1d(prefix[:, None], self.kernel, stride=1, padding=pad,
                                  count_include_pad=False)
        return torch.cat([pooled[:, 0], acc[:, prefix.shape[1]:]], dim=1)

    def score_window(self) -> int:
        return self.window

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, self.window

    def min_keep(self) -> int:
        return self.window
