"""Decode attention over paged packed K/V equals plain softmax attention over the same tokens.

The case is a pool of pages, shuffled, with pages no request owns, read through a page table by
requests of different lengths: more pages than one reference chunk, residual only, quantized
only, no tokens at all. Unowned pages and padding hold NaN, so reading them would show. Each
test runs the torch reference and `vericache_kernels.decode_attention` (on CPU tensors, the C++
kernel); the Triton kernel is held to the same cases in test_triton_kernels.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import vericache_kernels as kernels
from tests.support.compressor_oracles import attention
from vericache_kernels import PackedKV, PagedKV
from vericache_kernels.attention_ref import decode_attention_ref

HEADS, Q_HEADS, DIM, GROUP = 3, 9, 64, 32
V_GROUP = math.gcd(GROUP, DIM)
PAGES = [10, 0, 3, 0, 1]
"""Quantized pages per request; 10 pages span two reference chunks (at CHUNK_TOKENS = 256)."""
RESIDUAL = [5, 300, 0, 0, 31]
"""Residual tokens per request; 300 span two chunks; request 3 has no tokens at all."""
UNUSED = 4
"""Pool pages no request owns."""
SCALE = DIM**-0.5


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 256 tokens, so these small cases walk several chunks per request."""
    monkeypatch.setattr("vericache_kernels.attention_ref.CHUNK_TOKENS", 256)


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


def _quantize(keys: torch.Tensor, values: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """[n, H, D] K/V -> the six packed tensors in page form ([pages, ...])."""
    k_codes, k_scale, k_zero = kernels.quantize_keys(keys, GROUP, bits)
    v_parts = kernels.quantize_values(values, V_GROUP, bits)
    return (k_codes, k_scale, k_zero, *(t.reshape(-1, GROUP, *t.shape[1:]) for t in v_parts))


def _dequantize(k_parts: list[torch.Tensor], v_parts: list[torch.Tensor], bits: int
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

    owned = [_quantize(randn(n * GROUP, HEADS, DIM), randn(n * GROUP, HEADS, DIM), bits)
             for n in PAGES]
    unused = _quantize(randn(UNUSED * GROUP, HEADS, DIM), randn(UNUSED * GROUP, HEADS, DIM), bits)
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
        dense_k, dense_v = _dequantize(pages[:3], [t.flatten(0, 1) for t in pages[3:]], bits)
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


BITS = [2, 4, 8]
IMPLEMENTATIONS = pytest.mark.parametrize(
    "attend", [decode_attention_ref, kernels.decode_attention], ids=["reference", "dispatch"])


@IMPLEMENTATIONS
@pytest.mark.parametrize("bits", BITS)
def test_paged_decode_attention_equals_dense_attention(attend, bits: int) -> None:
    case = paged_case(bits)
    got = attend(case.q, case.paged, case.k_res, case.v_res, case.res_lengths, SCALE)
    assert_close(got, expected(case.q, case.keys, case.values))
    assert torch.equal(got[0][3], torch.zeros(Q_HEADS, DIM)) and torch.all(got[1][3] == -math.inf)


@IMPLEMENTATIONS
@pytest.mark.parametrize("bits", BITS)
def test_merge_of_paged_part_and_exact_tail_equals_union(attend, bits: int) -> None:
    case = paged_case(bits)
    none = torch.zeros(len(PAGES), dtype=torch.int32)
    paged_part = attend(case.q, case.paged, case.k_res, case.v_res, none, SCALE)
    tail_part = attend(case.q, None, case.k_res, case.v_res, case.res_lengths, SCALE)
    assert_close(kernels.merge_attention([paged_part, tail_part]),
                 expected(case.q, case.keys, case.values))


@pytest.mark.parametrize("bits", BITS)
def test_a_capped_layer_reads_pages_residual_and_tail_with_its_cap(bits: int) -> None:
    """Softcapped logits (Gemma 2) over pages, residual and a draft tail, through the
    dispatcher: capped attention over their union, which differs from uncapped."""
    case = paged_case(bits)
    cap = 4.0
    gen = torch.Generator().manual_seed(7)
    tail_k, tail_v = (torch.randn(len(PAGES), 3, HEADS, DIM, generator=gen) for _ in range(2))
    seen = torch.full((len(PAGES), Q_HEADS), 2, dtype=torch.int32)
    got = kernels.decode_attention(case.q, case.paged, case.k_res, case.v_res,
                                   case.res_lengths, SCALE, (tail_k, tail_v, seen), cap)
    keys = [torch.cat([k, tail_k[b, :2]]) for b, k in enumerate(case.keys)]
    values = [torch.cat([v, tail_v[b, :2]]) for b, v in enumerate(case.values)]
    assert_close(got, expected(case.q, keys, values, cap))
    assert not torch.allclose(got[0], expected(case.q, keys, values)[0], atol=1e-3)


def packed_batch(keys: torch.Tensor, values: torch.Tensor, lengths: list[int], bits: int,
                 group: int, v_group: int) -> PackedKV:
    """[B, n, H, D] K/V quantized per request into a padded `PackedKV` of the given lengths."""
    parts = [kernels.quantize_keys(k, group, bits) + kernels.quantize_values(v, v_group, bits)
             for k, v in zip(keys, values, strict=True)]
    return PackedKV(*(torch.stack(t) for t in zip(*parts, strict=True)),
                    lengths=torch.tensor(lengths, dtype=torch.int32), bits=bits, group=group,
                    v_group=v_group)


@pytest.mark.parametrize("bits", BITS)
def test_packed_reads_as_its_pages(bits: int) -> None:
    """A padded PackedKV is its pages in place (no copy) and attends like its dequantized tokens."""
    gen = torch.Generator().manual_seed(bits)
    groups, lengths = 3, [3 * GROUP, GROUP, 0]
    keys, values = (torch.randn(len(lengths), groups * GROUP, HEADS, DIM, generator=gen)
                    for _ in range(2))
    packed = packed_batch(keys, values, lengths, bits, GROUP, V_GROUP)
    paged = packed.as_paged()
    assert torch.equal(paged.page_table, torch.arange(9, dtype=torch.int32).reshape(3, groups))
    for field in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"):
        assert getattr(paged, field).data_ptr() == getattr(packed, field).data_ptr()
    q = torch.randn(len(lengths), Q_HEADS, DIM, generator=gen)
    empty = torch.zeros(len(lengths), 0, HEADS, DIM)
    got = kernels.decode_attention(q, packed, empty, empty, torch.zeros(3, dtype=torch.int32),
                                   SCALE)
    key_parts = (packed.k_codes, packed.k_scale, packed.k_zero)
    value_parts = (packed.v_codes, packed.v_scale, packed.v_zero)
    dense = [_dequantize([t[b, : n // GROUP] for t in key_parts],
                         [t[b, :n] for t in value_parts], bits) for b, n in enumerate(lengths)]
    assert_close(got, expected(q, *([kv[i] for kv in dense] for i in range(2))))


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
