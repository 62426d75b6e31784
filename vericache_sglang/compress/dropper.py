"""Token dropping mechanics shared by every dropper: budget, score -> top-k per KV head -> gather.

A dropper implements only `score` (importance of each slot per KV head) and optionally
`protected` (slots always kept, e.g. sinks or the observation window). Kept tokens keep their
K/V exactly and their original positions; each KV head keeps its own subset, the same count.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

import vericache_kernels as kernels

from .base import (
    CompressedKV,
    Compressor,
    check_kv,
    round_half_up,
    tensor_bytes,
)


def group_scores(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[Hq, W, n] attention probabilities -> [H, n]: summed over the W queries and over the
    query heads that share each KV head (GQA)."""
    q_heads, _, n = scores.shape
    return scores.float().sum(1).reshape(kv_heads, q_heads // kv_heads, n).sum(1)


def _gather_slots(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x [n, H, D], keep [H, k] slot indices per head -> [k, H, D]."""
    return x.gather(0, keep.T[:, :, None].expand(-1, -1, x.shape[2]))


@dataclass(eq=False)
class DroppedKV(CompressedKV):
    """The kept slots of a dropper: exact K/V, their positions and (H2O) accumulated attention."""

    keys: torch.Tensor
    """[n, H, D]: slot i of head h is the token at slot_positions[h, i]."""
    values: torch.Tensor
    """[n, H, D], same slots as keys."""
    slot_positions: torch.Tensor
    """[H, n] int32 original positions, ascending per head: the index array."""
    acc: torch.Tensor | None
    """[H, n] float32 attention accumulated per slot, for methods that evict by it."""
    seen: int
    """Tokens given so far (compressed plus appended): the budget is a ratio of this."""

    def __len__(self) -> int:
        return self.keys.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values, self.slot_positions, self.acc)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def positions(self) -> torch.Tensor:
        return self.slot_positions.long()

    def attend_lse(self, q: torch.Tensor, sm_scale: float | None = None,
                   logit_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.tensor([len(self)], device=q.device)
        scale = self.head_dim**-0.5 if sm_scale is None else sm_scale
        out, lse = kernels.decode_attention(
            q[None], None, self.keys[None], self.values[None], lengths, scale,
            logit_cap=logit_cap)
        return out[0], lse[0]

    def select(self, keep: torch.Tensor) -> None:
        """Keep slots `keep` [H, k] (ascending per head), copying them out."""
        self.keys = _gather_slots(self.keys, keep)
        self.values = _gather_slots(self.values, keep)
        self.slot_positions = self.slot_positions.gather(1, keep)
        if self.acc is not None:
            self.acc = self.acc.gather(1, keep)

    def extend(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               acc_update: torch.Tensor | None) -> None:
        """Add new tokens as slots of every head; add `acc_update` [H, len] to the accumulator."""
        heads = self.num_kv_heads
        self.keys = torch.cat([self.keys, keys])
        self.values = torch.cat([self.values, values])
        new_positions = positions.to(torch.int32)[None].expand(heads, -1)
        self.slot_positions = torch.cat([self.slot_positions, new_positions], dim=1)
        if self.acc is not None:
            self.acc = torch.cat([self.acc, self.acc.new_zeros(heads, keys.shape[0])], dim=1)
            if acc_update is not None:
                self.acc += acc_update
        self.seen += keys.shape[0]


class TokenDropper(Compressor):
    """Base of droppers. Subclasses declare a `ratio` field (kept fraction of the tokens seen)."""

    ratio: float
    block_type: ClassVar[type[CompressedKV]] = DroppedKV
    evicts_on_append: ClassVar[bool] = True
    """Whether `append` evicts back to the budget (False: decode tokens are all kept)."""
    keeps_scores: ClassVar[bool] = False
    """Whether blocks carry accumulated attention per slot (for eviction by score)."""

    @abstractmethod
    def score(
        self, keys: torch.Tensor, values: torch.Tensor, acc: torch.Tensor | None
    ) -> torch.Tensor:
        """Importance [H, n] of each slot (higher is kept); acc is `group_scores` of the scores
        given (compress) or the block's accumulator (append), None without scores."""

    def protected(self, budget: int) -> tuple[int, int]:
        """(first, last): how many of the oldest and newest slots are always kept."""
        return 0, 0

    def min_keep(self) -> int:
        """Lower bound on the budget, so that protected slots always fit."""
        return 0

    def budget(self, seen: int) -> int:
        """Slots kept after `seen` tokens: round(ratio * seen), at least 1 and `min_keep`."""
        if seen == 0:
            return 0
        return min(seen, max(1, round_half_up(self.ratio * seen), self.min_keep()))

    def _keep(self, block: DroppedKV, acc: torch.Tensor | None) -> torch.Tensor:
        n = len(block)
        budget = min(n, self.budget(block.seen))
        importance = self.score(block.keys, block.values, acc).float().clone()
        first, last = self.protected(budget)
        importance[:, :first] = float("inf")
        importance[:, max(n - last, 0):] = float("inf")
        return importance.topk(budget, dim=1).indices.sort(dim=1).values

    def compress(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scores: torch.Tensor | None = None,
        *,
        layer: int = 0,
    ) -> DroppedKV:
        check_kv(keys, values, positions, scores)
        if self.needs_scores and scores is None:
            raise ValueError(f"{self.spec()} selects tokens by attention: pass scores [Hq, W, T]")
        heads = keys.shape[1]
        acc = None if scores is None else group_scores(scores, heads)
        slots = positions.to(torch.int32)[None].expand(heads, -1)
        block = DroppedKV(keys, values, slots, acc if self.keeps_scores else None, keys.shape[0])
        block.select(self._keep(block, acc))
        return block

    def _append(
        self,
        block: CompressedKV,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scores: torch.Tensor | None,
    ) -> None:
        update = None if scores is None else group_scores(scores, block.num_kv_heads)
        block.extend(keys, values, positions, update)
        if self.evicts_on_append and len(block) > self.budget(block.seen):
            block.select(self._keep(block, block.acc))
