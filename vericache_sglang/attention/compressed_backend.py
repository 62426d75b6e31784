"""SGLang attention that decodes over each request's compressed tier (the drafting read path).

Extends SGLang's `torch_native` backend, the CPU one: prefill (extend) runs unchanged over the
full KV and, for compressors that select tokens by attention, records the prompt's observation
scores; decode reads the request's block from `CompressedTier` (dequantize on read for
quantized tiers, only the kept tokens for dropped ones). It is lossy by construction, so it is
not registered as a server-wide `--attention-backend`: the drafting worker owns an instance,
and every token it drafts is verified over the full KV.
"""

from __future__ import annotations

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from vericache_sglang.compress.attention_probs import causal_attention_probs
from vericache_sglang.tiers.compressed import CompressedTier


class CompressedTierAttnBackend(TorchNativeAttnBackend):
    """torch_native attention whose decode attends over the compressed tier."""

    def __init__(self, model_runner, tier: CompressedTier) -> None:
        super().__init__(model_runner)
        self.tier = tier

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        out = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if self.tier.compressor.needs_scores:
            self.observe_prompt(q, layer, forward_batch)
        return out

    def observe_prompt(self, q, layer, forward_batch) -> None:
        """Record attention probabilities of each request's last extend queries."""
        window = self.tier.compressor.score_window()
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        start = 0
        for i, extend_len in enumerate(forward_batch.extend_seq_lens_cpu):
            seq_len = int(forward_batch.seq_lens_cpu[i])
            slot = int(forward_batch.req_pool_indices[i])
            rows = self.req_to_token_pool.req_to_token[slot, :seq_len]
            queries = q[start : start + extend_len]
            start += extend_len
            first = seq_len - extend_len  # position of the first extend query
            if window is not None:
                cut = max(extend_len - window, 0)
                queries, first = queries[cut:], first + cut
            scores = causal_attention_probs(queries, k_buffer[rows], first, layer.scaling,
                                            summed=window is None)
            self.tier.observe(layer.layer_id, slot, scores)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = q.new_empty((q.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        for i, (slot, seq_len) in enumerate(
            zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist(),
                strict=True)
        ):
            block = self.tier.block(
                layer.layer_id, slot, req_to_token[slot, :seq_len], k_buffer, v_buffer,
                query=q[i], sm_scale=layer.scaling,
            )
            out[i] = block.attend(q[i], layer.scaling).to(out.dtype)
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

