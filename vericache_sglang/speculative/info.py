"""The `SpecInput` types of a VeriCache round, as SGLang keeps each algorithm's in `*_info.py`.

`VeriCacheDraftInput` is the state carried from one round to the next (each request's last
emitted token, whose KV is not written yet); `VeriCacheVerifyInput` describes one TARGET_VERIFY
forward (a chain of `draft_token_num` tokens per request). A chain needs no mask: each token
sees the committed prefix and the chain before it, which is what SGLang's attention backends
compute for a verify without `custom_mask` (Triton's extend kernel, FlashInfer's causal plan,
FA3's causal varlen kernel: the latter two align each chain to the end of its keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch
from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
from sglang.srt.mem_cache.kv_loc_plan import IdSpaceKind, KVLocPlan
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout
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

    @cached_property
    def ragged_verify_layout(self) -> RaggedVerifyLayout:
        """SGLang's per-request verify geometry, here `draft_token_num` for every request.

        FA3 sizes a verify by this layout where there is one, else by the server's fixed
        `speculative_num_draft_tokens` (the longest round, which a round's width is not).
        Built on first read, so only a backend that reads it pays for it."""
        batch = self.positions.numel() // self.draft_token_num
        return RaggedVerifyLayout.from_verify_lens(
            verify_lens_cpu=[self.draft_token_num] * batch, device=self.positions.device,
            grid=[self.positions.numel()])

    def generate_attn_arg_prefill(
        self, *, req_pool_indices: torch.Tensor, paged_kernel_lens: torch.Tensor,
        paged_kernel_lens_sum: int, translator: KVIndexTranslator, plan: KVLocPlan,
        kind: IdSpaceKind = IdSpaceKind.FULL,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        """FlashInfer's verify plan: each request's committed rows and its chain's, read in
        place by index (`kv_indices`, CSR by `kv_indptr`), `draft_token_num` queries each, no
        mask (FlashInfer's causal plan aligns the chain to the end of its rows)."""
        width, batch = self.draft_token_num, req_pool_indices.numel()
        device = req_pool_indices.device
        kv_lens = paged_kernel_lens + width
        kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        kv_indptr[1:] = torch.cumsum(kv_lens, dim=0)
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * width
        kv_indices = torch.empty(paged_kernel_lens_sum + width * batch, dtype=torch.int32,
                                 device=device)
        translator.pack_read_stream(plan, req_pool_indices=req_pool_indices, seq_lens=kv_lens,
                                    indptr=kv_indptr, out=kv_indices, kind=kind)
        return kv_indices, kv_indptr, qo_indptr, None
