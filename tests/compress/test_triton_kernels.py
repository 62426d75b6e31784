"""The Triton kernels equal their torch references, run by Triton's interpreter on CPU tensors.

Triton fixes interpreted vs compiled execution when `triton.language` and each kernel are
decorated, i.e. at import, so TRITON_INTERPRET=1 must be set before triton is first imported.
A normal run therefore re-runs this file in a subprocess with it set; there, the tests below
run and check that the kernels really are interpreter functions.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.support.interpreter import interpreter_only, rerun_under_interpreter  # noqa: E402
from tests.support.paged_cases import (  # noqa: E402
    SCALE,
    assert_close,
    paged_case,
    ragged_inputs,
)
from vericache_kernels.attention_ref import (  # noqa: E402
    decode_attention_ref,
    merge_attention,
    tail_attention_ref,
)
from vericache_kernels.quant_ref import dequantize_unpack_ref, quantize_pack_ref  # noqa: E402


def test_kernels_under_the_interpreter() -> None:
    rerun_under_interpreter(__file__)


@pytest.fixture(scope="module")
def interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    from vericache_kernels import attention_triton, quant_triton

    for kernel in (quant_triton._quantize_pack_kernel, quant_triton._dequantize_kernel,
                   attention_triton._decode_attention_kernel,
                   attention_triton._merge_splits_kernel):
        assert isinstance(kernel, InterpretedFunction)
    return quant_triton, attention_triton


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MMA = pytest.mark.parametrize("mma", [False, True], ids=["fma", "mma"])
"""Both inner paths: CUDA-core products per token block, tl.dot over whole pages."""


@interpreter_only
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "length", "group"), [(37, 48, 12), (5, 64, 64), (0, 16, 8)])
def test_quantize_and_dequantize_equal_reference(interpreted, bits, dtype, rows, length, group):
    quant, _ = interpreted
    gen = torch.Generator().manual_seed(rows * 131 + length + bits)
    x = (torch.randn(rows, length, generator=gen) * 3).to(dtype)
    if rows:
        x[0, :group] = 1.5  # a constant group: zero scale
    got = quant.quantize_pack_triton(x, group, bits)
    want = quantize_pack_ref(x, group, bits)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert torch.equal(quant.dequantize_unpack_triton(*want, group, bits, dtype),
                       dequantize_unpack_ref(*want, group, bits, dtype))


@interpreter_only
@pytest.mark.parametrize(("bits", "heads", "group_size", "dim", "group"),
                         [(2, 2, 3, 24, 8), (4, 1, 4, 16, 4), (8, 3, 1, 32, 16)])
@pytest.mark.parametrize("res_dtype", [torch.float32, torch.bfloat16], ids=str)
@MMA
def test_decode_attention_equals_reference(interpreted, bits, heads, group_size, dim, group,
                                           res_dtype, mma):
    _, attn = interpreted
    res = 5
    q, packed, k_res, v_res = ragged_inputs(bits, heads, group_size, dim, group, res_dtype, res,
                                            seed=bits * 7 + dim)
    for quant_part, res_lengths in ((packed, [res, 2, 0]), (None, [0, res, 3])):
        lengths = torch.tensor(res_lengths)
        got = attn.decode_attention_triton(q, quant_part, k_res, v_res, lengths, 0.3, mma=mma)
        want = decode_attention_ref(q, quant_part, k_res, v_res, lengths, 0.3)
        assert torch.allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
        assert torch.allclose(got[1], want[1], atol=1e-5, rtol=1e-5)
    empty = torch.isinf(want[1])
    assert empty.any() and torch.equal(got[0][empty.nonzero()[:, 0]],
                                       torch.zeros_like(got[0][empty.nonzero()[:, 0]]))


@interpreter_only
@pytest.mark.parametrize("bits", [2, 4, 8])
@MMA
def test_paged_decode_attention_equals_reference(interpreted, bits, mma):
    """The shuffled pool of test_paged_attention: pages found through the table, none other read."""
    _, attn = interpreted
    case = paged_case(bits)
    args = (case.q, case.paged, case.k_res, case.v_res, case.res_lengths, SCALE)
    assert_close(attn.decode_attention_triton(*args, mma=mma), decode_attention_ref(*args))


@interpreter_only
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [1, 4])
@MMA
def test_tail_in_the_launch_equals_the_reference_merge(interpreted, bits, group_size, mma):
    """Pages + residual + a tail whose query heads see different counts (0 too), in one launch,
    equal the reference parts merged; request 2 has nothing at all, and tail slots no head
    sees hold NaN (a round's unwritten scratch), so reading one would show."""
    _, attn = interpreted
    heads, dim, draft = 2, 16, 3
    q, paged, k_res, v_res = ragged_inputs(bits, heads, group_size, dim, 4, torch.bfloat16, 5,
                                           seed=bits + group_size)
    res_lengths = torch.tensor([5, 2, 0])
    gen = torch.Generator().manual_seed(bits)
    tail_k, tail_v = (torch.randn(3, draft, heads, dim, generator=gen).to(torch.bfloat16)
                      for _ in range(2))
    q_heads = heads * group_size
    sees = torch.randint(0, draft + 1, (3, q_heads), generator=gen, dtype=torch.int32)
    sees[0, 0] = 0
    sees[1] = torch.arange(q_heads) % draft  # a GQA group's heads see 0, 1, 2, 0
    sees[2] = 0
    for b in range(3):
        tail_k[b, sees[b].max():] = tail_v[b, sees[b].max():] = float("nan")
    tail = (tail_k, tail_v, sees)
    want = merge_attention([decode_attention_ref(q, paged, k_res, v_res, res_lengths, 0.3),
                            tail_attention_ref(q, *tail, 0.3)])
    for splits, block_n in ((1, 16), (3, 32), (None, 64)):
        got = attn.decode_attention_triton(q, paged, k_res, v_res, res_lengths, 0.3, tail,
                                           num_splits=splits, block_n=block_n, mma=mma)
        assert_close(got, want)
    assert torch.equal(got[0][2], torch.zeros_like(got[0][2]))
    assert torch.all(got[1][2] == float("-inf"))


@interpreter_only
@pytest.mark.parametrize("splits", [1, 3])
@MMA
def test_split_context_equals_reference(interpreted, splits, mma):
    """The shuffled pool cut into splits: ranges that straddle pages and the residual, and
    splits with no token (short and empty requests), merge to the reference. The default
    (2 splits on this pool) runs in test_paged_decode_attention_equals_reference."""
    _, attn = interpreted
    case = paged_case(4)
    args = (case.q, case.paged, case.k_res, case.v_res, case.res_lengths, SCALE)
    assert_close(attn.decode_attention_triton(*args, num_splits=splits, mma=mma),
                 decode_attention_ref(*args))


@interpreter_only
def test_default_splits_fill_the_gpu(interpreted):
    """About two programs per SM on a long context, one split on a short one, at most 64."""
    _, attn = interpreted
    assert attn.default_num_splits(8, 32768, 132) == 33  # batch 1, 8 KV heads
    assert attn.default_num_splits(256, 32768, 132) == 2
    assert attn.default_num_splits(1, 10**6, 132) == attn.MAX_SPLITS
    assert attn.default_num_splits(8, 500, 132) == 1


@interpreter_only
def test_drafting_over_the_pool_through_the_kernel_equals_the_reference(interpreted,
                                                                        monkeypatch) -> None:
    """The drafting backend over the shared compressed pool (pages, exact window, draft tail)
    gives the same attention whether its reads run in the Triton kernel or the CPU kernel (which
    tests/tiers holds equal to each request's dequantized KIVI block)."""
    import vericache_kernels
    from tests.support.compressed_pool import Setup

    _, attention_triton = interpreted
    setup = Setup("kivi:bits=4", slots=2600, requests=3, context=1200)
    gen = torch.Generator().manual_seed(7)
    committed = [1000, 150, 700]
    for row, n in zip(range(1, 4), committed, strict=True):
        setup.request(row, torch.randint(0, 49152, (n,), generator=gen).tolist())
    expected = setup.draft_step(setup.backend, [1, 2, 3], committed)

    # the dispatch's CPU path, with Triton in the CPU kernel's place: as on CUDA, the pages,
    # exact window and round's tail in one launch
    monkeypatch.setattr(vericache_kernels, "decode_attention_cpu",
                        attention_triton.decode_attention_triton)
    outs = setup.draft_step(setup.backend, [1, 2, 3], committed)
    for out, ref in zip(outs, expected, strict=True):
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()
