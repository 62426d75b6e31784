"""A pool of packed K/V pages read through a page table, with the float32 attention it must
give: the cases the decode-attention tests of every implementation share (torch reference, C++
and Triton kernels)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import vericache_kernels as kernels
from tests.support.compressor_oracles import attention
from vericache_kernels import PackedKV, PagedKV

HEADS, Q_HEADS, DIM, GROUP = 3, 9, 64, 32
V_GROUP = math.gcd(GROUP, DIM)
PAGES = [10, 0, 3, 0, 1]
"""Quantized pages per request; 10 pages span two reference chunks (at CHUNK_TOKENS = 256)."""
RESIDUAL = [5, 300, 0, 0, 31]
"""Residual tokens per request; 300 span two chunks; request 3 has no tokens at all."""
UNUSED = 4
"""Pool pages no request owns."""
SCALE = DIM**-0.5


@dataclass
class Case:
    """Inputs of one decode-attention call plus each request's tokens, dequantized."""

    q: torch.Tensor
    paged: PagedKV
    k_res: torch.Tensor
    v_res: torch.Tensor
    res_lengths: torch.Tensor
    keys: list[torch.Tensor]
    """Per request: [n, H, D] float32, quantized tokens (dequantized) then residual."""
    values: list[torch.Tensor]


def quantize_pages(keys: torch.Tensor, values: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """[n, H, D] K/V -> the six packed tensors in page form ([pages, ...])."""
    k_codes, k_scale, k_zero = kernels.quantize_keys(keys, GROUP, bits)
    v_parts = kernels.quantize_values(values, V_GROUP, bits)
    return (k_codes, k_scale, k_zero, *(t.reshape(-1, GROUP, *t.shape[1:]) for t in v_parts))


def dequantize_pages(k_parts: list[torch.Tensor], v_parts: list[torch.Tensor], bits: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's key groups and value tokens (layout.py) -> [n, H, D] float32 K/V."""
    return (kernels.dequantize_keys(*k_parts, bits, torch.float32),
            kernels.dequantize_values(*v_parts, bits, torch.float32))


def paged_case(bits: int) -> Case:
    """The pool and requests described above, K/V quantized at `bits`."""
    gen = torch.Generator().manual_seed(bits)
    batch = len(PAGES)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 2

    owned = [quantize_pages(randn(n * GROUP, HEADS, DIM), randn(n * GROUP, HEADS, DIM), bits)
             for n in PAGES]
    unused = quantize_pages(randn(UNUSED * GROUP, HEADS, DIM),
                            randn(UNUSED * GROUP, HEADS, DIM), bits)
    for t in unused:
        if t.is_floating_point():  # scale and zero: reading an unowned page poisons the output
            t.fill_(float("nan"))
    # Owned pages go to shuffled pool slots 1..; slot 0 stays unowned (the reference reads it
    # for table entries it ignores).
    slots = (torch.randperm(sum(PAGES) + UNUSED - 1, generator=gen) + 1).tolist()
    order = slots[: sum(PAGES)] + [0] + slots[sum(PAGES):]
    pool = []
    for parts in zip(*owned, unused, strict=True):
        pages = torch.cat(parts)  # request 0's pages, request 1's, ..., the unowned ones
        pool.append(torch.empty_like(pages).index_copy_(0, torch.tensor(order), pages))
    table = torch.full((batch, max(PAGES) + 2), -1, dtype=torch.int32)
    for b, start in enumerate(torch.tensor([0, *PAGES]).cumsum(0)[:-1].tolist()):
        table[b, : PAGES[b]] = torch.tensor(order[start : start + PAGES[b]])
    paged = PagedKV(*pool, page_table=table,
                    lengths=torch.tensor(PAGES, dtype=torch.int32) * GROUP, bits=bits,
                    group=GROUP, v_group=V_GROUP)
    k_res = torch.full((batch, max(RESIDUAL), HEADS, DIM), float("nan"))
    v_res = k_res.clone()
    keys, values = [], []
    for b, (pages, res) in enumerate(zip(owned, RESIDUAL, strict=True)):
        k_res[b, :res], v_res[b, :res] = randn(res, HEADS, DIM), randn(res, HEADS, DIM)
        dense_k, dense_v = dequantize_pages(pages[:3], [t.flatten(0, 1) for t in pages[3:]], bits)
        keys.append(torch.cat([dense_k, k_res[b, :res]]))
        values.append(torch.cat([dense_v, v_res[b, :res]]))
    return Case(randn(batch, Q_HEADS, DIM), paged, k_res, v_res, torch.tensor(RESIDUAL), keys,
                values)


def expected(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
             logit_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float32 softmax attention per request and the log-sum-exp of its logits; a
    request with no tokens: 0 and -inf."""
    outs, lses = [], []
    for q_b, k, v in zip(q, keys, values, strict=True):
        logits = torch.einsum("hd,nhd->hn", q_b, k.repeat_interleave(Q_HEADS // HEADS, 1))
        logits = logits * SCALE
        if logit_cap > 0:
            logits = logit_cap * torch.tanh(logits / logit_cap)
        lses.append(torch.logsumexp(logits, -1))
        outs.append(attention(q_b, k, v, SCALE, logit_cap) if len(k)
                    else torch.zeros(Q_HEADS, DIM))
    return torch.stack(outs), torch.stack(lses)


def assert_close(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
                 ) -> None:
    """Outputs and log-sum-exps within 1e-5; -inf log-sum-exps (empty requests) exactly."""
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-5), (g - w).abs().max()


def packed_batch(keys: torch.Tensor, values: torch.Tensor, lengths: list[int], bits: int,
                 group: int, v_group: int) -> PackedKV:
    """[B, n, H, D] K/V quantized per request into a padded `PackedKV` of the given lengths."""
    parts = [kernels.quantize_keys(k, group, bits) + kernels.quantize_values(v, v_group, bits)
             for k, v in zip(keys, values, strict=True)]
    return PackedKV(*(torch.stack(t) for t in zip(*parts, strict=True)),
                    lengths=torch.tensor(lengths, dtype=torch.int32), bits=bits, group=group,
                    v_group=v_group)


def ragged_inputs(bits: int, heads: int, group_size: int, dim: int, group: int,
                  res_dtype: torch.dtype, res: int, seed: int, spread: float = 1.0
                  ) -> tuple[torch.Tensor, PagedKV, torch.Tensor, torch.Tensor]:
    """(q, paged, k_res, v_res) for 3 requests: three key groups quantized, one, none (as
    pages), each with `res` residual tokens in `res_dtype`; K/V drawn with std `spread`."""
    gen = torch.Generator().manual_seed(seed)
    batch, groups = 3, 3
    keys = torch.randn(batch, groups * group, heads, dim, generator=gen) * spread
    values = torch.randn(batch, groups * group, heads, dim, generator=gen) * spread
    packed = packed_batch(keys, values, [groups * group, group, 0], bits, group,
                          math.gcd(group, dim)).as_paged()
    k_res = torch.randn(batch, res, heads, dim, generator=gen).to(res_dtype)
    v_res = torch.randn(batch, res, heads, dim, generator=gen).to(res_dtype)
    q = torch.randn(batch, heads * group_size, dim, generator=gen)
    return q, packed, k_res, v_res
