"""Attention logit softcapping in SGLang's torch_native backend, the CPU engine's attention.

SGLang's GPU backends (Triton, FlashInfer, FA3) apply `RadixAttention.logit_cap` (Gemma 2's
attention softcapping); torch_native runs plain SDPA and ignores it, so on a CPU plain SGLang
serves Gemma 2 with different attention than the model defines (and than HF transformers).
Verification must compare against the model itself, so on the CPU engine this AROUND hook on
`TorchNativeAttnBackend.forward_extend` / `forward_decode` runs a capped layer's attention with
the cap (`vericache_kernels.dense_attention`), within its sliding window as torch_native
applies it, for plain and VeriCache servers alike; layers without a cap take SGLang's code
unchanged. The seam that would replace it: torch_native honouring `logit_cap` itself.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.plugins.hook_registry import HookType

import vericache_kernels as kernels
from vericache_sglang.attention.features import logit_cap, sliding_window, window_visible
from vericache_sglang.integration.hooks import hook

BACKEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
EXTEND_TARGET = f"{BACKEND}.forward_extend"
DECODE_TARGET = f"{BACKEND}.forward_decode"


def _capped_attention(backend: Any, q: torch.Tensor, k: torch.Tensor | None,
                      v: torch.Tensor | None, layer: Any, forward_batch: Any,
                      save_kv_cache: bool, query_lens: list[int]) -> torch.Tensor:
    """torch_native's forward for a capped causal layer: the new tokens' K/V saved as it saves
    them, then each request's queries (the last `query_lens[i]` positions of its sequence) over
    its whole sequence, causally, within the window, logits capped."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
    req_to_token = backend.req_to_token_pool.req_to_token
    seq_lens = forward_batch.seq_lens.tolist()
    slots = forward_batch.req_pool_indices.tolist()
    start = 0
    for slot, seq_len, query_len in zip(slots, seq_lens, query_lens, strict=True):
        rows = req_to_token[slot, :seq_len].to(torch.int64)
        keys, values = (cache.index_select(0, rows).to(q.dtype).transpose(0, 1)[None]
                        for cache in (k_cache, v_cache))
        positions = torch.arange(seq_len, device=q.device)
        visible = window_visible(positions[seq_len - query_len:, None], positions[None],
                                 sliding_window(layer))
        query = q[start:start + query_len].transpose(0, 1)[None]
        out[start:start + query_len] = kernels.dense_attention(
            query, keys, values, visible[None, None], layer.scaling, logit_cap(layer)
        )[0].transpose(0, 1)
        start += query_len
    return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)


def _served_here(layer: Any) -> bool:
    return logit_cap(layer) > 0 and not layer.is_cross_attention


def _extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    if not _served_here(layer):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    return _capped_attention(backend, q, k, v, layer, forward_batch, save_kv_cache,
                             forward_batch.extend_seq_lens.tolist())


def _decode(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    if not _served_here(layer):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    return _capped_attention(backend, q, k, v, layer, forward_batch, save_kv_cache,
                             [1] * len(forward_batch.seq_lens))


def register() -> None:
    """Register the hooks (the plugin calls this only when SGLang's CPU engine is selected)."""
    hook(EXTEND_TARGET, _extend, HookType.AROUND)
    hook(DECODE_TARGET, _decode, HookType.AROUND)
