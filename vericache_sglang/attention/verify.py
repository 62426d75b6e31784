"""Verification attention: SGLang's torch_native backend plus a causal TARGET_VERIFY forward.

The root token and the k drafts of each request extend its committed prefix over the full KV,
causally (a draft chain needs no tree mask) and within each layer's sliding window, with its
logit softcap, writing their K/V into the pool slots reserved
beyond the committed length. Only those k + 1 queries are computed, so a round reads the
committed KV once, and every request of the batch in one attention call per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

import vericache_kernels as kernels
from vericache_sglang.attention.features import logit_cap, sliding_window, window_visible


@dataclass(frozen=True)
class VerifyPlan:
    """A TARGET_VERIFY forward's reads, built once per forward and shared by every layer."""

    rows: torch.Tensor
    """[B, T] full-pool rows of each request's prefix and chain, padded to the longest
    (T = longest prefix + width) with the request's first row, which is always written."""
    columns: torch.Tensor
    """[T] the key positions."""
    last: torch.Tensor
    """[B, width]: the position of chain query j of request b (prefix_b + j)."""
    width: int
    _visible: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
           prefix_lens: torch.Tensor, longest: int, width: int) -> VerifyPlan:
        """`prefix_lens` [B] on the device; `longest` their maximum, a host value (SGLang's
        `seq_lens_cpu`), which sizes the read."""
        device = req_to_token.device
        total = longest + width
        rows = req_to_token[req_pool_indices, :total].to(torch.int64)
        columns = torch.arange(total, device=device)
        last = prefix_lens.to(device)[:, None] + torch.arange(width, device=device)  # [B, width]
        # Past its own chain a request's row holds stale or unset slots: read its first row
        # there instead (finite, and masked out like any other padding).
        rows = torch.where(columns[None, :] < (last[:, -1:] + 1), rows, rows[:, :1])
        return cls(rows, columns, last, width)

    def visible(self, window: int | None) -> torch.Tensor:
        """[B, 1, width, T]: which keys chain query j of request b sees, causally and within
        the layer's sliding window (one mask per window size, shared by its layers)."""
        if window not in self._visible:
            self._visible[window] = window_visible(
                self.last[:, :, None], self.columns[None, None, :], window)[:, None]
        return self._visible[window]

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               layer) -> torch.Tensor:
        """q [B * width, Hq, D] -> o [B * width, Hq, Dv]: one masked attention over the batch,
        with the layer's window and softcap."""
        batch, total = self.rows.shape
        flat = self.rows.flatten()
        # index_select copies whole rows; advanced indexing goes element by element
        keys = k_cache.index_select(0, flat).view(batch, total, *k_cache.shape[1:])
        values = v_cache.index_select(0, flat).view(batch, total, *v_cache.shape[1:])
        query = q.view(batch, self.width, *q.shape[1:]).transpose(1, 2)  # [B, Hq, width, D]
        if keys.dtype != query.dtype:
            keys, values = keys.to(query.dtype), values.to(query.dtype)
        o = kernels.dense_attention(query, keys.transpose(1, 2), values.transpose(1, 2),
                                    self.visible(sliding_window(layer)), layer.scaling,
                                    logit_cap(layer))
        return o.transpose(1, 2).reshape(batch * self.width, layer.tp_q_head_num, -1)


class VerifyAttnBackend(TorchNativeAttnBackend):
    """torch_native attention that also runs TARGET_VERIFY forwards over the full KV.

    Each request extends its committed prefix (`seq_lens`) by the verify width
    (`spec_info.draft_token_num`), causally: only those `width` queries are computed, over the
    prefix plus themselves, for the whole batch in one masked SDPA per layer. (torch_native's
    own extend pads the queries to the whole sequence and runs full causal attention per
    request, quadratic in the context: a prefill's way, not a verify's.)
    """

    _plan: VerifyPlan | None = None

    def init_forward_metadata(self, forward_batch) -> None:
        super().init_forward_metadata(forward_batch)
        self._plan = (self._verify_plan(forward_batch)
                      if forward_batch.forward_mode.is_target_verify() else None)

    def _verify_plan(self, forward_batch) -> VerifyPlan | None:
        """The verify forward's reads from the KV pool."""
        lens_cpu = forward_batch.seq_lens_cpu
        longest = int((forward_batch.seq_lens if lens_cpu is None else lens_cpu).max())
        return VerifyPlan.of(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                             forward_batch.seq_lens, longest,
                             forward_batch.spec_info.draft_token_num)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if self._plan is None:
            raise RuntimeError("TARGET_VERIFY forward without init_forward_metadata")
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        o = self._plan.attend(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id), layer,
        )
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
