"""The few-row GEMM form drafting forwards take on CPU (vericache_sglang/cpu/few_rows.py): the
same products as SGLang's linear layers and LM head up to float32 summation order, only for the
shapes it is meant for, and nothing else changed inside its scope."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vericache_sglang.cpu import few_rows
from vericache_sglang.cpu.few_rows import (
    ALL_ROWS,
    MAX_ROWS,
    faster_row_counts,
    few_row_linear,
    few_row_product,
)


@pytest.fixture
def routed(monkeypatch):
    """Records, per product the mode sees, whether the few-row form computed it."""
    seen: list[bool] = []

    def spy(x, weight, rows_allowed=ALL_ROWS):
        out = few_row_product(x, weight, rows_allowed)
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
    with few_row_linear("cpu", ALL_ROWS):
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
    with few_row_linear("cpu", ALL_ROWS):
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
    with few_row_linear("cuda", ALL_ROWS):
        F.linear(x, weight)
    assert routed == []
    with few_row_linear(torch.device("cpu"), ALL_ROWS):
        F.linear(x, weight)
    F.linear(x, weight)
    assert routed == [True]


def test_only_the_row_counts_given(routed):
    """The scope routes the row counts it is given and leaves the others to X @ W^T; given
    none, it routes nothing."""
    weight = torch.randn(8, 16)
    with few_row_linear("cpu", {2}):
        F.linear(torch.randn(1, 16), weight)
        F.linear(torch.randn(2, 16), weight)
    with few_row_linear("cpu", set()):
        F.linear(torch.randn(2, 16), weight)
    assert routed == [False, True]


def test_the_default_row_counts_are_measured_once():
    """The default is this CPU's measurement: a subset of 1..MAX_ROWS, taken once."""
    rows = faster_row_counts()
    assert rows <= ALL_ROWS
    assert faster_row_counts() is rows
