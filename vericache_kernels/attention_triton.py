"""Triton decode attention reading paged packed K/V directly (dequantize on read) plus an fp
residual.

One program per (request, KV head) handles all query heads of that GQA group, so each packed
K/V byte is read once per group; an online softmax runs over the quantized tokens, found through
the page table (token t of request b lies in page page_table[b, t // GROUP]), and then over the
residual tokens. Contract as in `attention_ref.decode_attention_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import PagedKV
from .quant_triton import unpack_codes

BLOCK_N = 16


@triton.jit
def _online_softmax_step(q, k, v, valid, m_i, l_i, acc, sm_scale):
    logits = tl.sum(q[:, None, :] * k[None, :, :], 2) * sm_scale
    logits = tl.where(valid[None, :], logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
    return m_new, l_i, acc


@triton.jit
def _decode_attention_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, table_ptr, q_len_ptr,
    kr_ptr, vr_ptr, r_len_ptr, o_ptr, lse_ptr,
    sm_scale, max_pages, n_res_max, kv_heads, group_size,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, V_GROUP: tl.constexpr,
    BITS: tl.constexpr, PER_BYTE: tl.constexpr, HAS_QUANT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    head_ok = tl.arange(0, BLOCK_H) < group_size
    heads = h * group_size + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_offs = (b * kv_heads * group_size + heads)[:, None] * HEAD_DIM + d[None, :]
    q_mask = head_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if HAS_QUANT:
        n_quant = tl.load(q_len_ptr + b)
        for start in range(0, n_quant, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            valid = t < n_quant
            mask = valid[:, None] & d_ok[None, :]
            # int64: offsets into a large page pool overflow int32
            page = tl.load(table_ptr + b * max_pages + t // GROUP, mask=valid, other=0)
            page = page.to(tl.int64)
            j = t % GROUP
            # keys: byte (page, head, channel, j // pb), bit offset (j % pb) * bits
            k_meta = ((page * kv_heads + h) * HEAD_DIM)[:, None] + d[None, :]
            k_byte = tl.load(kc_ptr + k_meta * (GROUP // PER_BYTE) + (j // PER_BYTE)[:, None],
                             mask=mask, other=0).to(tl.int32)
            k_q = unpack_codes(k_byte, ((j % PER_BYTE) * BITS)[:, None], BITS).to(tl.float32)
            k = (k_q * tl.load(ks_ptr + k_meta, mask=mask, other=0.0).to(tl.float32)
                 + tl.load(kz_ptr + k_meta, mask=mask, other=0.0).to(tl.float32))
            # values: byte (page, token j, head, channel // pb), bit offset (channel % pb) * bits
            v_row = ((page * GROUP + j) * kv_heads + h)[:, None]
            v_byte = tl.load(vc_ptr + v_row * (HEAD_DIM // PER_BYTE) + (d // PER_BYTE)[None, :],
                             mask=mask, other=0).to(tl.int32)
            v_q = unpack_codes(v_byte, ((d % PER_BYTE) * BITS)[None, :], BITS).to(tl.float32)
            v_meta = v_row * (HEAD_DIM // V_GROUP) + (d // V_GROUP)[None, :]
            v = (v_q * tl.load(vs_ptr + v_meta, mask=mask, other=0.0).to(tl.float32)
                 + tl.load(vz_ptr + v_meta, mask=mask, other=0.0).to(tl.float32))
            m_i, l_i, acc = _online_softmax_step(q, k, v, valid, m_i, l_i, acc, sm_scale)
    n_res = tl.load(r_len_ptr + b)
    for start in range(0, n_res, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        valid = t < n_res
        mask = valid[:, None] & d_ok[None, :]
        offs = ((b * n_res_max + t) * kv_heads + h)[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(kr_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(vr_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m_i, l_i, acc = _online_softmax_step(q, k, v, valid, m_i, l_i, acc, sm_scale)
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    tl.store(o_ptr + q_offs, acc / l_safe[:, None], mask=q_mask)
    lse = tl.where(seen, m_i + tl.log(l_safe), float("-inf"))
    tl.store(lse_ptr + b * kv_heads * group_size + heads, lse, mask=head_ok)


def decode_attention_triton(
    q: torch.Tensor,
    paged: PagedKV | None,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    res_lengths: torch.Tensor,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `attention_ref.decode_attention_ref`."""
    batch, q_heads, head_dim = q.shape
    kv_heads = k_res.shape[2]
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, q_heads, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    group_size = q_heads // kv_heads
    quant = paged if paged is not None else _empty_paged(q.device, batch, kv_heads, head_dim)
    grid = (batch, kv_heads)
    _decode_attention_kernel[grid](
        q.contiguous(), quant.k_codes.contiguous(), quant.k_scale.contiguous(),
        quant.k_zero.contiguous(), quant.v_codes.contiguous(), quant.v_scale.contiguous(),
        quant.v_zero.contiguous(), quant.page_table.to(torch.int32).contiguous(),
        quant.lengths.to(torch.int32).contiguous(),
        k_res.contiguous(), v_res.contiguous(), res_lengths.to(torch.int32).contiguous(),
        out, lse, sm_scale, quant.page_table.shape[1], k_res.shape[1], kv_heads, group_size,
        HEAD_DIM=head_dim, GROUP=quant.group, V_GROUP=quant.v_group, BITS=quant.bits,
        PER_BYTE=8 // quant.bits, HAS_QUANT=paged is not None,
        BLOCK_H=triton.next_power_of_2(group_size), BLOCK_N=BLOCK_N,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out, lse


def _empty_paged(device: torch.device, batch: int, heads: int, dim: int) -> PagedKV:
    """An empty paged part (no pages; 8-bit, one-token groups) for residual-only calls."""
    k_codes = torch.empty(0, heads, dim, 1, dtype=torch.uint8, device=device)
    k_meta = torch.empty(0, heads, dim, dtype=torch.float16, device=device)
    v_meta = k_meta[:, None]
    return PagedKV(k_codes, k_meta, k_meta, k_codes.reshape(0, 1, heads, dim), v_meta, v_meta,
                   page_table=torch.empty(batch, 0, dtype=torch.int32, device=device),
                   lengths=torch.zeros(batch, dtype=torch.int32, device=device), bits=8, group=1,
                   v_group=1)
