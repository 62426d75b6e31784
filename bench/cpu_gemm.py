"""Few-row GEMM on this CPU: the demo model's linear layers and LM head as X @ W^T (SGLang's
form) and as W @ X^T (vericache_sglang/cpu/few_rows.py), in one run.

For each row count, the products one forward of the float32 demo model runs (its real weights:
fused QKV, output, fused gate/up, down projections of every layer, then the LM head) are timed
as `F.linear` calls, once plain (X @ W^T) and once inside the worker's `few_row_linear` scope,
whose torch function mode runs on every call (its overhead counts); the best of `--repeats`
passes is kept. Drafting forwards have 1-5 rows per request, so this is the shape the
worker's few-row form is for.

    .venv/bin/python -m bench.cpu_gemm [--rows 1 2 3 4 5 6 9] [--write-docs docs/cpu.md]
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import cli
from bench.docs_section import replace_section
from vericache_sglang import models
from vericache_sglang.cpu.few_rows import ALL_ROWS, faster_row_counts, few_row_linear

SECTION = "cpu-gemm"


def forward_weights() -> list[torch.Tensor]:
    """The weight matrices of one forward, fused as SGLang fuses them, in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(models.prepare().target),
                                                 dtype=torch.float32)
    weights = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                    attn.o_proj.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    mlp.down_proj.weight]
    weights.append(model.lm_head.weight)
    return [w.detach().contiguous() for w in weights]


def time_forward(weights: list[torch.Tensor], rows: int, scope: Callable, repeats: int) -> float:
    """Best seconds over `repeats` passes of every weight's `F.linear` with `rows` input rows,
    each pass inside `scope()` (the worker's `few_row_linear`, or nothing)."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up
        with scope():
            began = time.perf_counter()
            for w in weights:
                F.linear(inputs[w.shape[1]], w)
            best = min(best, time.perf_counter() - began)
    return best


def main() -> None:
    parser = cli.parser("bench.cpu_gemm", __doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 9])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--write-docs", type=Path, help=f"docs page with a {SECTION} section")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    weights = forward_weights()
    with torch.no_grad():
        lines = ["| rows | X @ W^T (ms) | W @ X^T, few-row form (ms) | few-row / X @ W^T |",
                 "|---|---|---|---|"]
        for rows in args.rows:
            plain = time_forward(weights, rows, contextlib.nullcontext, args.repeats)
            few = time_forward(weights, rows, lambda: few_row_linear("cpu", ALL_ROWS),
                               args.repeats)
            lines.append(f"| {rows} | {plain * 1e3:.1f} | {few * 1e3:.1f} | {few / plain:.2f} |")
            print(lines[-1], flush=True)
    mb = sum(w.numel() * w.element_size() for w in weights) / 2**20
    routed = ", ".join(map(str, sorted(faster_row_counts())))
    body = (f"Measured by `python -m bench.cpu_gemm` (the demo model's {len(weights)} weight "
            f"matrices of one forward, {mb:.0f} MiB float32, {args.threads} threads, best of "
            f"{args.repeats}, one run on this CPU; rows above the few-row form's limit run as "
            "X @ W^T in both columns):\n\n" + "\n".join(lines)
            + "\n\nThe worker's own timing on this CPU (`faster_row_counts`) routes "
            + (f"{routed} rows" if routed else "no row count") + " through the few-row form.")
    print(body)
    if args.write_docs:
        replace_section(args.write_docs, SECTION, f"\n{body}\n")


if __name__ == "__main__":
    main()
