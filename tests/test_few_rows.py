"""The few-row GEMM form drafting forwards take on CPU (vericache_sglang/cpu/few_rows.py): the
same products as SGLang's linear layers and LM head up to float32 summation order, only for the
shapes it is meant for, and nothing else changed inside its scope."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vericache_sglang.cpu import few_rows
from vericache_sglang.cpu.few_rows import MAX_ROWS, few_row_linear, few_row_product


@pytest.fixture
def routed(monkeypatch):
    """Records, per product the mode sees, whether the few-row form computed it."""
    seen: list[bool] = []

    def spy(x, weight):
        out = few_row_product(x, weight)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(few_rows, "few_row_product", spy)
    return seen


@pytest.mark.parametrize("shape", [(1, 96), (2, 96), (3, 96), (MAX_ROWS, 96), (1, 3, 96),
                                   (2, 2, 96)])
def test_equals_linear_and_lm_head(shape, routed):
    torch.manual_seed(0)
    weight, bias = torch.randn(200, 96), torch.randn(200)
    x = torch.randn(*shape)
    with few_row_linear("cpu"):
        linear = F.linear(x, weight, bias)
        head = torch.matmul(x, weight.T)  # SGLang's LM head
        head_op = x @ weight.T
    assert routed == [True, True, True]
    for got, want in [(linear, F.linear(x, weight, bias)), (head, x @ weight.T),
                      (head_op, x @ weight.T)]:
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["many rows", "bfloat16", "grad"])
def test_other_products_run_as_before(case, routed):
    torch.manual_seed(0)
    x, weight = torch.randn(3, 64), torch.randn(32, 64)
    if case == "many rows":
        x = torch.randn(MAX_ROWS + 1, 64)
    elif case == "bfloat16":
        x, weight = x.bfloat16(), weight.bfloat16()
    elif case == "grad":
        weight.requires_grad_(True)
    with few_row_linear("cpu"):
        out = F.linear(x, weight)
        vector = x @ weight[0].detach()  # not a weight matrix: not a candidate
    assert routed == [False]
    assert torch.equal(out, F.linear(x, weight))
    assert torch.equal(vector, x @ weight[0].detach())
    if case == "grad":  # autograd still flows through the ordinary product
        out.sum().backward()
        assert weight.grad is not None


def test_only_inside_the_scope_and_only_on_cpu(routed):
    x, weight = torch.randn(2, 16), torch.randn(8, 16)
    F.linear(x, weight)
    with few_row_linear("cuda"):
        F.linear(x, weight)
    assert routed == []
    with few_row_linear(torch.device("cpu")):
        F.linear(x, weight)
    F.linear(x, weight)
    assert routed == [True]
