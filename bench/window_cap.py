"""What the drafting-window reserve's cap on running requests costs: a batch larger than the cap,
with the full KV in host memory (not a test).

With `--vericache-full-tier host` and no `--max-running-requests`, VeriCache reserves device
budget for drafting windows (`tiers/budget.py`: a sixteenth of it, or what a smaller host pool
leaves), which caps the running requests. This sends one batch to a server with the default
reserve and to one told `--max-running-requests` as many as the batch, on the demo model's
1.5 GB budget and a 32,768-token host pool, and reports the batch's wall time (prefill
included: a cap delays admission), output tokens per second, the cap, pool and reserve each
server planned, and whether the outputs are equal.

`python -m bench` runs it as its window_cap suite at its full size (`run` gives the figures).

    python -m bench.window_cap --requests 16 --prompt-tokens 600 --new-tokens 64
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import AutoTokenizer

from bench import cli
from bench.serving import COMMON, request, send_together
from bench.tables import table
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_args import VERICACHE
from vericache_tools.server_process import ServerProcess

MAX_TOTAL_TOKENS = 32768
FULL_KV_BYTES_PER_TOKEN = 46080
"""The demo model's float32 KV per token (30 layers x 3 KV heads x 64 x 2 x 4 bytes)."""
HOST = [*COMMON, *VERICACHE, "--max-total-tokens", str(MAX_TOTAL_TOKENS),
        "--vericache-full-tier", "host",
        "--vericache-full-tier-budget", str(MAX_TOTAL_TOKENS * FULL_KV_BYTES_PER_TOKEN)]
PROMPT_TOKENS = 600
"""Each request's prompt (its default; `python -m bench` runs it at this length)."""
MODULES = ["argparse", "difflib", "inspect", "typing", "textwrap", "heapq", "csv", "json.decoder",
           "bisect", "calendar", "fractions", "shlex", "string", "locale", "pprint", "random"]


def measure(model: Path, args: list[str], payloads: list[dict]) -> dict:
    with ServerProcess(model, args) as server:
        send_together(server, payloads[:1])  # warm-up
        server.flush_cache()
        began = time.monotonic()
        answers = send_together(server, payloads)
        seconds = time.monotonic() - began
        memory = server.server_info()["vericache"]["memory"]
    tokens = sum(a["meta_info"]["completion_tokens"] for a in answers)
    return {"seconds": seconds, "tokens_per_second": tokens / seconds,
            "max_running_requests": memory["max_running_requests"],
            "compressed_pool_pages": memory["compressed_pool_pages"],
            "window_reserve_bytes": memory["window_reserve_bytes"],
            "outputs": [a["output_ids"] for a in answers]}


def run(model: Path, requests: int, prompt_tokens: int, new_tokens: int) -> dict[str, dict]:
    """The batch on a server with the default reserve and on one told to run every request of
    it at once, by server."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    payloads = [request(stdlib_ids(tokenizer, module, prompt_tokens), new_tokens)
                for module in MODULES[:requests]]
    configs = {"default reserve": HOST,
               f"--max-running-requests {requests}": [
                   *HOST, "--max-running-requests", str(requests)]}
    results = {}
    for name, server_args in configs.items():
        cli.log(f"{name} ...")
        results[name] = measure(model, server_args, payloads)
        cli.log(f"{name}: {results[name]['seconds']:.1f} s")
    return results


def identical(results: dict[str, dict]) -> bool:
    """Whether every server answered as the one with the default reserve did."""
    base = results["default reserve"]["outputs"]
    return all(r["outputs"] == base for r in results.values())


def markdown(results: dict[str, dict]) -> str:
    base = results["default reserve"]
    return table(["server", "running requests", "compressed pages", "window reserve MiB",
                  "batch s", "output tok/s", "speed vs default", "same output"],
                 [[name, r["max_running_requests"], r["compressed_pool_pages"],
                   f"{r['window_reserve_bytes'] / 2**20:.0f}", f"{r['seconds']:.1f}",
                   f"{r['tokens_per_second']:.2f}", f"{base['seconds'] / r['seconds']:.2f}x",
                   "yes" if r["outputs"] == base["outputs"] else "NO"]
                  for name, r in results.items()])


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.window_cap", __doc__)
    cli.add_model(parser)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.requests > len(MODULES):
        parser.error(f"--requests: at most {len(MODULES)} (one stdlib module each)")
    results = run(cli.model_dir(args.model), args.requests, args.prompt_tokens, args.new_tokens)
    print(markdown(results))
    print(cli.invocation("bench.window_cap", argv))
    if args.out is not None:
        args.out.write_text(json.dumps({"command": cli.invocation("bench.window_cap", argv),
                                        "results": results}, indent=1))
    return 0 if identical(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
