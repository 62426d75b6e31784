"""Where the full KV should live by default: `--vericache-full-tier host` against `device`.

Each server is started with every memory setting at its default (the demo model in float32, no
`--max-total-tokens`: SGLang sizes its KV pool from the memory it finds), as a user's first
launch is. Per server: resident memory of its process group idle after startup and after the
requests, and decode speed on held-out code (a 3,000-token stdlib source cut before a
definition, 128 greedy tokens, the first-token time subtracted as bench/multilevel.py does) at
batch 1 and batch 4, one level and with the n-gram drafter, as ratios to plain SGLang measured
in the same run. Every output is compared with plain SGLang's.

    .venv/bin/python -m bench.placement [--write-docs docs/memory.md]
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from bench import cli, tables
from bench.docs_section import replace_section
from bench.multilevel import MODULES, before_last_definition, measure_decode
from bench.serving import COMMON, request
from vericache_sglang import models
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_args import VERICACHE
from vericache_tools.server_process import ServerProcess

SERVERS = {
    "plain SGLang": [],
    **{f"VeriCache {tier}, {level}": [*VERICACHE, "--vericache-full-tier", tier, *drafter]
       for tier in ("host", "device")
       for level, drafter in (("one level", ["--vericache-drafter", "none"]),
                               ("ngram", ["--vericache-drafter", "ngram"]))},
}


def _payloads(tokenizer, prompt_tokens: int, new_tokens: int) -> dict[str, list[dict]]:
    def code(module: str) -> dict:
        return request(before_last_definition(
            tokenizer, stdlib_ids(tokenizer, module, prompt_tokens, start=200)), new_tokens)

    return {"batch 1": [code(MODULES[0])], "batch 4": [code(m) for m in MODULES]}


def main() -> None:
    parser = cli.parser("bench.placement", __doc__)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--write-docs", type=Path, help="docs page with a placement section")
    args = parser.parse_args()
    target = models.prepare().target
    tokenizer = AutoTokenizer.from_pretrained(target)
    workloads = _payloads(tokenizer, args.prompt_tokens, args.max_new_tokens)
    rows, plain = [], {}
    for name, extra in SERVERS.items():
        print(f"[{name}] starting", flush=True)
        with ServerProcess(target, [*COMMON, *extra]) as server:
            idle = server.rss_bytes()
            row = {"server": name, "idle_gb": idle / 2**30}
            for workload, payloads in workloads.items():
                measured = measure_decode(server, payloads)
                outputs = measured["outputs"]
                if name == "plain SGLang":
                    plain[workload] = (measured["tok_s"], outputs)
                row[workload] = measured["tok_s"] / plain[workload][0]
                row[f"{workload} identical"] = outputs == plain[workload][1]
            row["after_gb"] = server.rss_bytes() / 2**30
        print(f"[{name}] {row}", flush=True)
        rows.append(row)
    text = tables.table(
        ["server", "idle RSS (GB)", "RSS after (GB)", "decode, batch 1", "decode, batch 4",
         "identical"],
        [[r["server"], f"{r['idle_gb']:.1f}", f"{r['after_gb']:.1f}", f"{r['batch 1']:.2f}x",
          f"{r['batch 4']:.2f}x", "yes" if all(r[f"{w} identical"] for w in workloads) else "NO"]
         for r in rows]) + (
        "\n\nDecode speed as a ratio to plain SGLang in the same run; measured by "
        "`python -m bench.placement`, every memory setting at its default.")
    print(text)
    if args.write_docs:
        replace_section(args.write_docs, "placement", text)


if __name__ == "__main__":
    main()
