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

from bench import cli, tables
from bench.docs_section import replace_section
from vericache_sglang import models
from vericache_sglang.cpu.few_rows import ALL_ROWS, faster_row_counts, few_row_linear
from vericache_tools.hf_eval import load_model

SECTION = "cpu-gemm"


def forward_weights(model) -> list[torch.Tensor]:
    """The weight matrices of one forward of the HF `model`, fused as SGLang fuses them."""
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


@torch.no_grad()
def measure(weights: list[torch.Tensor], rows: tuple[int, ...], repeats: int) -> dict:
    """Both forms' best milliseconds per row count with torch's current threads, and the row
    counts the worker's own timing routes through the few-row form."""
    timed = []
    for count in rows:
        plain = time_forward(weights, count, contextlib.nullcontext, repeats)
        few = time_forward(weights, count, lambda: few_row_linear("cpu", ALL_ROWS), repeats)
        timed.append({"rows": count, "plain_ms": plain * 1e3, "few_row_ms": few * 1e3})
        cli.log(f"cpu_gemm: {count} rows: {plain * 1e3:.1f} ms plain, {few * 1e3:.1f} ms few-row")
    return {"matrices": len(weights),
            "mib": sum(w.numel() * w.element_size() for w in weights) / 2**20,
            "threads": torch.get_num_threads(), "repeats": repeats, "rows": timed,
            "routed": sorted(faster_row_counts())}


def markdown(result: dict) -> str:
    """The table, with what it measured and what the worker routes."""
    routed = ", ".join(map(str, result["routed"]))
    return (f"Measured by `python -m bench.cpu_gemm` (the demo model's {result['matrices']} "
            f"weight matrices of one forward, {result['mib']:.0f} MiB float32, "
            f"{result['threads']} threads, best of {result['repeats']}, one run on this CPU; "
            "rows above the few-row form's limit run as X @ W^T in both columns):\n\n"
            + tables.table(["rows", "X @ W^T (ms)", "W @ X^T, few-row form (ms)",
                            "few-row / X @ W^T"],
                           [[r["rows"], f"{r['plain_ms']:.1f}", f"{r['few_row_ms']:.1f}",
                             f"{r['few_row_ms'] / r['plain_ms']:.2f}"] for r in result["rows"]])
            + "\n\nThe worker's own timing on this CPU (`faster_row_counts`) routes "
            + (f"{routed} rows" if routed else "no row count") + " through the few-row form.")


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.cpu_gemm", __doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 9])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--write-docs", type=Path, help=f"docs page with a {SECTION} section")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, _ = load_model(models.prepare().target)
    with cli.threads(args.threads):
        body = markdown(measure(forward_weights(model), tuple(args.rows), args.repeats))
    print(body)
    if args.write_docs:
        replace_section(args.write_docs, SECTION, f"\n{body}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
