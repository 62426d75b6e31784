"""Two-level drafting against plain SGLang and single-level VeriCache, in one run.

Workloads on long real contexts (Python standard library sources, up to 2,500 tokens, cut
before a definition's first line): code continuation (the model writes the next definition)
and chat (a question about the source), at batch 1 and batch 4, greedy, float32. The server's
cache is flushed (and with it the n-gram corpus, which would otherwise draft a prompt's answer
from an earlier workload's), then each prompt is sent once with one new token first, so that
the measured request finds its prompt in the radix cache, and then once more, timed: that is
the time to the first token (on this CPU about 1.5 s for 2,200 cached tokens, SGLang's
torch_native extend attending from every cached position), and it is subtracted from the
measured request's, as bench/spec_decode.py does, so that decode tok/s counts decoding alone
(with `--repeats N`, all of it is done N times and the fastest decode kept: noise here only
ever slows a run down). Each workload's first answer is printed, and the table says how much
of the answers repeats text already in them (`repeated_share`): the demo model's greedy code
answers fall into loops, which a copying drafter predicts.

Servers: plain SGLang; VeriCache with a 4-bit tier drafting one token per forward; the same
with SGLang's n-gram corpus proposing under it (`--vericache-drafter ngram`); the same with the
distilled draft model proposing (`--vericache-draft-model`, vericache_tools/distill.py); and
SGLang's own NGRAM speculative decoding where it starts on this machine. Per server and
workload: output tokens per second of decoding, target-model forwards per emitted token
(VeriCache: level-1 forwards over the compressed tier plus verification forwards, per
request), and E at each level: tokens per verification (level 0), drafts per level-1 forward
(level 1), proposals level 1 kept (level 2). Every output is compared with plain SGLang's.

    .venv/bin/python -m bench.multilevel [--full-tier host|device] [--workloads "code, batch 1"]
        [--servers "VeriCache + ngram"] [--repeats 3] [--write-docs docs/drafting.md]
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from transformers import AutoTokenizer

from bench import cli, tables
from bench.docs_section import replace_section
from bench.serving import (
    COMMON,
    chat_ids,
    request,
    send_together,
    start_failure,
)
from vericache_sglang import models
from vericache_sglang.speculative.meta_info import (
    DRAFT_FORWARDS_KEY,
    DRAFTER_KEPT_KEY,
    DRAFTER_PROPOSED_KEY,
)
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_args import VERICACHE
from vericache_tools.server_process import ServerProcess, ServerStartError

BATCH = ["--max-running-requests", "4"]
EVERY_DEFAULT = "VeriCache, every default"
"""`--enable-vericache` alone: what a new user starts (its full tier, compressor, drafter and
draft lengths at their defaults)."""
SERVERS = {
    "plain SGLang": [],
    EVERY_DEFAULT: ["--enable-vericache"],
    "VeriCache, one level": [*VERICACHE, "--vericache-drafter", "none"],
    "VeriCache + ngram": [*VERICACHE, "--vericache-drafter", "ngram"],
    "SGLang NGRAM": ["--speculative-algorithm", "NGRAM", "--disable-overlap-schedule"],
}
MODULES = ["argparse", "difflib", "inspect", "typing"]
UNSEEN_MODULES = ["smtplib", "ftplib", "mailbox", "imaplib"]
"""Sources no test reads (`--modules unseen`): a check that the defaults were not tuned to the
tests' prompts."""
DEFAULT_NEW_TOKENS = 128
"""Greedy tokens per request unless `--max-new-tokens` says otherwise."""


def before_last_definition(tokenizer, ids: list[int]) -> list[int]:
    """`ids` up to the line that opens their last `def` or `class`, so the model writes the next
    definition. A cut inside a line once ended the code prompt in a regex literal, and the demo
    model answered with a loop any n-gram drafter predicts: that measured the loop, not code
    continuation."""
    pieces = [tokenizer.decode([i]) for i in ids]
    for end in range(len(ids) - 1, 0, -1):
        before = "".join(pieces[max(0, end - 4) : end])
        after = "".join(pieces[end : end + 8])
        # The tokenizer may join a newline with the indentation after it.
        if re.search(r"\n[ \t]*$", before) and re.match(r"[ \t]*(def|class) ", after):
            return ids[:end]
    raise ValueError("the code prompt has no def or class line to stop before")


def workloads(tokenizer, prompt_tokens: int, new_tokens: int,
              modules: list[str] = MODULES) -> dict[str, list[dict]]:
    """Code continuation and chat about code of `modules`' sources, at batch 1 (the first)
    and batch 4, by name."""
    def code(module: str) -> list[int]:
        return before_last_definition(
            tokenizer, stdlib_ids(tokenizer, module, prompt_tokens, start=200))

    def chat(module: str) -> list[int]:
        source = tokenizer.decode(code(module))
        return chat_ids(tokenizer, "Explain what this code does, function by function."
                        f"\n\n```python\n{source}\n```")

    return {
        "code, batch 1": [request(code(modules[0]), new_tokens)],
        "chat, batch 1": [request(chat(modules[0]), new_tokens, ignore_eos=False)],
        "code, batch 4": [request(code(m), new_tokens) for m in modules],
        "chat, batch 4": [request(chat(m), new_tokens, ignore_eos=False) for m in modules],
    }


def repeated_share(prompts: list[list[int]], answers: list[list[int]], n: int = 4) -> float:
    """Share of answer tokens that end an n-token sequence already seen earlier in their
    prompt or answer: what a copying drafter can predict. A small model's greedy answer often
    turns into a loop, and this says how much of a workload's speed-up is the loop."""
    repeated = total = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        text = [*prompt, *answer]
        seen = {tuple(text[i - n : i]) for i in range(n, len(prompt) + 1)}
        for i in range(len(prompt) + 1, len(text) + 1):
            gram = tuple(text[i - n : i])
            repeated += gram in seen
            seen.add(gram)
        total += len(answer)
    return repeated / max(total, 1)


def measure_decode(server: ServerProcess, payloads: list[dict], repeats: int = 1) -> dict:
    """Decode tok/s of the payloads sent together, the best of `repeats` timings (each less its
    own time to the first token): the machine's noise only ever slows a run down. Each timing
    starts from a flushed server, whose n-gram corpus has not seen the answers (it learns every
    answer, and drafts a repeated request from its own earlier one). Every repeat's outputs are
    kept for the identity check."""
    warm = [{**p, "sampling_params": {**p["sampling_params"], "max_new_tokens": 1}}
            for p in payloads]
    best, runs = float("inf"), []
    for _ in range(repeats):
        server.flush_cache()
        send_together(server, warm)
        began = time.monotonic()
        send_together(server, warm)
        first_token = time.monotonic() - began
        began = time.monotonic()
        outs = send_together(server, payloads)
        best = min(best, time.monotonic() - began - first_token)
        runs.append([out["output_ids"] for out in outs])
    seconds = best
    generated = sum(len(out["output_ids"]) for out in outs)
    meta = [out["meta_info"] for out in outs]

    def total(key: str) -> int:
        # SGLang's counters are numbers; VeriCache's per-request figures one-element lists.
        values = [m.get(key) or 0 for m in meta]
        return sum(v[0] if isinstance(v, list) else v for v in values)

    rounds = total("spec_verify_ct")
    drafted = sum(round(m.get("spec_cap_length", 0) * m.get("spec_verify_ct", 0)) for m in meta)
    forwards = total(DRAFT_FORWARDS_KEY)
    decoded = generated - len(outs)  # the first tokens came with the time subtracted
    row = {"outputs": runs, "tok_s": decoded / max(seconds, 1e-9),
           "forwards_per_token": 1.0, "E0": None, "E1": None, "kept": None}
    if rounds:
        row["E0"] = (generated - len(outs)) / rounds
    if DRAFT_FORWARDS_KEY in meta[0]:
        row.update(forwards_per_token=(forwards + rounds) / generated,
                   E1=drafted / max(forwards, 1))
    if DRAFTER_PROPOSED_KEY in meta[0]:
        row["kept"] = f"{total(DRAFTER_KEPT_KEY)}/{total(DRAFTER_PROPOSED_KEY)}"
    return row


def server_args(full_tier: str, drafter: Path) -> dict[str, list[str]]:
    """Every server's own arguments by name, VeriCache's with its full tier (but the one at
    every default); the draft-model server drafts with `drafter`."""
    chosen = {**SERVERS, "VeriCache + draft model": [
        *VERICACHE, "--vericache-draft-model", str(drafter)]}
    return {name: [*extra, "--vericache-full-tier", full_tier]
            if "--enable-vericache" in extra and name != EVERY_DEFAULT else extra
            for name, extra in chosen.items()}


def identical(row: dict, reference: list[list[int]]) -> int:
    """How many of a workload's requests answered as plain SGLang did, in every timed run."""
    return sum(all(run[j] == want for run in row["outputs"]) for j, want in enumerate(reference))


def main() -> None:
    parser = cli.parser("bench.multilevel", __doc__)
    parser.add_argument("--prompt-tokens", type=int, default=2500)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_NEW_TOKENS)
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs per server and workload; the table takes the fastest "
                        "(default: %(default)s)")
    parser.add_argument("--full-tier", default="host", choices=["host", "device"],
                        help="--vericache-full-tier of the VeriCache servers (default: host)")
    parser.add_argument("--modules", choices=["tests", "unseen"], default="tests",
                        help="the stdlib sources of the prompts: those the tests also read, or "
                        f"{', '.join(UNSEEN_MODULES)}, which no test reads (default: tests)")
    parser.add_argument("--workloads", nargs="+", metavar="NAME",
                        help="run only these workloads (e.g. 'code, batch 1'; default: all)")
    parser.add_argument("--servers", nargs="+", metavar="NAME",
                        help="run only these servers besides plain SGLang (the reference; "
                        f"default: all of {', '.join(SERVERS)}, VeriCache + draft model)")
    parser.add_argument("--write-docs", type=Path, help="docs page with a multilevel section "
                        "(multilevel-host or multilevel-device, after --full-tier; with "
                        "another --max-new-tokens N, multilevel-device-N)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    prepared = models.prepare()
    model = prepared.target
    tokenizer = AutoTokenizer.from_pretrained(model)
    chosen_workloads = workloads(tokenizer, args.prompt_tokens, args.max_new_tokens,
                                 UNSEEN_MODULES if args.modules == "unseen" else MODULES)
    if args.workloads:
        unknown = set(args.workloads) - set(chosen_workloads)
        if unknown:
            parser.error(f"unknown workloads {sorted(unknown)}; "
                         f"choose from {list(chosen_workloads)}")
        chosen_workloads = {name: chosen_workloads[name] for name in args.workloads}
    servers = server_args(args.full_tier, prepared.drafter)
    if args.servers:
        unknown = set(args.servers) - set(servers)
        if unknown:
            parser.error(f"unknown servers {sorted(unknown)}; choose from {list(servers)}")
        servers = {name: servers[name] for name in ["plain SGLang", *args.servers]}
    results: dict[str, dict[str, dict] | str] = {}
    for name, extra in servers.items():
        print(f"[bench] {name} ...", flush=True)
        try:
            with ServerProcess(model, [*COMMON, *BATCH, *extra]) as server:
                results[name] = {w: measure_decode(server, p, args.repeats)
                                 for w, p in chosen_workloads.items()}
        except ServerStartError as e:
            results[name] = start_failure(e)
            print(f"[bench] {name}: {results[name]}", flush=True)
            continue
        for w, row in results[name].items():
            print(f"[bench] {name} / {w}: {row['tok_s']:.2f} tok/s", flush=True)

    plain = results["plain SGLang"]
    shares = {w: repeated_share([p["input_ids"] for p in payloads], plain[w]["outputs"][0])
              for w, payloads in chosen_workloads.items()}
    for workload in chosen_workloads:
        answer = tokenizer.decode(plain[workload]["outputs"][0][0])
        print(f"[bench] {workload}, plain SGLang's first answer: {answer!r}")
    length = ("" if args.max_new_tokens == DEFAULT_NEW_TOKENS
              else f" --max-new-tokens {args.max_new_tokens}")
    length += f" --repeats {args.repeats}" if args.repeats > 1 else ""
    length += " --modules unseen" if args.modules == "unseen" else ""
    lines = [
        f"\nMeasured by `python -m bench.multilevel --full-tier {args.full_tier}{length}` "
        f"(contexts of up to {args.prompt_tokens} tokens, {args.max_new_tokens} greedy tokens per "
        "request, float32, prompts cached first, decode tok/s without the time to the first "
        "token, " + (f"the fastest of {args.repeats} timed runs of each row, every run's output "
                     "compared" if args.repeats > 1 else "one run")
        + " on this 2-core CPU machine):\n",
    ]
    rows = []
    for workload in chosen_workloads:
        for name in servers:
            row = results[name]
            if isinstance(row, str):
                continue
            row = row[workload]
            reference = plain[workload]["outputs"][0]
            rows.append([workload, name, f"{row['tok_s']:.2f}",
                         f"{row['tok_s'] / plain[workload]['tok_s']:.2f}x",
                         f"{row['forwards_per_token']:.2f}",
                         "-" if row["E0"] is None else f"{row['E0']:.1f}",
                         "-" if row["E1"] is None else f"{row['E1']:.2f}",
                         row["kept"] or "-", f"{identical(row, reference)} of {len(reference)}"])
    lines.append(tables.table(
        ["workload", "server", "decode tok/s", "vs plain", "target forwards per token",
         "E level 0", "drafts per level-1 forward", "level-2 kept", "outputs = plain"], rows))
    lines += ["", "Answer tokens that end a 4-token sequence already in their prompt or answer "
              "(plain SGLang's answers; what a copying drafter can predict): " + ", ".join(
                  f"{w} {share:.0%}" for w, share in shares.items()) + "."]
    lines += [""] + [f"{name}: {row}" for name, row in results.items() if isinstance(row, str)]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.write_docs:
        suffix = "" if args.max_new_tokens == DEFAULT_NEW_TOKENS else f"-{args.max_new_tokens}"
        replace_section(args.write_docs, f"multilevel-{args.full_tier}{suffix}", table)


if __name__ == "__main__":
    main()
