"""Bytes and speed of the CacheGen codec on real demo-model KV (not a test).

For each prompt (long stdlib sources and a licence text), the model's own K/V of every layer
is coded in chunks, in bf16 and float32; the table gives bytes per element (every byte of the
streams: headers, tables, scales, digests) after each part, i.e. what a reader fetches for each
level, next to the baselines: the bf16 KV itself, KIVI-4 packed codes with their fp16 scales
(the compressed pool's pages, measured from their tensors), zstd of the bf16 byte planes,
bf16 plus int4 stored side by side, and zstd-19 of the float32 byte planes (the float32 KV's
plain lossless size, per 4-byte element). Encode and decode speeds are MB of KV (in its own dtype)
per second on one core; beside each level's decode speed, the MB of KV per second that 0.2, 1
and 10 Gbit/s links deliver at that level's bytes.

    python -m bench.codec --tokens 2048 --write-docs docs/codec.md
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench import cli, tables
from bench.docs_section import replace_section
from vericache_sglang import models
from vericache_sglang.codec import CodecSpec, decode_chunk, encode
from vericache_sglang.codec.chunk import EXACT_PLANES
from vericache_sglang.codec.exact import encode_planes
from vericache_sglang.codec.stream import read_parts, unpack_all
from vericache_sglang.compress import parse_compressor_spec
from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.compress.quant import QuantTier
from vericache_tools.hf_eval import load_model, prefill
from vericache_tools.prompts import file_ids

SECTION = "codec"
LINKS = (0.2, 1.0, 10.0)
"""Link rates (Gbit/s) whose delivery of each level the decode speeds stand beside."""
DEFAULT_FILES = ["argparse.py", "difflib.py", "/usr/share/common-licenses/GPL-3"]


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


def measure(model, tokenizer, files: list[str], tokens: int, chunk: int = 256,
            compressor: str = "kivi:bits=4,group=32", coarse: tuple[int, int] = (4, 2),
            groupings: tuple[str, ...] = ("channel", "kind"), lane_channels: int = 16) -> dict:
    """Each figure of the table (bytes per element, encode speed, each level's decode speed
    and time per chunk beside what 0.2, 1 and 10 Gbit/s links deliver of it) per table
    grouping, the mean over `files`' prompts, by label; and how many layers' exact parts were
    coded as residuals or as byte planes, per dtype. Runs on one thread (speeds are per
    core)."""
    pool = parse_compressor_spec(compressor)
    layers = model.config.num_hidden_layers
    sums: dict[str, list[float]] = defaultdict(list)
    modes: dict[str, int] = defaultdict(int)
    with cli.threads(1):
        for name in files:
            ids = file_ids(tokenizer, name, tokens)
            cli.log(f"codec: {name}, {len(ids)} tokens, prefill")
            keys, values = kv_of(model, ids)
            elements = keys.numel() * 2
            for label, value in baselines(keys, values, pool).items():
                sums[label].append(value)
            for dtype in (torch.bfloat16, torch.float32):
                k, v = keys.to(dtype), values.to(dtype)
                mb = k.numel() * 2 * k.element_size() / 1e6
                for grouping in groupings:
                    spec = CodecSpec.for_compressor(pool, layers, tables=grouping,
                                                    chunk_tokens=chunk, coarse=coarse,
                                                    lane_channels=lane_channels)
                    began = time.perf_counter()
                    streams = encode(k, v, spec, key=b"bench")
                    encode_s = time.perf_counter() - began
                    keys_of = [b"bench" + (i * chunk).to_bytes(8, "little")
                               for i in range(len(streams))]
                    levels = len(spec.levels)
                    decode_s = []
                    for level in [*range(levels), None]:
                        began = time.perf_counter()
                        for stream, key in zip(streams, keys_of, strict=True):
                            decode_chunk(stream, level=level, key=key)
                        decode_s.append(time.perf_counter() - began)
                    parts = defaultdict(int)
                    for stream, key in zip(streams, keys_of, strict=True):
                        header, chunk_parts = read_parts(stream, key=key)
                        cumulative = len(stream) - sum(header.part_lengths)  # the overhead
                        for p, length in enumerate(header.part_lengths):
                            cumulative += length
                            parts[p] += cumulative
                        # the exact part's first section: each layer's mode
                        for mode in bytes(unpack_all(chunk_parts[-1])[0]):
                            kind = "planes" if mode == EXACT_PLANES else "residual"
                            modes[f"{str(dtype).removeprefix('torch.')} {kind}"] += 1
                    names = [f"level {i} ({'/'.join(map(str, sorted(set(lv))))} bits)"
                             for i, lv in enumerate(spec.levels[:-1])]
                    names += [f"pool level ({'/'.join(map(str, sorted(set(spec.levels[-1]))))} "
                              "bits, = pool pages)", "exact (whole stream)"]
                    tag = f"{str(dtype).removeprefix('torch.')}, tables per {grouping}"
                    for p, label in enumerate(names):
                        sums[f"{tag}: {label}"].append(parts[p] / elements)
                    sums[f"{tag}: encode MB/s"].append(mb / encode_s)
                    # each level's decode speed beside what links deliver of it: MB of KV per
                    # second, a link's bytes per second over the level's bytes per KV byte
                    for p, label in enumerate(names):
                        short = label.split(" (")[0]
                        sums[f"{tag}: {short}: decode MB/s"].append(mb / decode_s[p])
                        sums[f"{tag}: {short}: decode ms per chunk"].append(
                            decode_s[p] / len(streams) * 1e3)
                        for gbit in LINKS:
                            sums[f"{tag}: {short}: {gbit:g} Gbit/s delivers MB/s"].append(
                                gbit * 1e9 / 8 / 1e6 * mb * 1e6 / parts[p])
                    cli.log(f"  {tag}: exact {parts[len(names) - 1] / elements:.3f} B/elem, "
                            f"encode {mb / encode_s:.1f} MB/s, decode exact "
                            f"{mb / decode_s[-1]:.1f} MB/s, level 0 {mb / decode_s[0]:.1f} MB/s")
    return {"files": list(files), "tokens": tokens, "chunk": chunk,
            "means": {label: statistics.mean(values) for label, values in sums.items()},
            "exact_modes": dict(sorted(modes.items()))}


def markdown(result: dict) -> str:
    """The table, and how the exact parts were coded."""
    rows = [[label, f"{value:.3f}" + ("" if "MB/s" in label or " ms " in label else " B")]
            for label, value in result["means"].items()]
    return (tables.table(["what", "per element (bytes) or speed, mean of prompts"], rows)
            + "\n\nExact part, layers coded as residual vs byte planes: "
            + ", ".join(f"{mode} {count}" for mode, count in result["exact_modes"].items()))


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.codec", __doc__)
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
    parser.add_argument("--lane-channels", type=int, default=16,
                        help="channels per rANS lane (default: %(default)s)")
    parser.add_argument("--write-docs", type=Path, default=None,
                        help="markdown file whose codec section gets the table")
    args = parser.parse_args(argv)
    coarse = tuple(int(b) for b in args.coarse.split(","))
    model, tokenizer = load_model(models.prepare().target)
    table = markdown(measure(model, tokenizer, args.files, args.tokens, args.chunk,
                             args.compressor, coarse, tuple(args.tables),
                             args.lane_channels))
    print(table)
    if args.write_docs:
        command = cli.invocation("bench.codec", argv)
        replace_section(args.write_docs, SECTION, f"\n```\n{command}\n```\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
