"""The two private attention backends of a VeriCache round: drafting and verification.

Drafting (`DraftAttnBackend`) runs the target model one token at a time. Each request's
committed prefix is read from its `CompressedTier` block (built from, and appended from, the
full KV pool: only tokens the full model has verified are ever compressed); the tokens drafted
in this round are attended exactly from a scratch tail this backend holds. Nothing is written
to the KV pool while drafting, so a rejected draft leaves no trace.

Verification (`VerifyAttnBackend`) is SGLang's torch_native attention plus a TARGET_VERIFY
forward: the root token and the k drafts of each request extend its committed prefix over the
full KV, causally (a draft chain needs no tree mask), writing their K/V into the pool slots
reserved beyond the committed length. Only those k + 1 queries are computed, so a round reads
the committed KV once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from vericache_sglang.attention.compressed_backend import CompressedTierAttnBackend
from vericache_sglang.tiers.compressed import CompressedTier


class DraftAttnBackend(CompressedTierAttnBackend):
    """Decode over each request's compressed committed prefix plus its exact draft tail.

    Before a round the worker calls `begin_round(committed_lens, max_steps)`; before draft
    step j it calls `set_step(j)`. Extend (prefill) is inherited unchanged: full KV, plus the
    prompt observation scores token-selecting compressors need.
    """

    def __init__(self, model_runner, tier: CompressedTier) -> None:
        super().__init__(model_runner, tier)
        self._committed: list[int] = []
        self._step = 0
        self._max_steps = 0
        self._tail_k: dict[int, torch.Tensor] = {}
        self._tail_v: dict[int, torch.Tensor] = {}
        # (layer, batch row) -> the compressed prefix read densely; fixed within a round.
        self._prefix: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def begin_round(self, committed_lens: list[int], max_steps: int) -> None:
        """Start drafting for a batch whose requests have these committed KV lengths."""
        self._committed = list(committed_lens)
        self._max_steps = max_steps
        self._step = 0
        self.end_round()

    def set_step(self, step: int) -> None:
        """The next decode forward drafts from the token at committed length + `step`."""
        if not 0 <= step < self._max_steps:
            raise ValueError(f"draft step {step} outside [0, {self._max_steps})")
        self._step = step

    def end_round(self) -> None:
        """Drop the scratch tail (the drafts' K/V) and the round's prefix reads."""
        self._tail_k.clear()
        self._tail_v.clear()
        self._prefix.clear()

    def _prefix_kv(self, layer, row: int, slot: int, q: torch.Tensor):
        """A request's committed prefix as the tier holds it, read once per round and layer,
        as float32 keys and values [H, N, D] (per KV head, contiguous: every draft step of
        the round multiplies against them without copying)."""
        key = (layer.layer_id, row)
        if key not in self._prefix:
            rows = self.req_to_token_pool.req_to_token[slot, : self._committed[row]]
            block = self.tier.block(
                layer.layer_id, slot, rows,
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                query=q, sm_scale=layer.scaling,
            )
            self._prefix[key] = tuple(
                t.float().transpose(0, 1).contiguous() for t in block.dense()
            )
        return self._prefix[key]

    def _tail(self, layer, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Record this step's K/V [bs, H, D] in the layer's scratch tail and return the tail."""
        lid = layer.layer_id
        if lid not in self._tail_k:
            shape = (k.shape[0], self._max_steps, *k.shape[1:])
            self._tail_k[lid] = k.new_empty(shape)
            self._tail_v[lid] = v.new_empty(shape)
        self._tail_k[lid][:, self._step] = k
        self._tail_v[lid][:, self._step] = v
        return self._tail_k[lid][:, : self._step + 1], self._tail_v[lid][:, : self._step + 1]

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        del save_kv_cache  # drafting never writes the full KV pool
        heads, head_dim = layer.tp_k_head_num, layer.qk_head_dim
        q = q.reshape(-1, layer.tp_q_head_num, head_dim)
        tail_k, tail_v = self._tail(
            layer, k.reshape(-1, heads, head_dim), v.reshape(-1, heads, layer.v_head_dim)
        )
        out = q.new_empty((q.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        slots = forward_batch.req_pool_indices.tolist()
        if len(slots) != len(self._committed):
            raise RuntimeError("draft forward batch does not match begin_round()")
        for i, slot in enumerate(slots):
            prefix = self._prefix_kv(layer, i, slot, q[i])
            tail = (tail_k[i].float().transpose(0, 1), tail_v[i].float().transpose(0, 1))
            out[i] = _attend(q[i].float(), (prefix, tail), layer.scaling).to(out.dtype)
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)


def _attend(q: torch.Tensor, parts: tuple[tuple[torch.Tensor, torch.Tensor], ...],
            scale: float) -> torch.Tensor:
    """One float32 query [Hq, D] over the union of (keys, values) parts, each [H, N, D]
    float32 per KV head, without concatenating them -> [Hq, Dv] float32. GQA: query head j
    reads KV head j // (Hq // H), as grouped matmuls (no repeated K/V)."""
    grouped = q.view(parts[0][0].shape[0], -1, q.shape[-1])  # [H, Hq // H, D]
    logits = torch.cat([torch.matmul(grouped, keys.transpose(1, 2)) for keys, _ in parts], -1)
    probs = torch.softmax(logits * scale, dim=-1)
    out, start = 0, 0
    for keys, values in parts:
        out = out + torch.matmul(probs[..., start : start + keys.shape[1]], values)
        start += keys.shape[1]
    return out.reshape(q.shape[0], -1)


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
        width = forward_batch.spec_info.draft_token_num
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        lens = forward_batch.seq_lens_cpu
        lens = (forward_batch.seq_lens if lens is None else lens).tolist()
        offsets = torch.arange(width, device=q.device)
        for i, (slot, prefix) in enumerate(
            zip(forward_batch.req_pool_indices.tolist(), lens, strict=True)
        ):
            rows = req_to_token[slot, : prefix + width]
            keys, values = k_buffer[rows].movedim(0, 1), v_buffer[rows].movedim(0, 1)
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
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)
