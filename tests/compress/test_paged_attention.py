"""Decode attention over paged packed K/V equals plain softmax attention over the same tokens.

The case is a pool of pages, shuffled, with pages no request owns, read through a page table by
requests of different lengths: more pages than one reference chunk, residual only, quantized
only, no tokens at all. Unowned pages and padding hold NaN, so reading them would show. Each
test runs the torch reference and `vericache_kernels.decode_attention` (on CPU tensors, the C++
kernel); the Triton kernel is held to the same cases in test_triton_kernels.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import vericache_kernels as kernels
from tests.support.paged_cases import (
    DIM,
    GROUP,
    HEADS,
    PAGES,
    Q_HEADS,
    SCALE,
    V_GROUP,
    assert_close,
    dequantize_pages,
    expected,
    packed_batch,
    paged_case,
)
from vericache_kernels.attention_ref import decode_attention_ref


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 256 tokens, so these small cases walk several chunks per request."""
    monkeypatch.setattr("vericache_kernels.attention_ref.CHUNK_TOKENS", 256)


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
    dense = [dequantize_pages([t[b, : n // GROUP] for t in key_parts],
                         [t[b, :n] for t in value_parts], bits) for b, n in enumerate(lengths)]
    assert_close(got, expected(q, *([kv[i] for kv in dense] for i in range(2))))
