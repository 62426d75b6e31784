"""The C++ CPU decode-attention kernel equals its torch reference, and serves the dispatch.

test_paged_attention.py runs both on the NaN-poisoned shuffled pool; here, the shapes the Triton
kernel is tested on (odd head dims, tiny and large groups, GQA widths, bf16 residuals) and the
property multi-row drafting relies on: a query row's result does not depend on what else is in
the call.
"""

from __future__ import annotations

import math

import pytest
import torch

import vericache_kernels
from tests.support.paged_cases import packed_batch, ragged_inputs
from vericache_kernels import attention_cpu
from vericache_kernels.attention_ref import (
    decode_attention_ref,
    merge_attention,
    tail_attention_ref,
)


def test_the_kernel_is_built_and_serves_cpu_tensors(monkeypatch) -> None:
    """setup.sh builds it; the dispatch must use it for CPU tensors, not the reference."""
    assert attention_cpu.load() is not None
    monkeypatch.setattr(vericache_kernels, "decode_attention_ref", None)  # would raise if used
    q, kv = torch.randn(1, 2, 8), torch.randn(1, 3, 1, 8)
    out, lse = vericache_kernels.decode_attention(q, None, kv, kv, torch.tensor([3]), 0.5)
    want = decode_attention_ref(q, None, kv, kv, torch.tensor([3]), 0.5)
    assert torch.allclose(out, want[0], atol=1e-6) and torch.allclose(lse, want[1], atol=1e-6)


@pytest.mark.parametrize(("bits", "heads", "group_size", "dim", "group"),
                         [(2, 2, 3, 24, 8), (4, 1, 4, 16, 4), (8, 3, 1, 32, 16),
                          (4, 3, 12, 64, 32), (4, 2, 5, 96, 64), (2, 1, 2, 40, 48)])
@pytest.mark.parametrize("res_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_equals_reference(bits, heads, group_size, dim, group, res_dtype) -> None:
    res = 45  # residuals longer than one 32-token tile
    q, packed, k_res, v_res = ragged_inputs(bits, heads, group_size, dim, group, res_dtype, res,
                                            seed=bits * 7 + dim + group, spread=2.0)
    for quant_part, res_lengths in ((packed, [res, 33, 0]), (None, [0, res, 3])):
        lengths = torch.tensor(res_lengths, dtype=torch.int32)
        got = attention_cpu.decode_attention_cpu(q, quant_part, k_res, v_res, lengths, 0.3)
        want = decode_attention_ref(q, quant_part, k_res, v_res, lengths, 0.3)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.float32 and g.shape == w.shape
            # float32 sums in another order: (q * scale) . codes + q . zero, not q . keys
            assert torch.allclose(g, w, atol=3e-5, rtol=3e-5), (g - w).abs().max()
    # the last call's request 0 has no tokens: 0 and -inf
    assert torch.equal(got[0][0], torch.zeros_like(got[0][0]))
    assert torch.all(got[1][0] == -math.inf)


@pytest.mark.parametrize("with_pages", [True, False], ids=["pages", "no pages"])
def test_a_tail_seen_per_query_head_equals_the_merged_parts(with_pages: bool,
                                                            monkeypatch) -> None:
    """The round's drafts in the same call, query head j seeing the first head_lengths[j] of
    them, equal the prefix and the tail attended apart and merged (what the dispatch does
    without the kernel); slots no head sees hold NaN and a head that sees no token at all gets
    0 and -inf."""
    gen = torch.Generator().manual_seed(11)
    batch, heads, per_head, dim, group, steps = 3, 2, 6, 64, 32, 9
    keys, values = (torch.randn(batch, 2 * group, heads, dim, generator=gen) for _ in range(2))
    paged = packed_batch(keys, values, [2 * group, group, 0], 4, group, 32).as_paged() \
        if with_pages else None
    k_res, v_res = (torch.randn(batch, 40, heads, dim, generator=gen) for _ in range(2))
    res_lengths = torch.tensor([40, 0, 0], dtype=torch.int32)
    tail_k, tail_v = (torch.randn(batch, steps + 3, heads, dim, generator=gen)
                      for _ in range(2))
    head_lengths = torch.randint(1, steps + 1, (batch, heads * per_head), generator=gen,
                                 dtype=torch.int32)
    head_lengths[2, :per_head] = 0  # request 2's first KV head's queries: nothing at all
    for b in range(batch):
        seen = int(head_lengths[b].max())
        tail_k[b, seen:] = tail_v[b, seen:] = float("nan")
    q = torch.randn(batch, heads * per_head, dim, generator=gen)
    tail = (tail_k, tail_v, head_lengths)
    got = attention_cpu.decode_attention_cpu(q, paged, k_res, v_res, res_lengths, 0.2, tail)
    want = merge_attention([decode_attention_ref(q, paged, k_res, v_res, res_lengths, 0.2),
                            tail_attention_ref(q, *tail, 0.2)])
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=3e-5, rtol=3e-5), (g - w).abs().max()
    if not with_pages:
        assert torch.equal(got[0][2, :per_head], torch.zeros(per_head, dim))
        assert torch.all(got[1][2, :per_head] == -math.inf)
    assert torch.equal(vericache_kernels.decode_attention(q, paged, k_res, v_res, res_lengths,
                                                          0.2, tail)[0], got[0])
    monkeypatch.setattr(vericache_kernels, "decode_attention_cpu", lambda *args: None)
    fallback = vericache_kernels.decode_attention(q, paged, k_res, v_res, res_lengths, 0.2, tail)
    for g, w in zip(fallback, want, strict=True):
        assert torch.equal(g, w)


def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    """Level 1 checks a request's proposals in one forward, its rows stacked as extra query
    heads of each KV head (draft.py's `_RowGroups`); each row must get exactly what a forward
    of that row alone gets, so that the drafts are those of one-token steps."""
    gen = torch.Generator().manual_seed(3)
    heads, per_head, dim, group, rows = 3, 3, 64, 32, 4
    keys, values = (torch.randn(1, 10 * group, heads, dim, generator=gen) for _ in range(2))
    paged = packed_batch(keys, values, [10 * group], 4, group, 32).as_paged()
    k_res, v_res = (torch.randn(1, 70, heads, dim, generator=gen) for _ in range(2))
    lengths = torch.tensor([70], dtype=torch.int32)
    tail_k, tail_v = (torch.randn(1, rows, heads, dim, generator=gen) for _ in range(2))
    q = torch.randn(rows, heads, per_head, dim, generator=gen)  # [row, KV head, its heads, D]
    stacked = q.permute(1, 0, 2, 3).reshape(1, heads * rows * per_head, dim)
    # row r sees the round's tokens 0..r
    seen = torch.arange(1, rows + 1, dtype=torch.int32)[None, :, None].expand(heads, -1, per_head)
    out, lse = attention_cpu.decode_attention_cpu(stacked, paged, k_res, v_res, lengths, 0.125,
                                                  (tail_k, tail_v, seen.reshape(1, -1)))
    out = out.reshape(heads, rows, per_head, dim).permute(1, 0, 2, 3)
    lse = lse.reshape(heads, rows, per_head).permute(1, 0, 2)
    for r in range(rows):
        own = torch.full((1, heads * per_head), r + 1, dtype=torch.int32)
        alone = attention_cpu.decode_attention_cpu(q[r].reshape(1, -1, dim), paged, k_res,
                                                   v_res, lengths, 0.125, (tail_k, tail_v, own))
        assert torch.equal(out[r].reshape(1, -1, dim), alone[0])
        assert torch.equal(lse[r].reshape(1, -1), alone[1])
