"""Quality of each KV compressor on the demo model over real long inputs.

For every prompt (a Python stdlib source or a license text, cut to a token count) the model
prefills the prompt once in float32; then, per compressor spec:

  ratio     bf16 bytes of the prompt KV over the compressor's bytes (all layers);
  attn err  relative error ||o - o_full|| / ||o_full|| of the attention output, for the real
            queries of the first --error-steps decode steps, every layer and query head, when the
            prompt KV is read compressed (the decoded tokens' own K/V stay exact);
  matched   greedy tokens that decoding with only the compressed KV (new tokens appended
            through the compressor) produces before its first divergence from full-KV decoding,
            out of --new-tokens.

Not a test: it prints progress and a markdown table, and with --write-docs puts the table and
the exact command into the marked section of docs/compressors.md.

    .venv/bin/python -m bench.compress_quality --threads 1 --write-docs docs/compressors.md
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import vericache_kernels as kernels
from bench import cli
from bench.cli import log
from bench.docs_section import replace_section
from bench.serving import first_difference
from vericache_sglang.compress import Compressor, parse_compressor_spec
from vericache_tools.hf_eval import (
    LayerKV,
    StepRecord,
    greedy_compressed,
    greedy_full,
    load_model,
    prefill,
)
from vericache_tools.prompts import LICENSES_DIR, STDLIB_DIR, file_ids

DEFAULT_FILES = [
    str(STDLIB_DIR / "argparse.py"),
    str(STDLIB_DIR / "textwrap.py"),
    str(LICENSES_DIR / "GPL-3"),
    str(STDLIB_DIR / "difflib.py"),
]
DEFAULT_SPECS = [
    "streaming:ratio=1.0",  # control: keeps everything, so it must match all tokens
    "kivi:bits=8",
    "kivi:bits=4",
    "kivi:bits=2",
    "kivi_mixed",
    "streaming:ratio=0.5",
    "streaming:ratio=0.2",
    "snapkv:ratio=0.5",
    "snapkv:ratio=0.2",
    "h2o:ratio=0.5",
    "h2o:ratio=0.2",
    "snapkv:ratio=0.5+kivi:bits=4",
    "snapkv:ratio=0.2+kivi:bits=4",
]
SECTION = "compress_quality"


@dataclass
class Row:
    """Per-compressor results accumulated over prompts."""

    compressor: Compressor
    bf16_bytes: int = 0
    bytes: float = 0.0
    errors: list[float] = field(default_factory=list)
    matched: list[int] = field(default_factory=list)


def compressed_bytes(c: Compressor, layers: list[LayerKV]) -> tuple[int, float]:
    """(bf16 bytes, compressed bytes) of the prompt KV over all layers, at bf16 storage."""
    tokens, heads, dim = layers[0].keys.shape
    bf16 = 2 * 2 * tokens * heads * dim
    return bf16 * len(layers), sum(bf16 / c.ratio_vs_bf16(tokens, heads, dim, layer=i)
                                   for i in range(len(layers)))


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float):
    """Decode attention of q [Hq, D] over [n, H, D] K/V (the kernels' CPU reference)."""
    lengths = torch.tensor([keys.shape[0]])
    return kernels.decode_attention(q[None], None, keys[None], values[None], lengths, scaling)[0][0]


class ErrorProbe:
    """The first decode steps' queries and new K/V per layer, with their full-KV outputs."""

    def __init__(self, layers: list[LayerKV], records: list[list[StepRecord]], scaling: float):
        self.layers, self.scaling = layers, scaling
        self.queries = [[step[i].query for step in records] for i in range(len(layers))]
        self.new_k = [torch.stack([step[i].key for step in records]) for i in range(len(layers))]
        self.new_v = [torch.stack([step[i].value for step in records]) for i in range(len(layers))]
        self.full = [self._outputs(i, layer.keys, layer.values) for i, layer in enumerate(layers)]

    def _outputs(self, i: int, keys: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
        """Step s attends to the prompt K/V given plus the exact K/V of decoded tokens 0..s."""
        return [
            _attend(q, torch.cat([keys, self.new_k[i][: s + 1]]),
                    torch.cat([values, self.new_v[i][: s + 1]]), self.scaling)
            for s, q in enumerate(self.queries[i])
        ]

    def error(self, c: Compressor) -> float:
        """Mean relative attention-output error over layers and steps."""
        errors = []
        for i, layer in enumerate(self.layers):
            lossy = self._outputs(i, *layer.compress(c, i).dense())
            errors += [float((o - f).norm() / f.norm()) for o, f in zip(lossy, self.full[i],
                                                                        strict=True)]
        return sum(errors) / len(errors)


def measure(model, tokenizer, files: list[str], tokens: list[int], specs: list[str],
            new_tokens: int, error_steps: int) -> list[Row]:
    """Every compressor's row over the prompts (file p cut to tokens[p % len(tokens)])."""
    compressors = [parse_compressor_spec(s) for s in specs]
    rows = [Row(c) for c in compressors]
    scaling = model.config.head_dim**-0.5
    window = max([c.score_window() or 0 for c in compressors if c.needs_scores] + [1])
    totals = any(c.needs_scores and c.score_window() is None for c in compressors)
    for p, name in enumerate(files):
        length = tokens[p % len(tokens)]
        ids = file_ids(tokenizer, name, length)
        log(f"prompt {p + 1}/{len(files)}: {name} ({len(ids)} tokens): prefill")
        layers = prefill(model, ids[:-1], window=window, total_scores=totals)
        log("full-KV greedy decoding")
        reference, records = greedy_full(model, layers, ids[-1], new_tokens, error_steps)
        probe = ErrorProbe(layers, records, scaling)
        for row in rows:
            bf16, compressed = compressed_bytes(row.compressor, layers)
            row.bf16_bytes += bf16
            row.bytes += compressed
            row.errors.append(probe.error(row.compressor))
        log(f"lossy greedy decoding, {len(rows)} compressors in one batch")
        outputs = greedy_compressed(model, layers, compressors, ids[-1], new_tokens, reference)
        for row, out in zip(rows, outputs, strict=True):
            row.matched.append(first_difference(out, reference))
            log(f"  {row.compressor.spec()}: matched {row.matched[-1]}, "
                f"attn err {row.errors[-1]:.4f}")
    return rows


def markdown(rows: list[Row], new_tokens: int) -> str:
    lines = [
        "| compressor | ratio vs bf16 | attn rel. error | matched greedy tokens "
        f"(of {new_tokens}): mean (per prompt) |",
        "|---|---:|---:|---|",
    ]
    for row in rows:
        per_prompt = "/".join(str(m) for m in row.matched)
        lines.append(
            f"| `{row.compressor.spec()}` | {row.bf16_bytes / row.bytes:.2f}x "
            f"| {sum(row.errors) / len(row.errors):.4f} "
            f"| {sum(row.matched) / len(row.matched):.1f} ({per_prompt}) |"
        )
    return "\n".join(lines)


def write_docs(path: Path, command: str, table: str, notes: str) -> None:
    replace_section(path, SECTION, f"\n```\n{command}\n```\n\n{notes}\n\n{table}\n")


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.compress_quality", __doc__)
    cli.add_model(parser)
    parser.add_argument("--files", nargs="+", default=DEFAULT_FILES,
                        help="text files (paths, or names under the stdlib or licence folders), "
                        "one prompt each (default: 3 stdlib sources, GPL-3)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 3072, 4096, 6144],
                        help="prompt length in tokens per file, cycled (default: %(default)s)")
    parser.add_argument("--specs", nargs="+", default=DEFAULT_SPECS,
                        help="compressor specs, one table row each")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="greedy tokens decoded per prompt (default: %(default)s)")
    parser.add_argument("--error-steps", type=int, default=8,
                        help="decode steps whose queries measure attention error (default: 8)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--write-docs", type=Path, default=None,
                        help="markdown file whose compress_quality section gets the results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    model, tokenizer = load_model(cli.model_dir(args.model))
    rows = measure(model, tokenizer, args.files, args.tokens, args.specs, args.new_tokens,
                   args.error_steps)
    table = markdown(rows, args.new_tokens)
    print(table)
    minutes = (time.time() - started) / 60
    log(f"done in {minutes:.1f} min")
    if args.write_docs:
        command = cli.invocation("bench.compress_quality", argv)
        prompts = ", ".join(
            f"{Path(f).name} ({args.tokens[i % len(args.tokens)]} tokens)"
            for i, f in enumerate(args.files)
        )
        notes = (f"Prompts: {prompts}; {args.new_tokens} greedy tokens each; attention error "
                 f"over the first {args.error_steps} decode steps. Run with "
                 f"{torch.get_num_threads()} torch CPU thread(s) in {minutes:.0f} min.")
        write_docs(args.write_docs, command, table, notes)
        log(f"wrote {args.write_docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
