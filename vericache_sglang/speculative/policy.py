"""Adaptive draft length: how many tokens to draft on the compressed tier before verifying.

Each verification round costs one full-KV forward over k + 1 tokens plus k compressed-tier
draft steps, and emits (accepted + 1) tokens. Drafting past the first rejection is wasted
work, drafting too little wastes verification rounds. The policy keeps one length per request:

* every draft accepted: the length grows by half (at least +1), up to the maximum;
* otherwise it moves halfway towards (accepted + 1), the length that round would have needed
  to lose nothing, never below the minimum.

A batch drafts the longest length among its requests (a verify forward has one width).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftLengthPolicy:
    """Per-request adaptive draft length within [minimum, maximum]."""

    initial: int
    minimum: int
    maximum: int
    adaptive: bool = True
    _lengths: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.initial <= self.maximum:
            raise ValueError(
                f"need 1 <= minimum <= initial <= maximum, got {self.minimum}, {self.initial}, "
                f"{self.maximum}"
            )

    def length(self, rid: str) -> int:
        """Draft length for the request's next round."""
        return self._lengths.get(rid, self.initial)

    def batch_length(self, rids: list[str]) -> int:
        """Draft length for a batch: the longest of its requests'."""
        return max((self.length(r) for r in rids), default=self.initial)

    def update(self, rid: str, drafted: int, accepted: int) -> int:
        """Record a round's outcome (`accepted` of `drafted` drafts); return the next length."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} outside [0, {drafted}]")
        current = self.length(rid)
        if not self.adaptive:
            return current
        if accepted >= drafted:
            nxt = min(self.maximum, max(current, drafted) + max(1, drafted // 2))
        else:
            nxt = max(self.minimum, (current + accepted + 2) // 2)
        self._lengths[rid] = nxt
        return nxt

    def forget(self, rid: str) -> None:
        """Drop a finished request's state."""
        self._lengths.pop(rid, None)
