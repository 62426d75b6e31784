"""Drafting statistics, full-KV traffic and decode throughput of VeriCache on long real contexts.

Real SGLang servers, the demo model in float32, greedy decoding. The prompts are the starts of
Python standard library sources (2k-6k tokens). A plain server answers every prompt first and is
stopped; then one VeriCache server per configuration (a compressor spec at a fixed draft length
k, `SPEC@K`) answers the same prompts, one at a time. Only one server runs at any time.

Per configuration:

  E          tokens emitted per verification round: decode tokens (completion - 1, the first
             token comes from prefill) over `spec_verify_ct`. The last round of a request drafts
             only what max_new_tokens leaves, so E is a little below 1 + k * acceptance;
  E (full)   1 + k * acceptance: E of a round drafting the full k (what a long output tends to);
  acceptance accepted drafts (`spec_num_correct_drafts`) over drafted tokens
             (`spec_cap_length` * rounds);
  KV read    bytes of full-precision KV read per emitted token, from the model config: plain
             decoding reads the committed KV once per token, a verify round reads it once for
             its k + 1 tokens (committed length taken at the middle of each request's decode,
             exact to within max_new_tokens / prompt length);
  tok/s      decode throughput, prefill subtracted (the time of a 1-token request on the same
             prompt; the prefix cache is flushed before each timed request, so both prefill in
             full);
  identical  whether every output equals plain SGLang's token for token (it must: float32).

Not a test: it prints a progress line per request and a markdown table, and with --write-docs
puts the table and the exact command into the marked section of the given markdown file.
`python -m bench` runs it as its spec_decode suite (`run` gives the figures).

    .venv/bin/python -m bench.spec_decode --quick
    .venv/bin/python -m bench.spec_decode --write-docs docs/spec_decode.md
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import cli, tables
from bench.cli import log
from bench.docs_section import markers, replace_section
from bench.serving import DTYPE_BYTES, first_difference, kv_bytes_per_token, request
from vericache_tools.prompts import file_prompt
from vericache_tools.server_args import server_args
from vericache_tools.server_process import ServerProcess

# (stdlib source, prompt tokens): the start of each file.
DEFAULT_PROMPTS = ["textwrap.py:2048", "argparse.py:3072", "difflib.py:4096", "inspect.py:6144"]
DEFAULT_CONFIGS = ["kivi:bits=4@8", "kivi:bits=4@16", "kivi:bits=4@32", "kivi:bits=8@32",
                   "snapkv:ratio=0.25@32"]
QUICK_PROMPTS = ["textwrap.py:2048", "argparse.py:3072"]
QUICK_CONFIGS = ["kivi:bits=4@16", "kivi:bits=4@32", "kivi:bits=8@32"]
SECTION = "spec_decode"


@dataclass
class Prompt:
    name: str
    ids: list[int]


@dataclass
class Config:
    spec: str
    k: int

    @classmethod
    def parse(cls, text: str) -> Config:
        spec, sep, k = text.rpartition("@")
        if not sep or not spec or not k.isdigit() or int(k) < 1:
            raise argparse.ArgumentTypeError(f"config must be SPEC@K (K >= 1), got {text!r}")
        return cls(spec, int(k))

    @property
    def label(self) -> str:
        return f"{self.spec}@{self.k}"

    def server_args(self) -> list[str]:
        k = str(self.k)
        return ["--enable-vericache", "--vericache-compressor", self.spec,
                "--vericache-draft-length", k, "--vericache-min-draft-length", k,
                "--vericache-max-draft-length", k, "--vericache-drafter", "none"]


@dataclass
class Run:
    """One request's outcome on one server."""

    prompt: Prompt
    output_ids: list[int]
    meta: dict
    seconds: float
    prefill_seconds: float

    @property
    def decode_tokens(self) -> int:
        return len(self.output_ids) - 1

    @property
    def decode_seconds(self) -> float:
        return max(self.seconds - self.prefill_seconds, 1e-9)


@dataclass
class Row:
    """A configuration's runs (plain decoding has config None)."""

    config: Config | None
    runs: list[Run] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    def total(self, key: str) -> float:
        return sum(r.meta.get(key, 0) for r in self.runs)

    @property
    def rounds(self) -> int:
        return int(self.total("spec_verify_ct"))

    @property
    def drafted(self) -> int:
        return sum(round(r.meta.get("spec_cap_length", 0) * r.meta.get("spec_verify_ct", 0))
                   for r in self.runs)

    @property
    def accepted(self) -> int:
        return int(self.total("spec_num_correct_drafts"))

    @property
    def decode_tokens(self) -> int:
        return sum(r.decode_tokens for r in self.runs)

    def tokens_per_second(self) -> float:
        return self.decode_tokens / sum(r.decode_seconds for r in self.runs)

    def kv_bytes_read(self, token_bytes: int) -> float:
        """Full KV bytes read over all requests' decoding: once per verification round (or per
        token for plain decoding) at the committed length in the middle of the decode."""
        total = 0.0
        for r in self.runs:
            reads = r.meta["spec_verify_ct"] if self.config else r.decode_tokens
            total += reads * (len(r.prompt.ids) + r.decode_tokens / 2) * token_bytes
        return total

    def histogram(self) -> list[int]:
        bins: list[int] = []
        for r in self.runs:
            h = r.meta.get("spec_correct_drafts_histogram") or []
            bins += [0] * (len(h) - len(bins))
            for i, n in enumerate(h):
                bins[i] += n
        return bins


def load_prompts(entries: list[str], tokenizer) -> list[Prompt]:
    try:
        return [Prompt(*file_prompt(tokenizer, entry)) for entry in entries]
    except ValueError as error:  # a malformed entry or a file shorter than asked
        raise SystemExit(str(error)) from error


def _generate(server: ServerProcess, ids: list[int], n: int) -> tuple[dict, float]:
    # A fresh prefix cache, so that every timed request prefills its whole prompt.
    server.flush_cache()
    began = time.monotonic()
    out = server.generate(request(ids, n))
    seconds = time.monotonic() - began
    if out["meta_info"]["completion_tokens"] != n:
        raise RuntimeError(f"asked {n} tokens, got {out['meta_info']['completion_tokens']}")
    return out, seconds


def serve(model: Path, row: Row, prompts: list[Prompt], dtype: str, new_tokens: int,
          max_total_tokens: int, reference: Row | None) -> None:
    name = row.config.label if row.config else "plain"
    extra = row.config.server_args() if row.config else []
    log(f"{name}: starting server")
    with ServerProcess(model, [*server_args(dtype), *extra],
                       max_total_tokens=max_total_tokens) as server:
        log(f"{name}: healthy after {server.startup_seconds:.0f} s")
        for i, prompt in enumerate(prompts):
            _, prefill = _generate(server, prompt.ids, 1)
            out, seconds = _generate(server, prompt.ids, new_tokens)
            run = Run(prompt, out["output_ids"], out["meta_info"], seconds, prefill)
            row.runs.append(run)
            line = (f"{name} {prompt.name}: {run.decode_tokens / run.decode_seconds:.2f} tok/s "
                    f"(prefill {prefill:.1f} s)")
            meta = run.meta
            if row.config:
                rounds = meta["spec_verify_ct"]
                drafted = round(meta["spec_cap_length"] * rounds)
                accepted = meta["spec_num_correct_drafts"]
                line += (f", rounds {rounds}, drafted {drafted}, accepted {accepted}, "
                         f"E {run.decode_tokens / max(rounds, 1):.2f}")
                if accepted + rounds != run.decode_tokens:
                    line += f" (accepted + rounds != {run.decode_tokens} decode tokens!)"
            if reference is not None:
                expected = reference.runs[i].output_ids
                if run.output_ids == expected:
                    line += ", identical"
                else:
                    at = first_difference(run.output_ids, expected)
                    row.mismatches.append(f"{prompt.name} at token {at}")
                    line += f", MISMATCH with plain SGLang at output token {at}"
                    print(f"!!! {name} {prompt.name}: OUTPUT DIFFERS FROM PLAIN SGLANG at "
                          f"output token {at}", file=sys.stderr, flush=True)
            log(line)


def run(model: Path, prompts: list[Prompt], configs: list[Config], new_tokens: int,
        dtype: str = "float32", max_total_tokens: int | None = None) -> dict:
    """Plain SGLang, then one VeriCache server per configuration, on the same prompts: each
    configuration's figures (the table's columns, its rounds by accepted drafts, its outputs'
    mismatches with plain SGLang's). `max_total_tokens` None: what the longest request needs
    and 1024 more."""
    began = time.monotonic()
    if max_total_tokens is None:
        max_total_tokens = (max(len(p.ids) for p in prompts) + new_tokens
                            + max(c.k for c in configs) + 1024)
    token_bytes = kv_bytes_per_token(model, dtype)
    log(f"{len(prompts)} prompts ({', '.join(p.name for p in prompts)}), "
        f"{len(configs)} configs, {new_tokens} new tokens, full KV "
        f"{token_bytes} B/token ({dtype})")
    plain = Row(None)
    serve(model, plain, prompts, dtype, new_tokens, max_total_tokens, None)
    rows = [Row(c) for c in configs]
    for row in rows:
        serve(model, row, prompts, dtype, new_tokens, max_total_tokens, plain)
    plain_kv = plain.kv_bytes_read(token_bytes) / plain.decode_tokens
    configs_out = []
    for row in rows:
        acceptance = row.accepted / max(row.drafted, 1)
        configs_out.append({
            "spec": row.config.spec, "k": row.config.k,
            "E": row.decode_tokens / max(row.rounds, 1), "E_full": 1 + row.config.k * acceptance,
            "acceptance": acceptance, "accepted": row.accepted, "drafted": row.drafted,
            "rounds": row.rounds, "decode_tokens": row.decode_tokens,
            "kv_read_per_token": row.kv_bytes_read(token_bytes) / row.decode_tokens,
            "tok_s": row.tokens_per_second(), "histogram": row.histogram(),
            "mismatches": row.mismatches})
    return {"model": model.name, "prompts": [p.name for p in prompts], "new_tokens": new_tokens,
            "dtype": dtype, "kv_bytes_per_token": token_bytes,
            "plain": {"kv_read_per_token": plain_kv, "tok_s": plain.tokens_per_second()},
            "configs": configs_out, "seconds": time.monotonic() - began}


def markdown(result: dict) -> str:
    """What was run, the table, and each configuration's rounds by accepted drafts."""
    plain_kv, plain_tps = result["plain"]["kv_read_per_token"], result["plain"]["tok_s"]
    rows = []
    for c in result["configs"]:
        kv, tps = c["kv_read_per_token"], c["tok_s"]
        rows.append([
            f"`{c['spec']}`", c["k"], f"{c['E']:.2f}", f"{c['E_full']:.2f}",
            f"{c['acceptance']:.1%} ({c['accepted']}/{c['drafted']})", c["rounds"],
            f"{kv / 2**20:.2f} / {plain_kv / 2**20:.2f} MiB ({plain_kv / kv:.1f}x less)",
            f"{tps:.2f} / {plain_tps:.2f} ({tps / plain_tps:.2f}x)",
            "yes" if not c["mismatches"] else "**NO**: " + "; ".join(c["mismatches"])])
    table = tables.table(
        ["compressor", "k", "E (tokens/round)", "E (full rounds)", "acceptance", "rounds",
         "full KV read per token: VeriCache / plain", "tok/s VeriCache / plain",
         "identical to plain"], rows, "lrrrrrlll")
    notes = (
        f"Prompts: {', '.join(result['prompts'])} (Python {sys.version_info.major}."
        f"{sys.version_info.minor} standard library); {result['new_tokens']} greedy tokens each "
        f"(`ignore_eos`), `--dtype {result['dtype']}`, fixed draft length k per server. Full "
        f"KV: {result['kv_bytes_per_token']} bytes per token. Run on {result['model']} in "
        f"{result['seconds'] / 60:.0f} min.")
    histograms = "\n".join(f"- `{c['spec']}@{c['k']}`: {c['histogram']}"
                           for c in result["configs"])
    return (f"{notes}\n\n{table}\n\nRounds by accepted drafts "
            f"(`spec_correct_drafts_histogram`, summed over prompts):\n\n{histograms}\n")


def write_docs(path: Path, command: str, body: str) -> None:
    if not path.exists():
        begin, end = markers(SECTION)
        path.write_text("# Drafting and verification on long contexts\n\n"
                        "Written by `bench/spec_decode.py` (see its docstring for the columns)."
                        f"\n\n{begin}\n{end}\n")
    replace_section(path, SECTION, f"\n```\n{command}\n```\n\n{body}\n")


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.spec_decode", __doc__)
    cli.add_model(parser)
    parser.add_argument("--prompts", nargs="+", default=None, metavar="FILE:TOKENS",
                        help="file under the stdlib directory or /usr/share/common-licenses "
                        "(or an absolute path) and prompt tokens, one prompt each (default: "
                        f"{' '.join(DEFAULT_PROMPTS)})")
    parser.add_argument("--configs", nargs="+", type=Config.parse, default=None,
                        metavar="SPEC@K", help="compressor spec at a fixed draft length k, one "
                        f"server each (default: {' '.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true",
                        help=f"prompts {' '.join(QUICK_PROMPTS)}, configs "
                        f"{' '.join(QUICK_CONFIGS)} (unless given)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPE_BYTES),
                        help="--dtype for every server (default: float32, where output identity "
                        "is exact)")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="KV pool size of every server (default: longest prompt + new "
                        "tokens + longest k + 1, plus headroom)")
    parser.add_argument("--write-docs", type=Path, default=None,
                        help="markdown file whose spec_decode section gets the results")
    args = parser.parse_args(argv)
    prompt_entries = args.prompts or (QUICK_PROMPTS if args.quick else DEFAULT_PROMPTS)
    configs = args.configs or [Config.parse(c) for c in
                               (QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS)]

    from transformers import AutoTokenizer

    model = cli.model_dir(args.model)
    prompts = load_prompts(prompt_entries, AutoTokenizer.from_pretrained(model))
    needed = max(len(p.ids) for p in prompts) + args.max_new_tokens + max(c.k for c in configs)
    if args.max_total_tokens is not None and args.max_total_tokens < needed + 1:
        raise SystemExit(f"--max-total-tokens must be at least {needed + 1}")
    result = run(model, prompts, configs, args.max_new_tokens, args.dtype,
                 args.max_total_tokens)
    body = markdown(result)
    print(body)
    log(f"done in {result['seconds'] / 60:.1f} min")
    if args.write_docs:
        write_docs(args.write_docs, cli.invocation("bench.spec_decode", argv), body)
        log(f"wrote {args.write_docs}")
    bad = [f"{c['spec']}@{c['k']}: {m}" for c in result["configs"] for m in c["mismatches"]]
    if bad:
        print("!!! OUTPUT MISMATCHES WITH PLAIN SGLANG (a bug: float32 must be identical):\n  "
              + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
