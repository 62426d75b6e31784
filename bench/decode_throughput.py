"""Decode throughput of the demo model through a real SGLang server, plain vs --enable-vericache.

Reports server start-to-healthy time and decode tokens/s (prefill excluded: the time of a
1-token request on the same prompt is subtracted) for a short and a long (stdlib source)
prompt. Both servers run in one invocation so the ratio is measured under the same load.

    .venv/bin/python -m bench.decode_throughput [--max-new-tokens 128] [--dtype bfloat16]
"""

from __future__ import annotations

import json
import time

from transformers import AutoTokenizer

from bench import cli
from bench.serving import request
from vericache_sglang import models
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_process import ServerProcess

CONFIGS = {"plain": [], "vericache": ["--enable-vericache"]}


def _timed(server: ServerProcess, ids: list[int], n: int) -> float:
    began = time.monotonic()
    out = server.generate(request(ids, n))
    assert out["meta_info"]["completion_tokens"] == n
    return time.monotonic() - began


def decode_tokens_per_second(server: ServerProcess, ids: list[int], n: int, repeats: int) -> float:
    """Best of `repeats`: (n - 1) tokens over the time beyond a 1-token request."""
    best = 0.0
    for _ in range(repeats):
        one = _timed(server, ids, 1)
        full = _timed(server, ids, n)
        best = max(best, (n - 1) / max(full - one, 1e-9))
    return best


def main() -> None:
    parser = cli.parser("bench.decode_throughput", __doc__)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--long-prompt-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="--dtype for both servers")
    args = parser.parse_args()

    model = models.prepare().target
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = {
        "short": tokenizer("def fibonacci(n):")["input_ids"],
        "long": stdlib_ids(tokenizer, "textwrap", args.long_prompt_tokens),
    }
    results: dict[str, dict[str, float]] = {}
    for name, extra in CONFIGS.items():
        print(f"[bench] starting {name} server ...", flush=True)
        with ServerProcess(model, ["--dtype", args.dtype, *extra]) as server:
            row = {"startup_s": round(server.startup_seconds, 1)}
            for label, ids in prompts.items():
                tps = decode_tokens_per_second(server, ids, args.max_new_tokens, args.repeats)
                row[f"decode_tok_s_{label}_{len(ids)}"] = round(tps, 2)
                print(f"[bench] {name} {label} ({len(ids)} prompt tokens): {tps:.2f} tok/s",
                      flush=True)
            results[name] = row
    print(json.dumps(results, indent=2))
    print("| server | start-to-healthy (s) | " + " | ".join(
        k for k in results["plain"] if k != "startup_s") + " |")
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
