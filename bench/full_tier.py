"""More long requests under one device budget: plain SGLang, plain SGLang with its hierarchical
cache (HiCache, a host tier for prefixes) and VeriCache with the full KV in host memory, the
same --max-total-tokens (the device budget) for all three.

One run: eight distinct real prompts (Python standard library sources) of about 4,000 tokens,
128 greedy tokens each, all sent at once, float32. Per server: output tokens per second over
the whole run (prefill included), the most requests decoding at once (from the scheduler's
decode log lines), and for VeriCache the device bytes per context token it can hold, full-tier
bytes read per emitted token while decoding, and the share of fetch time hidden behind drafting
and earlier layers (from /server_info). Every output is compared with plain SGLang's.

    .venv/bin/python -m bench.full_tier [--device-tokens 12000] [--write-docs docs/memory.md]
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from transformers import AutoTokenizer

from bench import cli
from bench.docs_section import replace_section
from bench.serving import COMMON, request, send_together, vericache_figures
from vericache_sglang import models
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_args import VERICACHE
from vericache_tools.server_process import ServerProcess

MODULES = ["argparse", "difflib", "inspect", "typing", "tarfile", "pathlib", "functools",
           "textwrap"]
BATCH = ["--max-running-requests", "8"]
CONFIGS = {"plain": [],
           # a host tier twice the device pool, SGLang's default ratio
           "hicache": ["--enable-hierarchical-cache", "--hicache-ratio", "2"],
           "vericache": VERICACHE}
RUNNING = re.compile(r"#running-req: (\d+)")


def run(model: Path, extra: list[str], device_tokens: int, payloads: list[dict]) -> dict:
    """One server under the device budget: the payloads sent at once, its throughput, its
    peak batch, and VeriCache's figures from /server_info."""
    with ServerProcess(model, [*COMMON, *BATCH, *extra], max_total_tokens=device_tokens) as server:
        began = time.monotonic()
        outs = send_together(server, payloads)
        seconds = time.monotonic() - began
        info = server.server_info()
    log = server.log_path.read_text(errors="replace")
    tokens = sum(len(out["output_ids"]) for out in outs)
    row = {"outputs": [out["output_ids"] for out in outs], "seconds": seconds,
           "tok_s": tokens / seconds,
           "peak_running": max(map(int, RUNNING.findall(log)), default=0),
           "capacity_tokens": info["max_total_num_tokens"]}
    row.update(vericache_figures(info) or {})
    return row


def payloads(tokenizer, prompt_tokens: int, new_tokens: int) -> list[dict]:
    """One request per module in MODULES, all distinct long prompts."""
    return [request(stdlib_ids(tokenizer, m, prompt_tokens, start=200), new_tokens)
            for m in MODULES]


def main() -> None:
    parser = cli.parser("bench.full_tier", __doc__)
    parser.add_argument("--device-tokens", type=int, default=12000,
                        help="--max-total-tokens of both servers: the device budget")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--write-docs", type=Path, help="docs page with a full-tier section")
    args = parser.parse_args()

    model = models.prepare().target
    tokenizer = AutoTokenizer.from_pretrained(model)
    sent = payloads(tokenizer, args.prompt_tokens, args.max_new_tokens)
    rows = {}
    for name, extra in CONFIGS.items():
        print(f"[bench] {name} ...", flush=True)
        rows[name] = run(model, extra, args.device_tokens, sent)
        print(f"[bench] {name}: {rows[name]['tok_s']:.2f} tok/s, peak running "
              f"{rows[name]['peak_running']}", flush=True)
    plain, hicache, vc = rows["plain"], rows["hicache"], rows["vericache"]

    def identical(row: dict) -> int:
        return sum(a == b for a, b in zip(plain["outputs"], row["outputs"], strict=True))

    full = 46080  # float32 full KV per token of the demo model, as /server_info measures
    table = "\n".join([
        f"\nMeasured by `python -m bench.full_tier --device-tokens {args.device_tokens}` "
        f"(8 prompts of {args.prompt_tokens} tokens, {args.max_new_tokens} greedy tokens "
        "each, float32, one run):\n",
        "| server | output tok/s | peak running requests | context tokens the budget holds "
        "| device bytes per context token | full-tier bytes read per emitted token "
        "| fetch time hidden |",
        "|---|---|---|---|---|---|---|",
        f"| plain SGLang | {plain['tok_s']:.2f} | {plain['peak_running']} | "
        f"{plain['capacity_tokens']} | {full} | (whole context every token) | - |",
        f"| plain SGLang + HiCache | {hicache['tok_s']:.2f} | {hicache['peak_running']} | "
        f"{hicache['capacity_tokens']} | {full} | (whole context every token) | - |",
        f"| VeriCache, host tier | {vc['tok_s']:.2f} | {vc['peak_running']} | "
        f"{vc['capacity_tokens']} | {vc['device_bytes_per_token']:.0f} | "
        f"{vc['read_per_token']:.0f} | {vc['hidden']:.0%} |",
        "",
        f"Throughput ratio VeriCache / plain: **{vc['tok_s'] / plain['tok_s']:.2f}x**, "
        f"VeriCache / HiCache: **{vc['tok_s'] / hicache['tok_s']:.2f}x**; outputs identical "
        f"to plain SGLang's: VeriCache {identical(vc)} of {len(MODULES)}, HiCache "
        f"{identical(hicache)} of {len(MODULES)}; tokens per verification round "
        f"E = {vc['E']:.1f}; device bytes VeriCache allocated {vc['device_bytes']} of its "
        f"{vc['budget']} budget.\n",
    ])
    print(table)
    if args.write_docs:
        replace_section(args.write_docs, "full-tier", table)


if __name__ == "__main__":
    main()
