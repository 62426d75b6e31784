"""Bytes and speed of the CacheGen codec on real demo-model KV (not a test).

For each prompt (long stdlib sources and a licence text), the model's own K/V of every layer
is coded in chunks, in bf16 and float32; the table gives bytes per element (every byte of the
streams: headers, tables, scales, digests) after each part, i.e. what a reader fetches for each
level, next to the baselines: the bf16 KV itself, KIVI-4 packed codes with their fp16 scales
(the compressed pool's pages, measured from their tensors), zstd of the bf16 byte planes,
bf16 plus int4 stored side by side, and zstd-19 of the float32 byte planes (the float32 KV's
plain lossless size, per 4-byte element). Encode and decode speeds are MB of KV (in its own dtype)
per second on one core.

    python -m bench.codec --tokens 2048 --write-docs docs/codec.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.docs_section import replace_section
from vericache_sglang import models
from vericache_sglang.codec import CodecSpec, decode_chunk, encode
from vericache_sglang.codec.chunk import EXACT_PLANES
from vericache_sglang.codec.exact import encode_planes
from vericache_sglang.codec.stream import read_parts, unpack_sections
from vericache_sglang.compress import parse_compressor_spec
from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.compress.quant import QuantTier
from vericache_tools.hf_eval import load_model, prefill
from vericache_tools.prompts import file_ids

SECTION = "codec"
DEFAULT_FILES = ["argparse.py", "difflib.py", "/usr/share/common-licenses/GPL-3"]


def log(message: str) -> None:
    print(f"[bench.codec] {message}", file=sys.stderr, flush=True)


def kv_of(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    layers = prefill(model, ids, total_scores=False)
    return (torch.stack([layer.keys for layer in layers]),
            torch.stack([layer.values for layer in layers]))


def baselines(keys: torch.Tensor, values: torch.Tensor, compressor) -> dict[str, float]:
    """Bytes per element of the references, bf16 K/V (and float32's lossless size)."""
    elements = keys.numel() * 2
    k16, v16 = keys.bfloat16(), values.bfloat16()
    packed = 0
    for layer in range(keys.shape[0]):
        plan = compressor.plan(layer)
        tier = QuantTier.quantize(k16[layer], v16[layer], plan.old_bits, plan.group)
        packed += storage_bytes(tier.tensors())
    both = torch.cat([k16.flatten(), v16.flatten()])
    # The float32 KV's own lossless size: what any exact float32 transfer costs at least,
    # short of a better entropy coder.
    both32 = torch.cat([keys.float().flatten(), values.float().flatten()])
    return {"bf16": 2.0, "KIVI-4 packed (pool pages)": packed / elements,
            "zstd-3 of bf16 byte planes": len(encode_planes(both, 3)) / elements,
            "zstd-19 of bf16 byte planes": len(encode_planes(both, 19)) / elements,
            "bf16 + KIVI-4 side by side": 2.0 + packed / elements,
            "zstd-19 of float32 byte planes (of 4 B)": len(encode_planes(both32, 19))
            / elements}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.codec", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--files", nargs="+", default=DEFAULT_FILES,
                        help="prompt files (stdlib module file names or paths)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per prompt")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per chunk")
    parser.add_argument("--compressor", default="kivi:bits=4,group=32",
                        help="the compressed pool whose pages are the pool level")
    parser.add_argument("--coarse", default="4,2", metavar="EARLY,LATE",
                        help="bits of the coarse level: EARLY for the first quarter of the "
                        "layers, LATE for the rest (default: %(default)s)")
    parser.add_argument("--tables", nargs="+", default=["channel", "kind"],
                        help="table groupings to compare")
    parser.add_argument("--write-docs", type=Path, default=None,
                        help="markdown file whose codec section gets the table")
    args = parser.parse_args(argv)
    coarse = tuple(int(b) for b in args.coarse.split(","))
    torch.set_num_threads(1)
    compressor = parse_compressor_spec(args.compressor)
    model, tokenizer = load_model(models.prepare().target)
    layers = model.config.num_hidden_layers
    sums: dict[str, list[float]] = defaultdict(list)
    modes = defaultdict(int)
    for name in args.files:
        ids = file_ids(tokenizer, name, args.tokens)
        log(f"{name}: {len(ids)} tokens, prefill")
        keys, values = kv_of(model, ids)
        elements = keys.numel() * 2
        for label, value in baselines(keys, values, compressor).items():
            sums[label].append(value)
        for dtype in (torch.bfloat16, torch.float32):
            k, v = keys.to(dtype), values.to(dtype)
            mb = k.numel() * 2 * k.element_size() / 1e6
            for tables in args.tables:
                spec = CodecSpec.for_compressor(compressor, layers, tables=tables,
                                                chunk_tokens=args.chunk, coarse=coarse)
                began = time.perf_counter()
                streams = encode(k, v, spec, key=b"bench")
                encode_s = time.perf_counter() - began
                began = time.perf_counter()
                for i, stream in enumerate(streams):
                    decode_chunk(stream, key=b"bench" + (i * args.chunk).to_bytes(8, "little"))
                decode_s = time.perf_counter() - began
                began = time.perf_counter()
                for i, stream in enumerate(streams):
                    decode_chunk(stream, level=0,
                                 key=b"bench" + (i * args.chunk).to_bytes(8, "little"))
                coarse_s = time.perf_counter() - began
                parts = defaultdict(int)
                for i, stream in enumerate(streams):
                    header, chunk_parts = read_parts(
                        stream, key=b"bench" + (i * args.chunk).to_bytes(8, "little"))
                    overhead = len(stream) - sum(header.part_lengths)
                    cumulative = overhead
                    for p, length in enumerate(header.part_lengths):
                        cumulative += length
                        parts[p] += cumulative
                    for section in unpack_sections(chunk_parts[-1], layers):
                        modes[(str(dtype), "planes" if section[0] == EXACT_PLANES
                               else "residual")] += 1
                names = [f"level {i} ({'/'.join(map(str, sorted(set(lv))))} bits)"
                         for i, lv in enumerate(spec.levels[:-1])]
                names += [f"pool level ({'/'.join(map(str, sorted(set(spec.levels[-1]))))} "
                          "bits, = pool pages)", "exact (whole stream)"]
                tag = f"{str(dtype).removeprefix('torch.')}, tables per {tables}"
                for p, label in enumerate(names):
                    sums[f"{tag}: {label}"].append(parts[p] / elements)
                sums[f"{tag}: encode MB/s"].append(mb / encode_s)
                sums[f"{tag}: decode exact MB/s"].append(mb / decode_s)
                sums[f"{tag}: decode level 0 MB/s"].append(mb / coarse_s)
                # a chunk's decode time against a 1 Gbit/s link's time to deliver its bytes
                chunks = len(streams)
                sums[f"{tag}: decode exact ms per chunk"].append(decode_s / chunks * 1e3)
                sums[f"{tag}: 1 Gbit/s delivery of the whole stream, ms per chunk"].append(
                    parts[len(names) - 1] * 8 / 1e9 / chunks * 1e3)
                sums[f"{tag}: decode level 0 ms per chunk"].append(coarse_s / chunks * 1e3)
                sums[f"{tag}: 1 Gbit/s delivery of level 0, ms per chunk"].append(
                    parts[0] * 8 / 1e9 / chunks * 1e3)
                log(f"  {tag}: exact {parts[len(names) - 1] / elements:.3f} B/elem, encode "
                    f"{mb / encode_s:.1f} MB/s, decode {mb / decode_s:.1f} MB/s")
    lines = ["| what | per element (bytes) or speed, mean of prompts |", "| --- | --- |"]
    for label, values in sums.items():
        unit = "" if "MB/s" in label or " ms " in label else " B"
        lines.append(f"| {label} | {statistics.mean(values):.3f}{unit} |")
    lines.append("")
    lines.append("Exact part, layers coded as residual vs byte planes: " + ", ".join(
        f"{dtype.removeprefix('torch.')} {mode} {count}" for (dtype, mode), count in
        sorted(modes.items())))
    table = "\n".join(lines)
    print(table)
    if args.write_docs:
        command = "python -m bench.codec " + " ".join(argv if argv is not None else sys.argv[1:])
        replace_section(args.write_docs, SECTION, f"\n```\n{command}\n```\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
