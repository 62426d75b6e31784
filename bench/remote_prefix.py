"""A stored prefix behind an emulated link: time to the first and the n-th token, and bytes over
the link, for plain SGLang recomputing, plain SGLang's HiCache fetching the full KV, and
VeriCache fetching its coded pages (not a test).

The link is emulation (`stores/shaped_link.py`): a network namespace whose loopback caps the
Mooncake store's data ports at `--rate-mbit`; the store, the servers and this script's client
all run inside it. For each configuration that reads the store, server A answers the prefix
alone and stops once its pages are stored; server B, started afterwards on the same store,
answers the prefix plus a question, streamed: the times are B's, from sending the request, and
the bytes are what crossed the shaped link while B answered (`tc -s class show`). Plain SGLang
without a store answers the same request: every output must equal it.

Every server B first answers a long prompt nobody stored and a short one A stored, as a server
that has been serving would have: `vericache-auto` (`--vericache-store-reads auto`) has then
measured its read and prefill rates, and recomputes the stored prefix when reading it is the
slower. The timed request starts once B has stored the first prompt's pages, so its time and
link bytes are its own. What this measures today is VeriCache as built: a request whose prefix
is read waits for all of its pages, as SGLang's prefetch does (issue 27 builds drafting on the
compressed pages while the exact KV still arrives).

    python -m bench.remote_prefix --prefix-tokens 3200 --rate-mbit 200 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import requests
from transformers import AutoTokenizer

from bench import cli, serving
from vericache_sglang.prompts import stdlib_ids
from vericache_sglang.server_process import ServerProcess
from vericache_sglang.stores.mooncake_service import MooncakeService, mooncake_unavailable_reason
from vericache_sglang.stores.shaped_link import ShapedLink, shaping_unavailable_reason

PAGE_SIZE = 64
DEVICE_TOKENS = 8192
BASE_ARGS = [*serving.COMMON, "--page-size", str(PAGE_SIZE)]
STORE_ARGS = ["--enable-hierarchical-cache", "--hicache-ratio", "1",
              "--hicache-write-policy", "write_through",
              "--hicache-storage-prefetch-policy", "wait_complete"]
CONFIGS = {
    "recompute": None,
    "hicache": [],
    "vericache": serving.VERICACHE,
    "vericache-auto": [*serving.VERICACHE, "--vericache-store-reads", "auto"],
}
"""Each configuration's flags beside HiCache on the store (None: plain, no store)."""


def link_bytes() -> int:
    """Bytes the shaped class has sent (this process runs inside the link's namespace)."""
    shown = subprocess.run(["tc", "-s", "class", "show", "dev", "lo", "classid", "1:10"],
                           capture_output=True, text=True, check=True).stdout
    return int(re.search(r"Sent (\d+) bytes", shown).group(1))


def timed_stream(server: ServerProcess, ids: list[int], new_tokens: int) -> dict:
    """Stream one greedy request; the seconds to each emitted token count, and the output."""
    request = {**serving.request(ids, new_tokens), "stream": True}
    began = time.monotonic()
    response = requests.post(f"{server.url}/generate", json=request, stream=True, timeout=1800)
    response.raise_for_status()
    at: dict[int, float] = {}
    last: dict = {}
    for line in response.iter_lines():
        if line.startswith(b"data: {"):
            last = json.loads(line[len(b"data: "):])
            at.setdefault(len(last["output_ids"]), time.monotonic() - began)
    return {"output_ids": last["output_ids"], "first_s": min(at.values()),
            "last_s": max(at.values()),
            "cached": last["meta_info"].get("cached_tokens_details") or {}}


STORE_READ_KEYS = ("read_coded_pages", "read_coded_bytes", "read_codec_seconds")
"""VeriCache's store counters of the timed request: pages read, their bytes, and the seconds
the store's reads took (transfer and decode, in SGLang's prefetch thread)."""


def store_io(server: ServerProcess) -> dict:
    """VeriCache's store counters (`/server_info`); empty for plain SGLang."""
    states = server.server_info().get("internal_states") or [{}]
    return states[0].get("vericache_state", {}).get("store_io", {})


def warm_up(server: ServerProcess, unstored: list[int], stored: list[int]) -> None:
    """A long prefill, then a prompt whose pages are stored (read, where the server reads)."""
    for ids in (unstored, stored):
        server.generate(serving.request(ids, 1))


def run_inside(args: argparse.Namespace) -> dict:
    """The measurement, in the link's namespace."""
    target = cli.model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(target)
    prefix = stdlib_ids(tokenizer, "inspect", args.prefix_tokens, start=100)
    question = prefix + stdlib_ids(tokenizer, "bisect", 60, start=300)
    # Before the timed request every server B answers a long prompt nobody stored and one
    # A stored: a server that has been serving, whose rates (`--vericache-store-reads auto`)
    # are measured.
    unstored = stdlib_ids(tokenizer, "difflib", 2000, start=0)
    stored = stdlib_ids(tokenizer, "heapq", 640, start=0)
    results: dict[str, dict] = {}
    with MooncakeService(segment_size=args.segment_mib << 20) as store:
        for name in args.configs:
            flags = CONFIGS[name]
            print(f"[{name}]", flush=True)
            if flags is None:
                with ServerProcess(target, BASE_ARGS, max_total_tokens=DEVICE_TOKENS) as server:
                    warm_up(server, unstored, stored)
                    results[name] = timed_stream(server, question, args.new_tokens)
                results[name]["link_bytes"] = 0
                continue
            server_args = [*BASE_ARGS, *STORE_ARGS, *flags,
                           *store.server_args(extra_backend_tag=name)]
            with ServerProcess(target, server_args, max_total_tokens=DEVICE_TOKENS,
                               env=store.env()) as a:
                keys = store.wait_keys(0)
                a.generate(serving.request(prefix, 1))
                a.generate(serving.request(stored, 1))
                store.wait_keys(keys + 1, timeout=900, settle=5.0)
            with ServerProcess(target, server_args, max_total_tokens=DEVICE_TOKENS,
                               env=store.env()) as b:
                keys = store.wait_keys(0)
                warm_up(b, unstored, stored)
                # B writes the unstored prompt's pages behind its answer: wait for them, so
                # the timed request's time and bytes are its own
                store.wait_keys(keys + 1, timeout=900, settle=5.0)
                sent, io = link_bytes(), store_io(b)
                results[name] = timed_stream(b, question, args.new_tokens)
                results[name]["link_bytes"] = link_bytes() - sent
                after = store_io(b)
                results[name]["store_read"] = {key: after.get(key, 0) - io.get(key, 0)
                                               for key in STORE_READ_KEYS}
    reference = results.get("recompute", {}).get("output_ids")
    for result in results.values():
        output = result.pop("output_ids")
        result["identical"] = None if reference is None else output == reference
    return results


def _table(results: dict, args: argparse.Namespace) -> str:
    base = results.get("hicache", next(iter(results.values())))
    rows = [f"Emulated link: {args.rate_mbit} Mbit/s on the store's data ports; "
            f"{args.prefix_tokens}-token stored prefix + 60-token question, "
            f"{args.new_tokens} greedy tokens, float32 demo model, one run.", "",
            "| server | first token s | last token s | last / HiCache | link MB | "
            "storage hit | store reads s (pages) | identical |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        read = r.get("store_read") or {}
        reads = (f"{read['read_codec_seconds']:.1f} ({read['read_coded_pages']})"
                 if read.get("read_coded_pages") else "-")
        rows.append(f"| {name} | {r['first_s']:.1f} | {r['last_s']:.1f} | "
                    f"{r['last_s'] / base['last_s']:.2f}x | {r['link_bytes'] / 1e6:.1f} | "
                    f"{r['cached'].get('storage', 0)} | {reads} | {r['identical']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.remote_prefix", __doc__)
    cli.add_model(parser)
    parser.add_argument("--prefix-tokens", type=int, default=3200)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="what to run (recompute is the reference the others must equal)")
    parser.add_argument("--segment-mib", type=int, default=2048,
                        help="the store's memory (both configurations' pages live there)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        print("RESULTS " + json.dumps(run_inside(args)), flush=True)
        return 0
    reason = shaping_unavailable_reason() or mooncake_unavailable_reason()
    if reason:
        print(f"bench.remote_prefix cannot run here: {reason}", file=sys.stderr)
        return 2
    found: list[str] = []
    with ShapedLink(args.rate_mbit) as link:
        inner = ["--prefix-tokens", str(args.prefix_tokens), "--new-tokens",
                 str(args.new_tokens), "--rate-mbit", str(args.rate_mbit), "--segment-mib",
                 str(args.segment_mib), "--configs", *args.configs,
                 *(["--model", str(args.model)] if args.model else [])]
        with subprocess.Popen(link.command([sys.executable, "-m", "bench.remote_prefix",
                                            "--inside", *inner]),
                              stdout=subprocess.PIPE, text=True) as child:
            for line in child.stdout:  # progress as it comes; the results line kept
                if line.startswith("RESULTS "):
                    found.append(line)
                else:
                    print(line, end="", flush=True)
    if child.returncode != 0 or not found:
        return child.returncode or 1
    results = json.loads(found[-1][len("RESULTS "):])
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=2))
    print(_table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
