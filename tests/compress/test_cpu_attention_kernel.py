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
from vericache_kernels import attention_cpu
from vericache_kernels.attention_ref import decode_attention_ref

from .test_paged_attention import packed_batch


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
    gen = torch.Generator().manual_seed(bits * 7 + dim + group)
    batch, groups, res = 3, 3, 45  # residuals longer than one 32-token tile
    keys = torch.randn(batch, groups * group, heads, dim, generator=gen) * 2
    values = torch.randn(batch, groups * group, heads, dim, generator=gen) * 2
    # ragged requests: full, one group, nothing quantized
    packed = packed_batch(keys, values, [groups * group, group, 0], bits, group,
                          math.gcd(group, dim)).as_paged()
    k_res = torch.randn(batch, res, heads, dim, generator=gen).to(res_dtype)
    v_res = torch.randn(batch, res, heads, dim, generator=gen).to(res_dtype)
    q = torch.randn(batch, heads * group_size, dim, generator=gen)
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
    q = torch.randn(rows, heads, per_head, dim, generator=gen)  # [row, KV head, its heads, D]
    stacked = q.permute(1, 0, 2, 3).reshape(1, heads * rows * per_head, dim)
    out, lse = attention_cpu.decode_attention_cpu(stacked, paged, k_res, v_res, lengths, 0.125)
    out = out.reshape(heads, rows, per_head, dim).permute(1, 0, 2, 3)
    lse = lse.reshape(heads, rows, per_head).permute(1, 0, 2)
    for r in range(rows):
        alone = attention_cpu.decode_attention_cpu(q[r].reshape(1, -1, dim), paged, k_res,
                                                   v_res, lengths, 0.125)
        assert torch.equal(out[r].reshape(1, -1, dim), alone[0])
        assert torch.equal(lse[r].reshape(1, -1), alone[1])
