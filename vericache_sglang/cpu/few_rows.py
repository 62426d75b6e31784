"""Linear layers over a few rows on CPU: computed as W @ X^T instead of X @ W^T.

Why: drafting runs the target model over 1-5 rows per request (one row per step at level 1,
a step plus a few proposals with a level-2 drafter). Float32 MKL GEMM on this project's CPUs
(AMD EPYC, 2 threads) streams the weights slowly in that shape: one SmolLM2-135M forward's
linear layers and LM head took 49 ms for one row, 94 ms for two and 110 ms for three, and
28-39 ms as W @ X^T with an even number of columns (`python -m bench.cpu_gemm` measures both
on the machine it runs on; docs/cpu.md). Results equal X @ W^T's
up to float32 summation order, so only forwards whose output is checked again may use it: the
worker enters `few_row_linear` for level-1 drafting and the draft model, never for
verification or prefill, which keep SGLang's own GEMM and so plain SGLang's numerics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MAX_ROWS = 5
"""Up to this many rows the W @ X^T form is used. Its gain is gone at 5 rows (`bench.cpu_gemm`:
0.94x-1.00x); forced on 6-36 rows in a one-off measure it was no faster than X @ W^T."""

_MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__})
"""The calls SGLang's LM head makes (`hidden @ weight.T`); looked up on every torch call."""


def few_row_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight^T as weight @ x^T for float32 CPU inputs of 1..MAX_ROWS rows (an odd count
    padded by repeating the last row: MKL's two-column kernels are the fast ones); None where
    the input is not of that shape, so the caller runs the ordinary product."""
    if (not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor)
            or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or weight.dim() != 2 or not weight.is_contiguous() or x.dim() == 0
            or x.shape[-1] != weight.shape[1]
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None
    rows = x.numel() // weight.shape[1]
    if not 1 <= rows <= MAX_ROWS:
        return None
    flat = x.reshape(rows, weight.shape[1])
    if rows % 2:
        flat = torch.cat([flat, flat[-1:]])
    out = torch.mm(weight, flat.t())[:, :rows].t().contiguous()
    return out.reshape(*x.shape[:-1], weight.shape[0])


class _FewRowLinear(TorchFunctionMode):
    """Routes `F.linear(x, W, b)` and `x @ W.T` (SGLang's LM head) through
    `few_row_product`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = None
        if func is F.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = few_row_product(args[0], args[1])
            if out is not None and bias is not None:
                out += bias
        elif (func in _MATMULS and not kwargs and len(args) == 2
              and isinstance(args[1], torch.Tensor) and args[1].dim() == 2):
            out = few_row_product(args[0], args[1].t())
        return func(*args, **kwargs) if out is None else out


@contextlib.contextmanager
def few_row_linear(device: torch.device | str) -> Iterator[None]:
    """Inside: few-row linear layers on `device` take the faster form (CPU only)."""
    if torch.device(device).type != "cpu":
        yield
        return
    with _FewRowLinear():
        yield
