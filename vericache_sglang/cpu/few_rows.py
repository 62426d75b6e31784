"""Linear layers over a few rows on CPU: computed as W @ X^T instead of X @ W^T.

Why: drafting runs the target model over 1-5 rows per request (one row per step at level 1,
a step plus a few proposals with a level-2 drafter). Float32 MKL GEMM on this project's CPUs
(AMD EPYC, 2 threads) streams the weights slowly in that shape: one SmolLM2-135M forward's
linear layers and LM head took 49 ms for one row, 94 ms for two and 110 ms for three, and
28-39 ms as W @ X^T with an even number of columns (`python -m bench.cpu_gemm` measures both
on the machine it runs on; docs/cpu.md). On an AVX-512/AMX Xeon the same products run the
other way round: X @ W^T took 19-36 ms at 1-5 rows, W @ X^T 51-55 ms. So the form is chosen per
row count by timing both once per process (`faster_row_counts`). Results equal X @ W^T's
up to float32 summation order, so only forwards whose output is checked again may use it: the
worker enters `few_row_linear` for level-1 drafting and the draft model, never for
verification or prefill, which keep SGLang's own GEMM and so plain SGLang's numerics.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Collection, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MAX_ROWS = 5
"""Up to this many rows the W @ X^T form is used. Its gain is gone at 5 rows (`bench.cpu_gemm`:
0.94x-1.00x); forced on 6-36 rows in a one-off measure it was no faster than X @ W^T."""

_MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__})
"""The calls SGLang's LM head makes (`hidden @ weight.T`); looked up on every torch call."""


ALL_ROWS = frozenset(range(1, MAX_ROWS + 1))
CALIBRATION_SHAPES = ((1536, 576), (576, 1536), (49152, 576))
"""Weight shapes `faster_row_counts` times: the demo model's MLP projections and LM head (the
head, 113 MB, streams from memory as a forward's weights do)."""


def few_row_product(x: torch.Tensor, weight: torch.Tensor,
                    rows_allowed: Collection[int] = ALL_ROWS) -> torch.Tensor | None:
    """x @ weight^T as weight @ x^T for float32 CPU inputs of a row count in `rows_allowed`
    (at most MAX_ROWS; an odd count padded by repeating the last row: MKL's two-column kernels
    are the fast ones); None where the input is not of that shape, so the caller runs the
    ordinary product."""
    if (not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor)
            or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or weight.dim() != 2 or not weight.is_contiguous() or x.dim() == 0
            or x.shape[-1] != weight.shape[1]
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None
    rows = x.numel() // weight.shape[1]
    if not 1 <= rows <= MAX_ROWS or rows not in rows_allowed:
        return None
    flat = x.reshape(rows, weight.shape[1])
    if rows % 2:
        flat = torch.cat([flat, flat[-1:]])
    out = torch.mm(weight, flat.t())[:, :rows].t().contiguous()
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _best_seconds(product: Callable[[torch.Tensor, torch.Tensor], object],
                  xs: list[torch.Tensor], weights: list[torch.Tensor], repeats: int) -> float:
    """Fastest of `repeats` timed passes (after one untimed) of `product` over the pairs."""
    best = float("inf")
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        for x, w in zip(xs, weights, strict=True):
            product(x, w)
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def faster_row_counts(repeats: int = 3) -> frozenset[int]:
    """The row counts at which W @ X^T beats X @ W^T by 10% on this CPU with torch's current
    threads, timed once per process on `CALIBRATION_SHAPES` (random weights; well under a
    second here). Which form MKL runs faster depends on the CPU, so it is measured, not
    assumed."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) for shape in CALIBRATION_SHAPES]
    faster = set()
    for rows in sorted(ALL_ROWS):
        xs = [torch.randn(rows, w.shape[1], generator=generator) for w in weights]
        plain = _best_seconds(F.linear, xs, weights, repeats)
        if _best_seconds(few_row_product, xs, weights, repeats) < 0.9 * plain:
            faster.add(rows)
    return frozenset(faster)


class _FewRowLinear(TorchFunctionMode):
    """Routes `F.linear(x, W, b)` and `x @ W.T` (SGLang's LM head) over `rows` rows through
    `few_row_product`."""

    def __init__(self, rows: frozenset[int]) -> None:
        super().__init__()
        self.rows = rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = None
        if func is F.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = few_row_product(args[0], args[1], self.rows)
            if out is not None and bias is not None:
                out += bias
        elif (func in _MATMULS and not kwargs and len(args) == 2
              and isinstance(args[1], torch.Tensor) and args[1].dim() == 2):
            out = few_row_product(args[0], args[1].t(), self.rows)
        return func(*args, **kwargs) if out is None else out


@contextlib.contextmanager
def few_row_linear(device: torch.device | str,
                   rows: Collection[int] | None = None) -> Iterator[None]:
    """Inside: linear layers on `device` over `rows` rows (default: `faster_row_counts()`)
    take the W @ X^T form (CPU only). Where no row count is faster, nothing is routed and the
    forward pays no function-mode overhead."""
    rows = frozenset(faster_row_counts() if rows is None else rows)
    if torch.device(device).type != "cpu" or not rows:
        yield
        return
    with _FewRowLinear(rows):
        yield
