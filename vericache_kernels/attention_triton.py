"""Triton decode attention reading paged packed K/V directly (dequantize on read) plus an fp
residual and a round's draft tail, in one launch.

A program handles one (request, KV head, split) with all query heads of that GQA group, so each
packed K/V byte is read once per group. The request's quantized tokens (found through the page
table: token t of request b lies in page page_table[b, t // GROUP]) followed by its residual
tokens are cut into `num_splits` contiguous ranges, one per split (flash-decoding: at batch 1 a
long context still fills the GPU); the last split also takes the tail, in which each query head
sees its own number of tokens. Each split runs an online softmax over its range and, with more
than one split, writes a float32 partial (out, lse) that `_merge_splits_kernel` combines.
Contract as in `attention_ref`: `decode_attention_ref` merged with `tail_attention_ref`.

Two inner paths share the loop structure and the online softmax: by default the products run on
CUDA cores per block of tokens; with `mma` they run on tensor cores (`tl.dot`, query heads padded
to 16 rows) over whole pages, each packed byte and each page's key scale/zero loaded once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .layout import PagedKV
from .quant_triton import unpack_codes

BLOCK_N = 16
"""Tokens per inner step by default; `decode_attention_triton(block_n=)` takes any of BLOCK_NS."""
BLOCK_NS = (16, 32, 64)
MMA_MIN = 16
"""Smallest dim `tl.dot` takes: the mma path pads query heads and head dim up to it."""
MAX_SPLITS = 64
"""Most splits the default gives: bounds the float32 partials and the merge's width."""
SPLIT_MIN_TOKENS = 256
"""Fewest tokens per split the default split count gives, so that short contexts keep one split
(no partials, no merge launch) and a split's fixed costs (q load, partial write) stay small."""
PROGRAMS_PER_SM = 2
FALLBACK_SMS = 132
"""SMs assumed off CUDA (the interpreter), an H100's or H200's: defaults as on those GPUs."""


@triton.jit
def _online_softmax_step(q, k, v, valid, m_i, l_i, acc, sm_scale, MMA: tl.constexpr):
    # valid: [1, BLOCK_N] for tokens every query head sees, [BLOCK_H, BLOCK_N] for the tail.
    # MMA: both products on tensor cores; tf32x3 keeps float32 operands near fp32 accuracy.
    if MMA:
        logits = tl.dot(q, tl.trans(k), input_precision="tf32x3") * sm_scale
    else:
        logits = tl.sum(q[:, None, :] * k[None, :, :], 2) * sm_scale
    logits = tl.where(valid, logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MMA:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="tf32x3")
    else:
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
    return m_new, l_i, acc


@triton.jit
def _repeat_cols(x, R: tl.constexpr):
    """[A, C] -> [A, C * R], each column repeated R times (a register broadcast, no load)."""
    A: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    return tl.reshape(tl.broadcast_to(x[:, :, None], (A, C, R)), (A, C * R))


@triton.jit
def _load_tokens(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, table_ptr, b, max_pages, h,
                 kv_heads, start, quant_hi, d, d_ok, HEAD_DIM: tl.constexpr,
                 GROUP: tl.constexpr, V_GROUP: tl.constexpr, BITS: tl.constexpr,
                 PER_BYTE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Quantized tokens [start, start + BLOCK_N) as float32 K, V [BLOCK_N, D], one load per
    code (any start; the CUDA-core path)."""
    t = start + tl.arange(0, BLOCK_N)
    valid = t < quant_hi
    mask = valid[:, None] & d_ok[None, :]
    page = tl.load(table_ptr + b * max_pages + t // GROUP, mask=valid, other=0).to(tl.int64)
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
    return k, v, valid


@triton.jit
def _load_pages(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, table_ptr, b, max_pages, h,
                kv_heads, start, quant_hi, d, d_ok, HEAD_DIM: tl.constexpr,
                GROUP: tl.constexpr, V_GROUP: tl.constexpr, BITS: tl.constexpr,
                PER_BYTE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Whole pages [start, start + BLOCK_N) (start page-aligned, BLOCK_N a multiple of GROUP) as
    float32 K, V [BLOCK_N, D]: each packed byte and each page's key scale/zero loaded once and
    broadcast in registers (the tensor-core path)."""
    PAGES: tl.constexpr = BLOCK_N // GROUP
    # keys, transposed [D, BLOCK_N]: byte column c holds tokens c * pb ..; its page is c's
    p = tl.arange(0, PAGES)
    page_ok = start + p * GROUP < quant_hi
    page = tl.load(table_ptr + b * max_pages + start // GROUP + p, mask=page_ok, other=0)
    k_meta = ((page.to(tl.int64) * kv_heads + h) * HEAD_DIM)[None, :] + d[:, None]
    meta_mask = d_ok[:, None] & page_ok[None, :]
    k_scale = tl.load(ks_ptr + k_meta, mask=meta_mask, other=0.0).to(tl.float32)
    k_zero = tl.load(kz_ptr + k_meta, mask=meta_mask, other=0.0).to(tl.float32)
    c = tl.arange(0, BLOCK_N // PER_BYTE)
    byte_ok = d_ok[:, None] & (start + c * PER_BYTE < quant_hi)[None, :]
    k_byte = tl.load(kc_ptr + _repeat_cols(k_meta, GROUP // PER_BYTE) * (GROUP // PER_BYTE)
                     + (c % (GROUP // PER_BYTE))[None, :], mask=byte_ok, other=0).to(tl.int32)
    n = tl.arange(0, BLOCK_N)
    k_q = unpack_codes(_repeat_cols(k_byte, PER_BYTE), ((n % PER_BYTE) * BITS)[None, :], BITS)
    k_t = (k_q.to(tl.float32) * _repeat_cols(k_scale, GROUP)
           + _repeat_cols(k_zero, GROUP))
    # values [BLOCK_N, D]: row n is token j = n % GROUP of page n // GROUP
    t = start + n
    valid = t < quant_hi
    tok_page = tl.reshape(_repeat_cols(page[None, :].to(tl.int64), GROUP), (BLOCK_N,))
    v_row = ((tok_page * GROUP + t % GROUP) * kv_heads + h)[:, None]
    cb = tl.arange(0, BLOCK_D // PER_BYTE)
    v_byte = tl.load(vc_ptr + v_row * (HEAD_DIM // PER_BYTE) + cb[None, :],
                     mask=valid[:, None] & (cb < HEAD_DIM // PER_BYTE)[None, :],
                     other=0).to(tl.int32)
    v_q = unpack_codes(_repeat_cols(v_byte, PER_BYTE), ((d % PER_BYTE) * BITS)[None, :], BITS)
    mask = valid[:, None] & d_ok[None, :]
    v_meta = v_row * (HEAD_DIM // V_GROUP) + (d // V_GROUP)[None, :]
    v = (v_q.to(tl.float32) * tl.load(vs_ptr + v_meta, mask=mask, other=0.0).to(tl.float32)
         + tl.load(vz_ptr + v_meta, mask=mask, other=0.0).to(tl.float32))
    return tl.trans(k_t), v, valid


@triton.jit
def _load_dense(ptr, b, t, ok, n_max, h, kv_heads, d, d_ok, HEAD_DIM: tl.constexpr):
    """Tokens t of request b, KV head h, from float [B, n_max, H, D] as float32 [BLOCK_N, D]."""
    offs = ((b * n_max + t) * kv_heads + h)[:, None] * HEAD_DIM + d[None, :]
    return tl.load(ptr + offs, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _decode_attention_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, table_ptr, q_len_ptr,
    kr_ptr, vr_ptr, r_len_ptr, kt_ptr, vt_ptr, t_len_ptr, o_ptr, lse_ptr,
    sm_scale, max_pages, n_res_max, n_tail_max, kv_heads, group_size, n_splits,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, V_GROUP: tl.constexpr,
    BITS: tl.constexpr, PER_BYTE: tl.constexpr, HAS_QUANT: tl.constexpr, HAS_TAIL: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MMA: tl.constexpr,
):
    # int64 from here on: offsets into a large page pool (or residual) overflow int32
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
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
    n_quant = tl.load(q_len_ptr + b) if HAS_QUANT else 0
    n_res = tl.load(r_len_ptr + b)
    # this split's tokens [lo, hi) of the request's quantized-then-residual sequence: the same
    # whole number of BLOCK_N steps per split (the last used one may be short, later ones empty)
    n_total = n_quant + n_res
    chunk = tl.cdiv(tl.cdiv(n_total, n_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_total)
    if HAS_QUANT:
        quant_hi = tl.minimum(hi, n_quant)
        for start in range(lo, quant_hi, BLOCK_N):
            if MMA:
                k, v, valid = _load_pages(
                    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, table_ptr, b, max_pages, h,
                    kv_heads, start, quant_hi, d, d_ok, HEAD_DIM, GROUP, V_GROUP, BITS,
                    PER_BYTE, BLOCK_N, BLOCK_D)
            else:
                k, v, valid = _load_tokens(
                    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, table_ptr, b, max_pages, h,
                    kv_heads, start, quant_hi, d, d_ok, HEAD_DIM, GROUP, V_GROUP, BITS,
                    PER_BYTE, BLOCK_N)
            m_i, l_i, acc = _online_softmax_step(q, k, v, valid[None, :], m_i, l_i, acc,
                                                 sm_scale, MMA)
    res_hi = hi - n_quant
    for start in range(tl.maximum(lo - n_quant, 0), res_hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        valid = t < res_hi
        k = _load_dense(kr_ptr, b, t, valid, n_res_max, h, kv_heads, d, d_ok, HEAD_DIM)
        v = _load_dense(vr_ptr, b, t, valid, n_res_max, h, kv_heads, d, d_ok, HEAD_DIM)
        m_i, l_i, acc = _online_softmax_step(q, k, v, valid[None, :], m_i, l_i, acc, sm_scale,
                                             MMA)
    if HAS_TAIL:
        # The last split only. Query head j takes the first sees[j] tokens; none past them all
        # is read (unwritten scratch may hold NaN). The tail keeps its own running state, folded
        # in after its loop: carrying m_i/l_i/acc through a third loop trips Triton's layout
        # pass (RemoveLayoutConversions, triton 3.8, BLOCK_N = 32) on GPU builds.
        sees = tl.load(t_len_ptr + b * kv_heads * group_size + heads,
                       mask=head_ok & (split == n_splits - 1), other=0)
        n_tail = tl.max(sees, 0)
        m_t = tl.full([BLOCK_H], -1.0e30, tl.float32)
        l_t = tl.zeros([BLOCK_H], tl.float32)
        acc_t = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for start in range(0, n_tail, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            read = t < n_tail
            k = _load_dense(kt_ptr, b, t, read, n_tail_max, h, kv_heads, d, d_ok, HEAD_DIM)
            v = _load_dense(vt_ptr, b, t, read, n_tail_max, h, kv_heads, d, d_ok, HEAD_DIM)
            m_t, l_t, acc_t = _online_softmax_step(q, k, v, t[None, :] < sees[:, None], m_t,
                                                   l_t, acc_t, sm_scale, MMA)
        m_new = tl.maximum(m_i, m_t)
        alpha = tl.exp(m_i - m_new)
        beta = tl.exp(m_t - m_new)
        l_i = l_i * alpha + l_t * beta
        acc = acc * alpha[:, None] + acc_t * beta[:, None]
        m_i = m_new
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    # out/lse: [B, Hq, n_splits, D] and [B, Hq, n_splits]
    part = (b * kv_heads * group_size + heads) * n_splits + split
    tl.store(o_ptr + part[:, None] * HEAD_DIM + d[None, :], acc / l_safe[:, None], mask=q_mask)
    tl.store(lse_ptr + part, tl.where(seen, m_i + tl.log(l_safe), float("-inf")), mask=head_ok)


@triton.jit
def _merge_splits_kernel(
    part_o_ptr, part_lse_ptr, o_ptr, lse_ptr, n_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per (request, query head): its splits' partials [n_splits, D] -> out [D]
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < n_splits
    lse = tl.load(part_lse_ptr + row * n_splits + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    # an empty split (lse -inf) weighs 0; m = -inf (all empty) would make that -inf - -inf
    w = tl.exp(lse - tl.where(m > float("-inf"), m, 0.0))
    total = tl.sum(w, 0)
    mask = s_ok[:, None] & (d < HEAD_DIM)[None, :]
    parts = tl.load(part_o_ptr + (row * n_splits + s)[:, None] * HEAD_DIM + d[None, :],
                    mask=mask, other=0.0)
    seen = total > 0
    out = tl.sum(w[:, None] * parts, 0) / tl.where(seen, total, 1.0)
    tl.store(o_ptr + row * HEAD_DIM + d, out, mask=d < HEAD_DIM)
    tl.store(lse_ptr + row, tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)),
                                     float("-inf")))


def decode_attention_triton(
    q: torch.Tensor,
    paged: PagedKV | None,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    res_lengths: torch.Tensor,
    sm_scale: float,
    tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    *,
    num_splits: int | None = None,
    block_n: int = BLOCK_N,
    mma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_ref.decode_attention_ref`, merged with `tail_attention_ref(q, *tail)` when a
    tail (k, v [B, T, H, D], head_lengths [B, Hq]) is given, in one launch (two with splits).

    `num_splits`: ranges each request's tokens are cut into; None picks `default_num_splits`.
    `block_n`: tokens per inner step, one of BLOCK_NS.
    `mma`: logits and P·V by `tl.dot` (tensor cores), the query heads padded to MMA_MIN rows,
    and the pages walked whole (a step is max(block_n, group) tokens; group a power of two).
    """
    if block_n not in BLOCK_NS:
        raise ValueError(f"block_n must be one of {BLOCK_NS}, not {block_n}")
    batch, q_heads, head_dim = q.shape
    kv_heads = k_res.shape[2]
    if batch == 0:
        return (torch.empty(0, q_heads, head_dim, dtype=torch.float32, device=q.device),
                torch.empty(0, q_heads, dtype=torch.float32, device=q.device))
    group_size = q_heads // kv_heads
    quant = paged if paged is not None else _empty_paged(q.device, batch, kv_heads, head_dim)
    # tl.dot needs every dim >= MMA_MIN; the page walk needs whole pages per step
    min_block = MMA_MIN if mma else 1
    if mma:
        if quant.group & (quant.group - 1):
            raise ValueError(f"mma needs a power-of-two group, not {quant.group}")
        block_n = max(block_n, quant.group)
    if num_splits is None:
        longest = quant.page_table.shape[1] * quant.group + k_res.shape[1]
        num_splits = default_num_splits(batch * kv_heads, longest, _sm_count(q.device))
    # with one split the partials are the result: [B, Hq, 1, D] is out [B, Hq, D]'s layout
    part_o = torch.empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32,
                         device=q.device)
    part_lse = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=q.device)
    tail_k, tail_v, tail_lengths = (
        (k_res, v_res, res_lengths) if tail is None  # placeholders, never read
        else (tail[0].contiguous(), tail[1].contiguous(), tail[2].to(torch.int32).contiguous()))
    _decode_attention_kernel[(batch, kv_heads, num_splits)](
        q.contiguous(), quant.k_codes.contiguous(), quant.k_scale.contiguous(),
        quant.k_zero.contiguous(), quant.v_codes.contiguous(), quant.v_scale.contiguous(),
        quant.v_zero.contiguous(), quant.page_table.to(torch.int32).contiguous(),
        quant.lengths.to(torch.int32).contiguous(),
        k_res.contiguous(), v_res.contiguous(), res_lengths.to(torch.int32).contiguous(),
        tail_k, tail_v, tail_lengths, part_o, part_lse,
        sm_scale, quant.page_table.shape[1], k_res.shape[1], tail_k.shape[1], kv_heads,
        group_size, num_splits,
        HEAD_DIM=head_dim, GROUP=quant.group, V_GROUP=quant.v_group, BITS=quant.bits,
        PER_BYTE=8 // quant.bits, HAS_QUANT=paged is not None, HAS_TAIL=tail is not None,
        BLOCK_H=max(min_block, triton.next_power_of_2(group_size)), BLOCK_N=block_n,
        BLOCK_D=max(min_block, triton.next_power_of_2(head_dim)), MMA=mma,
    )
    if num_splits == 1:
        return part_o.squeeze(2), part_lse.squeeze(2)
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, q_heads, dtype=torch.float32, device=q.device)
    _merge_splits_kernel[(batch * q_heads,)](
        part_o, part_lse, out, lse, num_splits, HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out, lse


def default_num_splits(programs: int, longest: int, sms: int) -> int:
    """Splits per (request, KV head) for `programs` of them, the longest request `longest`
    tokens: enough for PROGRAMS_PER_SM programs per SM, no more than MAX_SPLITS, and none
    shorter than SPLIT_MIN_TOKENS (so 1 for short contexts)."""
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, programs)
    return max(1, min(wanted, MAX_SPLITS, longest // SPLIT_MIN_TOKENS))


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The device's SMs (FALLBACK_SMS off CUDA); cached, as it is asked per layer and step."""
    if device.type != "cuda":
        return FALLBACK_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _empty_paged(device: torch.device, batch: int, heads: int, dim: int) -> PagedKV:
    """An empty paged part (no pages; 8-bit, one-token groups) for residual-only calls."""
    k_codes = torch.empty(0, heads, dim, 1, dtype=torch.uint8, device=device)
    k_meta = torch.empty(0, heads, dim, dtype=torch.float16, device=device)
    v_meta = k_meta[:, None]
    return PagedKV(k_codes, k_meta, k_meta, k_codes.reshape(0, 1, heads, dim), v_meta, v_meta,
                   page_table=torch.empty(batch, 0, dtype=torch.int32, device=device),
                   lengths=torch.zeros(batch, dtype=torch.int32, device=device), bits=8, group=1,
                   v_group=1)
