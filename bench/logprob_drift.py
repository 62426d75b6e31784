"""How far VeriCache's returned logprobs are from plain SGLang's, against plain SGLang's own drift.

VeriCache takes an emitted token's logprobs from the verification forward over k + 1 tokens;
plain SGLang from one-token decode steps. In float32 the two sum in other orders. This sends
one mixed batch (logprobs, frequency and presence penalties, a repetition penalty, a custom
logit processor, all returning logprobs, beside greedy, logit-bias and min_new_tokens
requests) twice to plain SGLang (`--disable-overlap-schedule`, which VeriCache implies) and
twice to VeriCache (4-bit KIVI, draft length from 16), and prints the largest absolute
difference of the token, top and token-id logprobs per request: plain against itself (the
second send finds its prefix cached) and VeriCache against plain. The identity tests'
tolerance (`tests/support/identity.py`, LOGPROB_TOLERANCE) comes from this. `python -m bench`
runs it as its logprob_drift suite (`measure` gives the rows).

    .venv/bin/python -m bench.logprob_drift
"""

from __future__ import annotations

from pathlib import Path

from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor
from transformers import AutoTokenizer

from bench import cli, tables
from bench.serving import request, send_together
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_args import VERICACHE, server_args
from vericache_tools.server_process import ServerProcess

SERVER = server_args(max_running_requests=16, custom_logit_processor=True, overlap=False)
DRAFT = ["--vericache-draft-length", "16"]
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 3,
            "token_ids_logprob": [13, 198, 284, 1134]}
WITH_LOGPROBS = ("logprobs", "penalties", "repetition", "custom_processor")


def _batch(tokenizer) -> dict[str, dict]:
    def greedy(ids: list[int], extra: dict | None = None, **params) -> dict:
        return request(ids, 48, extra, **params)

    heapq, csv = stdlib_ids(tokenizer, "heapq", 400), stdlib_ids(tokenizer, "csv", 700, start=1000)
    bisect = stdlib_ids(tokenizer, "bisect", 300, start=300)
    return {
        "greedy": greedy(heapq),
        "logprobs": greedy(csv, LOGPROBS),
        "penalties": greedy(bisect, LOGPROBS, frequency_penalty=0.4, presence_penalty=0.2),
        "repetition": greedy(heapq, LOGPROBS, repetition_penalty=1.3),
        "logit_bias": greedy(bisect, logit_bias={"13": 4.0, "284": -3.0}),
        "min_new_tokens": greedy(csv, min_new_tokens=12),
        "custom_processor": greedy(
            bisect, {**LOGPROBS, "custom_logit_processor":
                     DisallowedTokensLogitsProcessor.to_str()},
            max_new_tokens=32, custom_params={"token_ids": [13, 284]}),
    }


def _twice(server: ServerProcess, batch: dict[str, dict]) -> list[dict[str, dict]]:
    """The batch's answers, sent concurrently, twice."""
    return [dict(zip(batch, send_together(server, list(batch.values())), strict=True))
            for _ in range(2)]


def _drift(a: dict[str, dict], b: dict[str, dict]) -> dict[str, tuple]:
    """Per logprob request: (same tokens, largest |difference| of token, top, token-id
    logprobs)."""
    rows = {}
    for name in WITH_LOGPROBS:
        ma, mb = a[name]["meta_info"], b[name]["meta_info"]

        def largest(key: str, nested: bool, ma=ma, mb=mb) -> float:
            pairs = (zip(sa, sb, strict=True) if nested else [(sa, sb)]
                     for sa, sb in zip(ma[key], mb[key], strict=True))
            return max(abs(x[0] - y[0]) for step in pairs for x, y in step)

        rows[name] = (a[name]["output_ids"] == b[name]["output_ids"],
                      largest("output_token_logprobs", False),
                      largest("output_top_logprobs", True),
                      largest("output_token_ids_logprobs", True))
    return rows


def measure(model: Path) -> list[dict]:
    """The batch sent twice to plain SGLang and twice to VeriCache: per comparison and logprob
    request, whether the tokens are the same and the largest |difference| of the token, top
    and token-id logprobs."""
    batch = _batch(AutoTokenizer.from_pretrained(model))
    with ServerProcess(model, SERVER) as server:
        plain = _twice(server, batch)
    with ServerProcess(model, [*SERVER, *VERICACHE, *DRAFT]) as server:
        ours = _twice(server, batch)
    return [{"comparison": label, "request": name, "same_tokens": same, "token": token,
             "top": top, "token_ids": ids}
            for label, a, b in [("plain, second send vs first", plain[1], plain[0]),
                                ("VeriCache vs plain, first send", ours[0], plain[0]),
                                ("VeriCache vs plain, second send", ours[1], plain[1])]
            for name, (same, token, top, ids) in _drift(a, b).items()]


def markdown(rows: list[dict]) -> str:
    return tables.table(
        ["comparison", "request", "same tokens", "token", "top", "token ids"],
        [[r["comparison"], r["request"], r["same_tokens"], f"{r['token']:.2e}",
          f"{r['top']:.2e}", f"{r['token_ids']:.2e}"] for r in rows], "lllrrr")


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.logprob_drift", __doc__)
    cli.add_model(parser)
    rows = measure(cli.model_dir(parser.parse_args(argv).model))
    print(markdown(rows))
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
