"""Where the full KV should live by default: `--vericache-full-tier host` against `device`.

Each server is started with every memory setting at its default (the demo model in float32, no
`--max-total-tokens`: SGLang sizes its KV pool from the memory it finds), as a user's first
launch is. Per server: resident memory of its process group idle after startup and after the
requests, and decode speed on held-out code (a 3,000-token stdlib source cut before a
definition, 128 greedy tokens, the first-token time subtracted as bench/multilevel.py does) at
batch 1 and batch 4, one level and with the n-gram drafter, as ratios to plain SGLang measured
in the same run. Every output is compared with plain SGLang's.

`python -m bench` runs it as its placement suite at its full size (`measure` gives the rows).

    .venv/bin/python -m bench.placement [--write-docs docs/memory.md]
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from bench import cli, tables
from bench.docs_section import replace_section
from bench.multilevel import MODULES, before_last_definition, measure_decode
from bench.serving import COMMON, request
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_args import VERICACHE
from vericache_tools.server_process import ServerProcess

PROMPT_TOKENS = 3000
"""The held-out code context (its default; `python -m bench` runs it at this length)."""
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


def measure(model: Path, prompt_tokens: int, new_tokens: int) -> list[dict]:
    """One row per server: resident memory idle and after the requests, decode speed per
    workload as a ratio to plain SGLang's, and whether its outputs equalled plain SGLang's."""
    workloads = _payloads(AutoTokenizer.from_pretrained(model), prompt_tokens, new_tokens)
    rows, plain = [], {}
    for name, extra in SERVERS.items():
        cli.log(f"[{name}] starting")
        with ServerProcess(model, [*COMMON, *extra]) as server:
            row = {"server": name, "idle_gb": server.rss_bytes() / 2**30}
            for workload, payloads in workloads.items():
                measured = measure_decode(server, payloads)
                if name == "plain SGLang":
                    plain[workload] = (measured["tok_s"], measured["outputs"])
                row[workload] = measured["tok_s"] / plain[workload][0]
                row[f"{workload} identical"] = measured["outputs"] == plain[workload][1]
            row["after_gb"] = server.rss_bytes() / 2**30
        cli.log(f"[{name}] {row}")
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    return tables.table(
        ["server", "idle RSS (GB)", "RSS after (GB)", "decode, batch 1", "decode, batch 4",
         "identical"],
        [[r["server"], f"{r['idle_gb']:.1f}", f"{r['after_gb']:.1f}", f"{r['batch 1']:.2f}x",
          f"{r['batch 4']:.2f}x", "yes" if identical(r) else "NO"] for r in rows]) + (
        "\n\nDecode speed as a ratio to plain SGLang in the same run; measured by "
        "`python -m bench.placement`, every memory setting at its default.")


def identical(row: dict) -> bool:
    """Whether every workload's outputs equalled plain SGLang's."""
    return all(value for key, value in row.items() if key.endswith(" identical"))


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.placement", __doc__)
    cli.add_model(parser)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--write-docs", type=Path, help="docs page with a placement section")
    args = parser.parse_args(argv)
    rows = measure(cli.model_dir(args.model), args.prompt_tokens, args.max_new_tokens)
    text = markdown(rows)
    print(text)
    if args.write_docs:
        replace_section(args.write_docs, "placement", text)
    return 0 if all(map(identical, rows)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
