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

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor
from transformers import AutoTokenizer

from bench.docs_section import replace_section
from examples.tools import call_schema, system_prompt
from vericache_sglang import models
from vericache_sglang.prompts import stdlib_ids
from vericache_sglang.server_process import ServerProcess

SERVER = ["--dtype", "float32", "--random-seed", "0", "--enable-metrics",
          "--max-total-tokens", "32768", "--max-running-requests", "4",
          "--enable-custom-logit-processor", "--enable-vericache",
          "--vericache-compressor", "kivi:bits=4", "--vericache-draft-length", "16",
          "--vericache-full-tier", "device"]
MODULES = ["argparse", "difflib", "inspect", "typing"]
COUNTERS = ("verify_rounds", "emitted_tokens", "plain_decode_steps", "accepted_drafts",
            "drafted_tokens", "draft_forwards", "drafter_proposed", "drafter_kept")
CUSTOM = {"custom_logit_processor": DisallowedTokensLogitsProcessor.to_str()}


def _batches(tokenizer, new_tokens: int) -> dict[str, list[dict]]:
    def code(module: str) -> list[int]:
        return stdlib_ids(tokenizer, module, 600, start=200)

    def chat(text: str, system: str | None = None) -> list[int]:
        turns = [{"role": "system", "content": system}] if system else []
        return tokenizer.apply_chat_template([*turns, {"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)

    def request(ids: list[int], extra: dict | None = None, **params) -> dict:
        sampling = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
        return {"input_ids": ids, "sampling_params": {**sampling, **params}, **(extra or {})}

    questions = ["What is 17 times 23?", "Read the first 5 lines of the json module.",
                 "Compute 2 to the power of 10.", "Read lines 10 to 20 of heapq."]
    tools = ["calculate", "read_stdlib_lines", "finish"]
    schema = json.dumps(call_schema(tools))
    describe = json.dumps({"type": "object", "properties": {
        "name": {"type": "string"}, "purpose": {"type": "string"},
        "functions": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "purpose", "functions"]})
    return {
        "greedy": [request(code(m)) for m in MODULES],
        "sampled (T 0.8, top-p 0.95)": [request(code(m), temperature=0.8, top_p=0.95)
                                        for m in MODULES],
        "logprobs (top 5)": [request(code(m), {"return_logprob": True,
                                               "top_logprobs_num": 5}) for m in MODULES],
        "penalties (frequency, presence, repetition)": [
            request(code(m), frequency_penalty=0.3, presence_penalty=0.2,
                    repetition_penalty=1.1) for m in MODULES],
        "grammar (JSON schema)": [
            request(chat(f"Describe the Python module {m} as JSON."), json_schema=describe,
                    ignore_eos=False) for m in MODULES],
        "tools (JSON-schema tool call)": [
            request(chat(q, system_prompt(tools)), json_schema=schema, ignore_eos=False)
            for q in questions],
        "custom logit processor": [request(code(m), CUSTOM, custom_params={"token_ids": [13]})
                                   for m in MODULES],
        "3 greedy + 1 custom logit processor": [
            *[request(code(m)) for m in MODULES[:3]],
            request(code(MODULES[3]), CUSTOM, custom_params={"token_ids": [13]})],
    }


def _counters(server: ServerProcess) -> dict[str, float]:
    text = requests.get(f"{server.url}/metrics", timeout=60).text
    values = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for name in COUNTERS:
            if line.startswith(f"vericache:{name}_total"):
                values[name] += float(line.rsplit(" ", 1)[1])
    return values


def _measure(server: ServerProcess, batch: list[dict]) -> dict[str, float]:
    before = _counters(server)
    with ThreadPoolExecutor(len(batch)) as pool:
        list(pool.map(lambda p: server.generate(p, timeout=3600), batch))
    after = _counters(server)
    return {name: after[name] - before[name] for name in COUNTERS}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.request_types", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    batches = {name: batch for name, batch in _batches(tokenizer, args.max_new_tokens).items()
               if not args.only or any(word in name for word in args.only)}
    stacked = args.drafter != "none"
    rows = []
    with ServerProcess(model, [*SERVER, "--vericache-drafter", args.drafter]) as server:
        for name, batch in batches.items():
            counts = _measure(server, batch)
            emitted, plain = counts["emitted_tokens"], counts["plain_decode_steps"]
            share = emitted / (emitted + plain) if emitted + plain else 0.0
            e = emitted / counts["verify_rounds"] if counts["verify_rounds"] else None
            level1 = (f"{counts['drafted_tokens'] / counts['draft_forwards']:.2f}"
                      if counts["draft_forwards"] else "-")
            kept = f"{int(counts['drafter_kept'])}/{int(counts['drafter_proposed'])}"
            rows.append((name, int(emitted), int(plain), share, e, level1, kept))
            print(f"[bench] {name}: {share:.0%} of decoded tokens from rounds", flush=True)
    command = "python -m bench.request_types" + (f" --drafter {args.drafter}" if stacked else "")
    lines = [
        f"\nMeasured by `{command}` (batches of 4 requests, up to {args.max_new_tokens} new "
        "tokens each, 600-token code prompts or short chats, float32, one run on this 2-core "
        "CPU machine):\n",
        "| request type | tokens from rounds | plain steps | share from rounds "
        "| E (tokens per round) |" + (" drafts per level-1 forward | level-2 kept |"
                                      if stacked else ""),
        "|---|---|---|---|---|" + ("---|---|" if stacked else ""),
    ]
    lines += [f"| {name} | {emitted} | {plain} | {share:.0%} | "
              f"{'-' if e is None else f'{e:.2f}'} |"
              + (f" {level1} | {kept} |" if stacked else "")
              for name, emitted, plain, share, e, level1, kept in rows]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.write_docs:
        replace_section(args.write_docs,
                        "request-types" + (f"-{args.drafter}" if stacked else ""), table)


if __name__ == "__main__":
    main()
