"""Verification attention: SGLang's torch_native backend plus a causal TARGET_VERIFY forward.

The root token and the k drafts of each request extend its committed prefix over the full KV,
causally (a draft chain needs no tree mask), writing their K/V into the pool slots reserved
beyond the committed length. Only those k + 1 queries are computed, so a round reads the
committed KV once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc


class VerifyAttnBackend(TorchNativeAttnBackend):
    """torch_native attention that also runs TARGET_VERIFY forwards over the full KV.

    Each request extends its committed prefix (`seq_lens`) by the verify width
    (`spec_info.draft_token_num`), causally: only those `width` queries are computed, over the
    prefix plus themselves. (torch_native's own extend pads the queries to the whole sequence
    and runs full causal attention, quadratic in the context: a prefill's way, not a verify's.)
    """

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        lens = forward_batch.seq_lens_cpu
        lens = (forward_batch.seq_lens if lens is None else lens).tolist()
        o = self._run_sdpa_verify(
            q, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices.tolist(), lens,
            forward_batch.spec_info.draft_token_num, layer,
        )
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    @staticmethod
    def _run_sdpa_verify(q, k_cache, v_cache, req_to_token, req_pool_indices: list[int],
                         prefix_lens: list[int], width: int, layer) -> torch.Tensor:
        """Attention of each request's `width` chain queries over its prefix plus the chain,
        reading request i's keys at `k_cache[req_to_token[req_pool_indices[i]]]` (SGLang's
        `_run_sdpa_forward_*` convention): o [tokens, Hq, Dv]."""
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        offsets = torch.arange(width, device=q.device)
        for i, (slot, prefix) in enumerate(zip(req_pool_indices, prefix_lens, strict=True)):
            rows = req_to_token[slot, : prefix + width]
            keys, values = k_cache[rows].movedim(0, 1), v_cache[rows].movedim(0, 1)
            span = slice(i * width, (i + 1) * width)
            query = q[span].movedim(0, 1)  # [Hq, width, D]
            if keys.dtype != query.dtype:
                keys, values = keys.to(query.dtype), values.to(query.dtype)
            # Query j sits at position prefix + j and sees keys 0..prefix + j.
            visible = (torch.arange(prefix + width, device=q.device)[None]
                       <= prefix + offsets[:, None])
            o[span] = F.scaled_dot_product_attention(
                query[None], keys[None], values[None], attn_mask=visible[None, None],
                scale=layer.scaling, enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            )[0].movedim(0, 1)
        return o
