"""Torch reference for decode attention over paged packed K/V plus a full-precision residual.

One query token per request, GQA: query head j reads KV head j // (Hq // H). Flash-decoding
style, because it runs per layer and draft step on long contexts: the requests' pages are walked
CHUNK_TOKENS tokens at a time, only that chunk is dequantized, and it is folded into a running
max / sum / accumulator (online softmax, float32); the residual follows in the same chunks. Scratch
memory is one chunk per request, and nothing dequantized outlives the call. Returns the output
and the log-sum-exp of the logits so that attention over several parts (say two quantized tiers
with different bit widths) can be merged exactly with `merge_attention`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from .layout import PagedKV, dequantize_keys, dequantize_values
from .quant_ref import dequantize_unpack_ref

CHUNK_TOKENS = 1024
"""Tokens per request dequantized (or, for the residual, converted to float32) at once: scratch
of 8 x head_dim bytes per token and KV head (K and V in float32), and few enough chunks that a
CPU draft step's attention costs about a plain decode step's (4 requests x 2,048 tokens, 1
thread: 18.6 ms against SGLang's torch_native 15.9 ms; 256-token chunks took 27.9 ms)."""

Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""(rows [b] of the batch, keys [b, n, H, D], values [b, n, H, D] float32, valid [b, n])."""


class _OnlineSoftmax:
    """Running attention state per (request, KV head, query head of its group), float32."""

    def __init__(self, q: torch.Tensor, heads: int, sm_scale: float,
                 logit_cap: float = 0.0) -> None:
        batch, q_heads, dim = q.shape
        self.q = q.float().reshape(batch, heads, q_heads // heads, dim)
        self.sm_scale = sm_scale
        self.logit_cap = logit_cap
        # m: running max of the logits, l: running sum of exp(logit - m), acc: of exp(...) * v
        self.m = torch.full(self.q.shape[:3], float("-inf"), dtype=torch.float32,
                            device=q.device)
        self.l = torch.zeros(self.q.shape[:3], dtype=torch.float32, device=q.device)
        self.acc = torch.zeros_like(self.q)

    def update(self, chunk: Chunk) -> None:
        """Fold in a chunk; each of its rows has a valid token, so the new max is finite."""
        rows, keys, values, valid = chunk
        logits = soft_cap(_grouped_bmm(self.q[rows], keys.permute(0, 2, 3, 1)) * self.sm_scale,
                          self.logit_cap)
        logits.masked_fill_(~valid[:, None, None, :], float("-inf"))
        if not valid.all():  # slots past a request's end may hold anything, NaN too: 0 * NaN
            values = values.masked_fill(~valid[..., None, None], 0.0)
        m_old = self.m[rows]
        m_new = torch.maximum(m_old, logits.amax(-1))
        alpha = torch.exp(m_old - m_new)
        p = torch.exp(logits - m_new[..., None])
        self.l[rows] = self.l[rows] * alpha + p.sum(-1)
        self.acc[rows] = self.acc[rows] * alpha[..., None] + _grouped_bmm(p, values.transpose(1, 2))
        self.m[rows] = m_new

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, Hq, D], lse [B, Hq]); a request that saw no token gets 0 and -inf."""
        batch, heads, group_size, dim = self.q.shape
        q_heads = heads * group_size
        # a request that saw a token has l >= 1 (its max contributes exp(0)); else acc = l = 0
        out = self.acc / self.l.clamp(min=1.0)[..., None]
        lse = self.m + torch.log(self.l)  # -inf + log(0) = -inf for a request with no token
        return out.reshape(batch, q_heads, dim), lse.reshape(batch, q_heads)


def soft_cap(logits: torch.Tensor, logit_cap: float) -> torch.Tensor:
    """Attention logit softcapping (Gemma 2; SGLang's `RadixAttention.logit_cap`, tanh method):
    cap * tanh(logits / cap), applied after scaling; 0 means none."""
    return logits if logit_cap <= 0 else logit_cap * torch.tanh(logits / logit_cap)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    sm_scale: float, logit_cap: float = 0.0) -> torch.Tensor:
    """q [B, Hq, Tq, D] over k/v [B, H, Tk, D] (GQA: query head j reads KV head j // (Hq // H))
    where `visible` [B or 1, 1, Tq, Tk] allows: out [B, Hq, Tq, Dv] in q's dtype. SDPA without a
    cap; with one, the logits are capped before the mask and softmax (SDPA has no cap). Every
    query must see at least one key."""
    gqa = q.shape[1] != k.shape[1]
    if logit_cap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=sm_scale,
                                              enable_gqa=gqa)
    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = soft_cap(torch.matmul(q, k.transpose(-1, -2)) * sm_scale, logit_cap)
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.matmul(probs, v)


def _grouped_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B, H, m, k] x [B, H, k, n] -> [B, H, m, n]: one bmm per KV head for all of its query
    heads. BLAS reads each head's strided view of K/V in place, where a 4-d matmul copies it."""
    return torch.stack([torch.bmm(a[:, h], b[:, h]) for h in range(a.shape[1])], 1)


def _window(lengths: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose `lengths` reach past `start`, and which of their `width` slots from `start`
    lie within it."""
    rows = (lengths > start).nonzero()[:, 0]
    slots = start + torch.arange(width, device=lengths.device)
    return rows, slots[None] < lengths[rows, None]


def _page_chunks(paged: PagedKV) -> Iterator[Chunk]:
    """Every request's pages, about CHUNK_TOKENS tokens of each at a time, dequantized."""
    group = paged.group
    per_chunk = max(1, CHUNK_TOKENS // group)
    n_pages = paged.lengths.long() // group
    deq = (paged.bits, torch.float32, dequantize_unpack_ref)
    for start in range(0, max(n_pages.tolist(), default=0), per_chunk):
        table = paged.page_table[:, start:start + per_chunk]
        rows, valid = _window(n_pages, start, table.shape[1])
        pages = torch.where(valid, table[rows].long(), 0).flatten()  # unread entries: page 0
        # index_select copies whole pages; advanced indexing goes element by element
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = (
            t.index_select(0, pages) for t in (paged.k_codes, paged.k_scale, paged.k_zero,
                                               paged.v_codes, paged.v_scale, paged.v_zero)
        )
        keys = dequantize_keys(k_codes, k_scale, k_zero, *deq)
        values = dequantize_values(v_codes.flatten(0, 1), v_scale.flatten(0, 1),
                                   v_zero.flatten(0, 1), *deq)
        shape = (len(rows), -1, *keys.shape[1:])
        yield (rows, keys.reshape(shape), values.reshape(shape),
               valid.repeat_interleave(group, dim=1))


def _residual_chunks(
    k_res: torch.Tensor, v_res: torch.Tensor, res_lengths: torch.Tensor
) -> Iterator[Chunk]:
    """Every request's residual tokens, CHUNK_TOKENS at a time, in float32."""
    lengths = res_lengths.long()
    for start in range(0, max(lengths.tolist(), default=0), CHUNK_TOKENS):
        end = start + CHUNK_TOKENS
        rows, valid = _window(lengths, start, min(CHUNK_TOKENS, k_res.shape[1] - start))
        yield (rows, k_res[:, start:end].index_select(0, rows).float(),
               v_res[:, start:end].index_select(0, rows).float(), valid)


def decode_attention_ref(
    q: torch.Tensor,
    paged: PagedKV | None,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    res_lengths: torch.Tensor,
    sm_scale: float,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D]; k_res/v_res [B, R, H, D] -> (out [B, Hq, D], lse [B, Hq]), both float32.

    A request with no tokens at all gets out = 0 and lse = -inf (it carries no weight in a merge).
    `logit_cap` > 0 softcaps the logits (`soft_cap`).
    """
    state = _OnlineSoftmax(q, k_res.shape[2], sm_scale, logit_cap)
    if paged is not None:
        for chunk in _page_chunks(paged):
            state.update(chunk)
    for chunk in _residual_chunks(k_res, v_res, res_lengths):
        state.update(chunk)
    return state.result()


def tail_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_lengths: torch.Tensor,
    sm_scale: float, logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D] over float K/V [B, T, H, D] where query head j of request b sees the first
    head_lengths[b, j] tokens: (out [B, Hq, D], lse [B, Hq]), float32, 0 and -inf where a head
    sees none. The round's drafts, a few tokens: plain dense attention."""
    batch, q_heads, dim = q.shape
    heads = k.shape[2]
    qg = q.float().reshape(batch, heads, q_heads // heads, dim)
    logits = torch.einsum("bhgd,bthd->bhgt", qg, k.float()).reshape(batch, q_heads, -1)
    logits = soft_cap(logits * sm_scale, logit_cap)
    seen = torch.arange(k.shape[1], device=q.device) < head_lengths[..., None]
    logits = logits.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    probs = torch.exp(logits - lse[..., None]).nan_to_num(0.0)  # a head that sees nothing: 0
    out = torch.einsum("bhgt,bthd->bhgd", probs.reshape(batch, heads, q_heads // heads, -1),
                       v.float().masked_fill(~seen.any(1)[..., None, None], 0.0))
    return out.reshape(batch, q_heads, dim), lse


def merge_attention(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine (out, lse) of attention over disjoint key sets into attention over their union."""
    lse = torch.stack([part_lse for _, part_lse in parts])
    total = torch.logsumexp(lse, dim=0)
    weights = torch.exp(lse - total).nan_to_num(0.0)  # -inf - -inf: an empty part weighs 0
    out = sum(w[..., None] * part_out for w, (part_out, _) in zip(weights, parts, strict=True))
    return out, total
