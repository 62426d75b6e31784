"""The `SpecInput` types of a VeriCache round, as SGLang keeps each algorithm's in `*_info.py`.

`VeriCacheDraftInput` is the state carried from one round to the next (each request's last
emitted token, whose KV is not written yet); `VeriCacheVerifyInput` describes one TARGET_VERIFY
forward (a chain of `draft_token_num` tokens per request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType


@dataclass
class VeriCacheDraftInput(SpecInput):
    """State carried between rounds: each request's last emitted token (no KV yet)."""

    bonus_tokens: torch.Tensor
    new_seq_lens: torch.Tensor

    # FutureMap compatibility (the overlap relay reads these Eagle-shaped fields).
    topk_p: ClassVar[torch.Tensor | None] = None
    topk_index: ClassVar[torch.Tensor | None] = None
    hidden_states: ClassVar[torch.Tensor | None] = None
    future_indices: torch.Tensor | None = None

    def __post_init__(self) -> None:
        super().__init__(SpecInputType.UNO_STATE)
        self.num_tokens_per_req = 1
        self.num_tokens_for_logprob_per_req = 1

    def filter_batch(self, new_indices: torch.Tensor, new_indices_cpu: Any = None) -> None:
        """Keep the rows of the requests that stay in the batch."""
        self.bonus_tokens = self.bonus_tokens[new_indices]
        self.new_seq_lens = self.new_seq_lens[new_indices]

    def merge_batch(self, other: VeriCacheDraftInput) -> None:
        """Append another batch's rows."""
        if not isinstance(other, VeriCacheDraftInput):
            raise TypeError(f"cannot merge VeriCacheDraftInput with {type(other).__name__}")
        self.bonus_tokens = torch.cat([self.bonus_tokens, other.bonus_tokens])
        self.new_seq_lens = torch.cat([self.new_seq_lens, other.new_seq_lens])


@dataclass
class VeriCacheVerifyInput(SpecInput):
    """Metadata of one TARGET_VERIFY forward: `draft_token_num` tokens per request (a chain)."""

    draft_token_num: int
    positions: torch.Tensor
    custom_mask: torch.Tensor | None = None
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL

    def __post_init__(self) -> None:
        super().__init__(SpecInputType.UNO_VERIFY)
        self.num_tokens_per_req = self.draft_token_num
        self.num_tokens_for_logprob_per_req = self.draft_token_num

    @property
    def tree_topk(self) -> int:
        return 1
