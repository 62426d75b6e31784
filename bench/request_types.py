"""Which requests draft: the share of emitted tokens that came from drafting rounds, by type.

One VeriCache server (the demo model in float32, 4-bit tier, draft length adapting from 16,
the full KV on the device: where it lives changes no count here).
For each request type a batch of four requests runs alone; `/metrics` counters before and
after give the tokens emitted by verified rounds, the plain decode steps, and the rounds. The
share is round tokens / (round tokens + plain steps) (the token each prefill emits is in
neither); E is round tokens per verified round. The last batch mixes three greedy requests
with one that cannot draft (a custom logit processor): before per-request drafting, that one
request turned drafting off for the whole batch. With `--drafter ngram` the n-gram corpus
proposes under the compressed-KV drafter, and the table adds drafts per level-1 forward and the
proposals level 1 kept.

    .venv/bin/python -m bench.request_types [--max-new-tokens 64] [--drafter ngram]
        [--only grammar tools] [--write-docs docs/drafting.md]
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import requests
from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor
from transformers import AutoTokenizer

from bench import cli, tables
from bench.docs_section import replace_section
from bench.serving import chat_ids, request, send_together
from examples.tools import call_schema, system_prompt
from vericache_sglang import models
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_args import VERICACHE, server_args
from vericache_tools.server_process import ServerProcess

SERVER = [*server_args(chunked_prefill_size=None, max_running_requests=4, metrics=True,
                      custom_logit_processor=True),
          *VERICACHE, "--vericache-draft-length", "16", "--vericache-full-tier", "device"]
"""/metrics, and requests with a custom logit processor."""
MODULES = ["argparse", "difflib", "inspect", "typing"]
COUNTERS = ("verify_rounds", "emitted_tokens", "plain_decode_steps", "accepted_drafts",
            "drafted_tokens", "draft_forwards", "drafter_proposed", "drafter_kept")
CUSTOM = {"custom_logit_processor": DisallowedTokensLogitsProcessor.to_str()}


def batches(tokenizer, new_tokens: int) -> dict[str, list[dict]]:
    """A batch of four requests per request type, by name."""
    def code(module: str) -> list[int]:
        return stdlib_ids(tokenizer, module, 600, start=200)

    def greedy(ids: list[int], extra: dict | None = None, **params) -> dict:
        return request(ids, new_tokens, extra, **params)

    chat = partial(chat_ids, tokenizer)

    questions = ["What is 17 times 23?", "Read the first 5 lines of the json module.",
                 "Compute 2 to the power of 10.", "Read lines 10 to 20 of heapq."]
    tools = ["calculate", "read_stdlib_lines", "finish"]
    schema = json.dumps(call_schema(tools))
    describe = json.dumps({"type": "object", "properties": {
        "name": {"type": "string"}, "purpose": {"type": "string"},
        "functions": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "purpose", "functions"]})
    return {
        "greedy": [greedy(code(m)) for m in MODULES],
        "sampled (T 0.8, top-p 0.95)": [greedy(code(m), temperature=0.8, top_p=0.95)
                                        for m in MODULES],
        "logprobs (top 5)": [greedy(code(m), {"return_logprob": True,
                                              "top_logprobs_num": 5}) for m in MODULES],
        "penalties (frequency, presence, repetition)": [
            greedy(code(m), frequency_penalty=0.3, presence_penalty=0.2,
                   repetition_penalty=1.1) for m in MODULES],
        "grammar (JSON schema)": [
            greedy(chat(f"Describe the Python module {m} as JSON."), json_schema=describe,
                   ignore_eos=False) for m in MODULES],
        "tools (JSON-schema tool call)": [
            greedy(chat(q, system_prompt(tools)), json_schema=schema, ignore_eos=False)
            for q in questions],
        "custom logit processor": [greedy(code(m), CUSTOM, custom_params={"token_ids": [13]})
                                   for m in MODULES],
        "3 greedy + 1 custom logit processor": [
            *[greedy(code(m)) for m in MODULES[:3]],
            greedy(code(MODULES[3]), CUSTOM, custom_params={"token_ids": [13]})],
    }


def _counters(server: ServerProcess) -> dict[str, float]:
    text = requests.get(f"{server.url}/metrics", timeout=60).text
    values = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for name in COUNTERS:
            if line.startswith(f"vericache:{name}_total"):
                values[name] += float(line.rsplit(" ", 1)[1])
    return values


def measure(server: ServerProcess, batch: list[dict]) -> dict:
    """The batch run alone: its tokens from verified rounds and from plain steps, the share
    from rounds, E, drafts per level-1 forward and the level-2 proposals kept."""
    before = _counters(server)
    send_together(server, batch)
    after = _counters(server)
    counts = {name: after[name] - before[name] for name in COUNTERS}
    emitted, plain = counts["emitted_tokens"], counts["plain_decode_steps"]
    return {"emitted": int(emitted), "plain": int(plain),
            "share": emitted / (emitted + plain) if emitted + plain else 0.0,
            "E": emitted / counts["verify_rounds"] if counts["verify_rounds"] else None,
            "level1": (f"{counts['drafted_tokens'] / counts['draft_forwards']:.2f}"
                       if counts["draft_forwards"] else "-"),
            "kept": f"{int(counts['drafter_kept'])}/{int(counts['drafter_proposed'])}"}


def main() -> None:
    parser = cli.parser("bench.request_types", __doc__)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--drafter", choices=["none", "ngram"], default="none",
                        help="level-2 drafter of the VeriCache server")
    parser.add_argument("--only", nargs="+", metavar="WORD",
                        help="run only the request types whose names contain one of these")
    parser.add_argument("--write-docs", type=Path,
                        help="docs page with a request-types section to replace")
    args = parser.parse_args()
    model = models.prepare().target
    tokenizer = AutoTokenizer.from_pretrained(model)
    chosen = {name: batch for name, batch in batches(tokenizer, args.max_new_tokens).items()
              if not args.only or any(word in name for word in args.only)}
    stacked = args.drafter != "none"
    rows = []
    with ServerProcess(model, [*SERVER, "--vericache-drafter", args.drafter]) as server:
        for name, batch in chosen.items():
            rows.append((name, measure(server, batch)))
            print(f"[bench] {name}: {rows[-1][1]['share']:.0%} of decoded tokens from rounds",
                  flush=True)
    command = "python -m bench.request_types" + (f" --drafter {args.drafter}" if stacked else "")
    lines = [
        f"\nMeasured by `{command}` (batches of 4 requests, up to {args.max_new_tokens} new "
        "tokens each, 600-token code prompts or short chats, float32, one run on this 2-core "
        "CPU machine):\n",
        tables.table(["request type", "tokens from rounds", "plain steps", "share from rounds",
                      "E (tokens per round)"]
                     + (["drafts per level-1 forward", "level-2 kept"] if stacked else []),
                     [[name, r["emitted"], r["plain"], f"{r['share']:.0%}",
                       "-" if r["E"] is None else f"{r['E']:.2f}"]
                      + ([r["level1"], r["kept"]] if stacked else []) for name, r in rows]),
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.write_docs:
        replace_section(args.write_docs,
                        "request-types" + (f"-{args.drafter}" if stacked else ""), table)


if __name__ == "__main__":
    main()
