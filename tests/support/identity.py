"""The real prompts and request helpers the identity tests share
(tests/speculative/test_identity*.py).

The prompts are real: code continuation over Python standard library sources and chat
instructions about them, four of them 2,000-2,600 tokens long (chunked prefill and a long
compressed tier), and one of 4,200 tokens sent on its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from vericache_sglang.speculative.meta_info import (
    DRAFT_FORWARDS_KEY,
    DRAFTER_KEPT_KEY,
    DRAFTER_PROPOSED_KEY,
)
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_process import ServerProcess
from vericache_tools.streaming import stream

NEW_TOKENS = 48


def _code(module: str, start: int, stop: int) -> Callable:
    """Continue a token slice of a module's source."""
    return lambda tok: stdlib_ids(tok, module, stop - start, start=start)


def chat(instruction: str, module: str | None = None, start: int = 0, stop: int = 0) -> Callable:
    """A chat instruction, optionally about a token slice of a module's source."""
    def ids(tok) -> list[int]:
        text = instruction
        if module is not None:
            source = tok.decode(stdlib_ids(tok, module, stop - start, start=start))
            text = f"{instruction}\n\n```python\n{source}\n```"
        return tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
    return ids


# name -> token ids of the prompt. Code continues for NEW_TOKENS tokens (ignore_eos); chat
# answers stop at the end-of-turn token like any chat request, or after NEW_TOKENS.
PROMPTS: dict[str, Callable] = {
    "textwrap_2000": _code("textwrap", 0, 2000),
    "argparse_2300": _code("argparse", 6000, 8300),
    "difflib_2600": _code("difflib", 2000, 4600),
    "chat_json_decoder_2100": chat("Explain what this module does and how to use it.",
                                   "json.decoder", 0, 2100),
    "heapq_400": _code("heapq", 0, 400),
    "bisect_300": _code("bisect", 300, 600),
    "csv_700": _code("csv", 1000, 1700),
    "fibonacci": lambda tok: tok("def fibonacci(n):")["input_ids"],
    "chat_palindrome": chat("Write a Python function that checks whether a string is a "
                            "palindrome, with a docstring and two doctests."),
    "chat_list_tuple": chat("Explain the difference between a list and a tuple in Python."),
    "chat_fnmatch": chat("What does this code do? Answer briefly.", "fnmatch", 0, 600),
    "chat_queue_docstring": chat("Write better docstrings for the classes in this code.",
                                 "queue", 0, 900),
}
# Constrained decoding: a chat request about real code under each kind of grammar.
CONSTRAINED_PROMPT = chat("Describe the function textwrap.dedent as JSON with its name, "
                          "arguments and return type.", "textwrap", 0, 800)
CONSTRAINTS = {
    "json_schema": {"json_schema": json.dumps({
        "type": "object",
        "properties": {"name": {"type": "string"}, "arguments": {
            "type": "array", "items": {"type": "string"}}, "returns": {"type": "string"}},
        "required": ["name", "arguments", "returns"]})},
    "regex": {"regex": r"def [a-z_]+\((([a-z_]+)(, [a-z_]+)*)?\):\n    \"\"\"[A-Za-z ,.]+\"\"\"\n"},
}
# 4,000-6,000 tokens, sent on their own (CI time): a chat here, code continuation over 4,300
# tokens (three prefill chunks) in test_full_tier.py.
LONGEST: dict[str, Callable] = {
    "chat_tarfile_4200": chat("Summarize what this code does, class by class.",
                              "tarfile", 0, 4200),
}
LONG = [name for name in PROMPTS if name.split("_")[-1].isdigit()
        and int(name.split("_")[-1]) >= 2000]


def payload(ids: list[int], name: str = "", **params) -> dict:
    """A greedy /generate request; code continues past EOS, chats stop at it."""
    sampling = {"temperature": 0, "max_new_tokens": NEW_TOKENS,
                "ignore_eos": not name.startswith("chat")}
    return {"input_ids": ids, "sampling_params": {**sampling, **params}}


def json_schema_request(tokenizer) -> dict:
    """A chat about heapq.heappush answered under a JSON schema: the grammar-constrained
    request the drafter tests send beside their stopped and streamed ones."""
    schema = json.dumps({"type": "object", "properties": {
        "name": {"type": "string"}, "returns": {"type": "string"}},
        "required": ["name", "returns"]})
    ids = chat("Describe the function heapq.heappush as JSON with its name and return type.",
               "heapq", 0, 400)(tokenizer)
    return payload(ids, "chat", max_new_tokens=64, json_schema=schema)


def send_all(server: ServerProcess, payloads: list[dict]) -> list[dict]:
    """Send the payloads concurrently (they share decode batches) and collect the answers."""
    with ThreadPoolExecutor(len(payloads)) as pool:
        return list(pool.map(server.generate, payloads))


def stats(out: dict) -> tuple[int, int, int]:
    """(verification rounds, drafted tokens, accepted drafts) of one response (SGLang leaves
    out the mean draft length of a request that never drafted)."""
    meta = out["meta_info"]
    rounds = meta["spec_verify_ct"]
    return (rounds, round(meta.get("spec_cap_length", 0) * rounds),
            meta["spec_num_correct_drafts"])


LOGPROB_PARAMS = {"return_logprob": True, "top_logprobs_num": 3,
                  "token_ids_logprob": [13, 198, 284, 1134]}
LOGPROB_TOLERANCE = {"rel": 1e-5, "abs": 1e-4}
"""How far a logprob may be from plain SGLang's: float32 summation order. VeriCache computes
them in a verification forward of k + 1 tokens, plain SGLang in one-token decode steps. Over
test_identity.py's mixed batch, measured by `python -m bench.logprob_drift` in two runs: plain
SGLang moves a logprob by up to 2.3e-5 when the same batch comes again over its cached
prefixes, and VeriCache's differ from plain's by up to 3.4e-5. 1e-4 in a logprob is a 0.01%
change of a probability; a draft token emitted where the full model would not have emitted it
moves logprobs by far more."""


def assert_logprobs_equal(out: dict, want: dict) -> None:
    """The emitted tokens' logprobs, top logprobs and requested token ids' logprobs equal
    plain SGLang's within `LOGPROB_TOLERANCE`. The top tokens are the same."""
    got_meta, want_meta = out["meta_info"], want["meta_info"]
    assert [t[1] for t in got_meta["output_token_logprobs"]] == out["output_ids"]
    assert [t[0] for t in got_meta["output_token_logprobs"]] == pytest.approx(
        [t[0] for t in want_meta["output_token_logprobs"]], **LOGPROB_TOLERANCE)
    for key in ("output_top_logprobs", "output_token_ids_logprobs"):
        got, expected = got_meta[key], want_meta[key]
        assert len(got) == len(expected) == len(out["output_ids"]), key
        for got_step, want_step in zip(got, expected, strict=True):
            assert [e[1] for e in got_step] == [e[1] for e in want_step], key
            assert [e[0] for e in got_step] == pytest.approx([e[0] for e in want_step],
                                                             **LOGPROB_TOLERANCE), key


def assert_batch_identical(server: ServerProcess, plain, prompt_ids: dict[str, list[int]],
                           label: str, **params) -> list[dict]:
    """The prompts in flight together on `server` and on plain SGLang: batched drafting
    and verification over requests with different committed lengths, joining and leaving the
    batch (chats end at their own EOS). Same tokens, same finish reasons; drafting happened
    and some drafts were rejected, so the rejection path ran too. `params` override the
    sampling parameters of `payload`. Returns the responses."""
    payloads = [payload(ids, name, **params) for name, ids in prompt_ids.items()]
    expected = plain.all(payloads)
    got = send_all(server, payloads)
    report = []
    for name, want, out in zip(prompt_ids, expected, got, strict=True):
        assert out["output_ids"] == want["output_ids"], f"{label}/{name}"
        assert out["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        rounds, drafted, accepted = stats(out)
        # Each round emits its accepted drafts plus one token; the first token is prefill's.
        assert len(out["output_ids"]) <= 1 + accepted + rounds and accepted <= drafted
        report.append(f"{name}: {len(out['output_ids'])} tokens, {rounds} rounds, "
                      f"{accepted}/{drafted} accepted")
    print(f"\n[{label}]\n  " + "\n  ".join(report))
    rounds, drafted, accepted = (sum(column) for column in zip(*map(stats, got), strict=True))
    assert rounds < sum(len(out["output_ids"]) for out in got) / 2
    assert accepted < drafted
    return got


def levels(out: dict) -> tuple[int, int, int]:
    """(level-1 forwards, level-2 proposed, level-2 kept) of one response."""
    meta = out["meta_info"]
    return tuple(meta[key][0] for key in (DRAFT_FORWARDS_KEY, DRAFTER_PROPOSED_KEY,
                                          DRAFTER_KEPT_KEY))


def vericache_metrics(server: ServerProcess) -> dict[str, float]:
    """The server's `vericache:*` Prometheus samples, by name."""
    text = requests.get(f"{server.url}/metrics", timeout=60).text
    return {line.rsplit(" ", 1)[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("vericache:")}


def stream_chunks(server: ServerProcess, request: dict) -> list[dict]:
    """The chunks of `request` sent to /generate with streaming on."""
    return list(stream(server.url, request, timeout=600))
