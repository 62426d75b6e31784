"""VeriCache serving is lossless: its output equals plain SGLang's, token for token.

Real servers, the demo model in float32 on both sides, the same server arguments apart from
the VeriCache flags (prompts over 2,048 tokens are prefilled in chunks on both). Every request
goes to plain SGLang once (memoised). The twelve prompts go to both VeriCache configurations:

* `vericache_server` (tests/conftest.py): 4-bit KIVI, draft length adapting from 16;
* `snapkv_server`: SnapKV keeping 25 % of the tokens (token dropping), draft length fixed at 32.

The feature tests (shared prefixes, streaming, grammars, stops, plain-step requests,
/flush_cache, metrics) use the first.

The prompts are real: code continuation over Python standard library sources and chat
instructions about them, four of them 2,000-6,000 tokens long, 128 new tokens each.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.conftest import SERVER_ARGS, stdlib_source
from vericache_sglang.server_process import ServerProcess

# Server start-up and 12 long generations per configuration run inside the first tests.
pytestmark = [pytest.mark.server, pytest.mark.timeout(2400)]

NEW_TOKENS = 128
CONFIGS = ["vericache_server", "snapkv_server"]


def _code(module: str, start: int, stop: int) -> Callable:
    """Continue a token slice of a module's source."""
    return lambda tok: tok(stdlib_source(module))["input_ids"][start:stop]


def _chat(instruction: str, module: str | None = None, start: int = 0, stop: int = 0) -> Callable:
    """A chat instruction, optionally about a token slice of a module's source."""
    def ids(tok) -> list[int]:
        text = instruction
        if module is not None:
            source = tok.decode(tok(stdlib_source(module))["input_ids"][start:stop])
            text = f"{instruction}\n\n```python\n{source}\n```"
        return tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
    return ids


# name -> token ids of the prompt. Code continues for NEW_TOKENS tokens (ignore_eos); chat
# answers stop at the end-of-turn token like any chat request, or after NEW_TOKENS.
PROMPTS: dict[str, Callable] = {
    "textwrap_2500": _code("textwrap", 0, 2500),
    "argparse_3500": _code("argparse", 6000, 9500),
    "difflib_5800": _code("difflib", 2000, 7800),
    "chat_json_decoder_3200": _chat("Explain what this module does and how to use it.",
                                    "json.decoder", 0, 3200),
    "heapq_400": _code("heapq", 0, 400),
    "bisect_300": _code("bisect", 300, 600),
    "csv_700": _code("csv", 1000, 1700),
    "fibonacci": lambda tok: tok("def fibonacci(n):")["input_ids"],
    "chat_palindrome": _chat("Write a Python function that checks whether a string is a "
                             "palindrome, with a docstring and two doctests."),
    "chat_list_tuple": _chat("Explain the difference between a list and a tuple in Python."),
    "chat_fnmatch": _chat("What does this code do? Answer briefly.", "fnmatch", 0, 600),
    "chat_queue_docstring": _chat("Write better docstrings for the classes in this code.",
                                  "queue", 0, 900),
}
LONG = [name for name in PROMPTS if name.split("_")[-1].isdigit()
        and int(name.split("_")[-1]) >= 2000]


@pytest.fixture(scope="session")
def snapkv_server(demo_model: Path) -> Iterator[ServerProcess]:
    with ServerProcess(demo_model, [
        *SERVER_ARGS, "--enable-vericache", "--vericache-compressor", "snapkv:ratio=0.25",
        "--vericache-draft-length", "32", "--vericache-min-draft-length", "32",
        "--vericache-max-draft-length", "32",
    ]) as server:
        yield server


@pytest.fixture(params=CONFIGS)
def server(request) -> ServerProcess:
    srv = request.getfixturevalue(request.param)
    srv.config_name = request.param
    return srv


@pytest.fixture(scope="session")
def tokenizer(demo_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> dict[str, list[int]]:
    ids = {name: make(tokenizer) for name, make in PROMPTS.items()}
    assert len(LONG) >= 4 and all(2000 <= len(ids[n]) <= 6000 for n in LONG)
    return ids


@pytest.fixture(scope="session")
def plain(plain_server) -> Callable[[dict], dict]:
    """Plain SGLang's response to a /generate payload (each payload asked once)."""
    cache: dict[str, dict] = {}

    def answer(payload: dict) -> dict:
        key = json.dumps(payload, sort_keys=True)
        if key not in cache:
            cache[key] = plain_server.generate(payload)
        return cache[key]

    return answer


def _payload(ids: list[int], name: str = "", **params) -> dict:
    sampling = {"temperature": 0, "max_new_tokens": NEW_TOKENS,
                "ignore_eos": not name.startswith("chat")}
    return {"input_ids": ids, "sampling_params": {**sampling, **params}}


def _all(server: ServerProcess, payloads: list[dict]) -> list[dict]:
    """Send the payloads concurrently (they share decode batches) and collect the answers."""
    with ThreadPoolExecutor(len(payloads)) as pool:
        return list(pool.map(server.generate, payloads))


def _stats(out: dict) -> tuple[int, int, int]:
    """(verification rounds, drafted tokens, accepted drafts) of one response."""
    meta = out["meta_info"]
    rounds = meta["spec_verify_ct"]
    return rounds, round(meta["spec_cap_length"] * rounds), meta["spec_num_correct_drafts"]


def test_twelve_real_prompts_in_one_batch(server, plain, prompt_ids):
    """All prompts in flight together: batched drafting and verification over requests with
    different committed lengths, joining and leaving the batch (chats end at their own EOS)."""
    payloads = [_payload(ids, name) for name, ids in prompt_ids.items()]
    expected = [plain(p) for p in payloads]
    got = _all(server, payloads)
    report = []
    for name, want, out in zip(prompt_ids, expected, got, strict=True):
        assert out["output_ids"] == want["output_ids"], f"{server.config_name}/{name}"
        assert out["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        rounds, drafted, accepted = _stats(out)
        assert 0 <= accepted <= drafted
        report.append(f"{name}: {len(out['output_ids'])} tokens, {rounds} rounds, "
                      f"{accepted}/{drafted} accepted")
    print(f"\n[{server.config_name}]\n  " + "\n  ".join(report))
    rounds, drafted, accepted = (sum(column) for column in zip(*map(_stats, got), strict=True))
    # Drafting happened (far fewer verification rounds than emitted tokens), and some drafts
    # were rejected, so the rejection path was exercised too.
    assert rounds < sum(len(out["output_ids"]) for out in got) / 2
    assert accepted < drafted


@pytest.mark.parametrize("name", ["textwrap_2500", "chat_palindrome"])
def test_one_request_at_a_time(server, plain, prompt_ids, name):
    """Alone in the batch; the statistics add up: each round emits its accepted drafts plus
    one token, and the first token comes from prefill."""
    payload = _payload(prompt_ids[name], name)
    out = server.generate(payload)
    assert out["output_ids"] == plain(payload)["output_ids"]
    rounds, drafted, accepted = _stats(out)
    assert len(out["output_ids"]) == 1 + accepted + rounds
    histogram = out["meta_info"]["spec_correct_drafts_histogram"]
    assert sum(histogram) == rounds


def test_eight_concurrent_requests_sharing_a_long_prefix(vericache_server, plain, tokenizer):
    """Eight chats about the same 3,000-token source, sent together: the radix cache shares
    the prefix, each request drafts over its own compressed tier."""
    source = tokenizer.decode(tokenizer(stdlib_source("calendar"))["input_ids"][:3000])
    questions = ["Summarize this code.", "List the public functions.",
                 "Which classes are defined here?", "Find a bug in this code.",
                 "Explain isleap.", "What does monthrange return?",
                 "Write a test for weekday.", "How are month names localized?"]
    payloads = [_payload(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"```python\n{source}\n```\n\n{q}"}],
        add_generation_prompt=True, tokenize=True, return_dict=False), "chat", max_new_tokens=96)
        for q in questions]
    expected = [plain(p)["output_ids"] for p in payloads]
    got = _all(vericache_server, payloads)
    assert [out["output_ids"] for out in got] == expected
    assert any(out["meta_info"]["cached_tokens"] >= 2900 for out in got)


def test_streaming(vericache_server, plain, prompt_ids):
    """Streamed chunks add up to exactly the plain server's text."""
    ids = prompt_ids["csv_700"]
    payload = _payload(ids, "csv_700")
    response = requests.post(f"{vericache_server.url}/generate",
                             json={**payload, "stream": True}, stream=True, timeout=600)
    response.raise_for_status()
    chunks = [json.loads(line[len(b"data: "):]) for line in response.iter_lines()
              if line.startswith(b"data: {")]
    assert len(chunks) > 1
    assert chunks[-1]["text"] == plain(payload)["text"]
    assert chunks[-1]["output_ids"] == plain(payload)["output_ids"]


@pytest.mark.parametrize("constraint", [
    {"json_schema": json.dumps({
        "type": "object",
        "properties": {"name": {"type": "string"}, "arguments": {
            "type": "array", "items": {"type": "string"}}, "returns": {"type": "string"}},
        "required": ["name", "arguments", "returns"]})},
    {"regex": r"def [a-z_]+\((([a-z_]+)(, [a-z_]+)*)?\):\n    \"\"\"[A-Za-z ,.]+\"\"\"\n"},
], ids=["json_schema", "regex"])
def test_constrained_decoding(vericache_server, plain, tokenizer, constraint):
    """The grammar masks the drafts and the verification alike: same tokens as plain SGLang,
    and drafting still happens."""
    ids = _chat("Describe the function textwrap.dedent as JSON with its name, arguments and "
                "return type.", "textwrap", 0, 800)(tokenizer)
    payload = _payload(ids, "chat", **constraint)
    out = vericache_server.generate(payload)
    assert out["output_ids"] == plain(payload)["output_ids"]
    rounds, drafted, accepted = _stats(out)
    assert drafted > 0 and rounds < len(out["output_ids"])
    if "json_schema" in constraint and out["meta_info"]["finish_reason"]["type"] == "stop":
        assert set(json.loads(out["text"])) >= {"name", "arguments", "returns"}


@pytest.mark.parametrize("params", [
    {"max_new_tokens": 1}, {"max_new_tokens": 2}, {"max_new_tokens": 37},
    {"stop": ["\n\n"]}, {"stop": ["return", "self"]},
    {"stop_token_ids": ["Ċ"]}, {"stop": [")"], "no_stop_trim": True},
], ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_stops_and_lengths_end_where_plain_sglang_ends(vericache_server, plain, prompt_ids,
                                                       tokenizer, params):
    """Stop strings, stop tokens (here: the newline token) and max_new_tokens inside a round:
    no token past the stop."""
    if "stop_token_ids" in params:
        params = {"stop_token_ids": tokenizer.convert_tokens_to_ids(params["stop_token_ids"])}
    payload = _payload(prompt_ids["heapq_400"], "heapq_400",
                       **{"max_new_tokens": 64, "ignore_eos": False, **params})
    out = vericache_server.generate(payload)
    want = plain(payload)
    assert out["output_ids"] == want["output_ids"]
    assert out["text"] == want["text"]
    assert out["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


def test_logprob_requests_take_plain_decode_steps(vericache_server, plain, prompt_ids):
    """Requests that return logprobs are not drafted for: they take SGLang's own decode step
    and get exactly the plain server's tokens and logprobs."""
    payload = {**_payload(prompt_ids["bisect_300"], "code", max_new_tokens=48),
               "return_logprob": True, "top_logprobs_num": 3}
    out = vericache_server.generate(payload)
    want = plain(payload)
    assert out["output_ids"] == want["output_ids"]
    assert out["meta_info"]["spec_num_correct_drafts"] == 0
    got_lp = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    want_lp = [t[0] for t in want["meta_info"]["output_token_logprobs"]]
    assert got_lp == pytest.approx(want_lp, abs=1e-4)
    assert [[e[1] for e in top] for top in out["meta_info"]["output_top_logprobs"]] == \
        [[e[1] for e in top] for top in want["meta_info"]["output_top_logprobs"]]


def test_penalized_requests_take_plain_decode_steps(vericache_server, demo_model, prompt_ids):
    """Penalized requests are not drafted for either. The reference here is plain SGLang with
    --disable-overlap-schedule, which VeriCache implies: SGLang's overlap scheduler prepares
    step n+1 before it records step n's token, so its penalties count the output one token
    late, and greedy output under penalties differs with and without it."""
    payload = _payload(prompt_ids["bisect_300"], "code", max_new_tokens=48,
                       repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    with ServerProcess(demo_model, [*SERVER_ARGS, "--disable-overlap-schedule"]) as plain_server:
        want = plain_server.generate(payload)
    out = vericache_server.generate(payload)
    assert out["output_ids"] == want["output_ids"]
    assert out["meta_info"]["spec_num_correct_drafts"] == 0


def test_flush_cache_between_requests(vericache_server, plain, prompt_ids):
    """/flush_cache drops the radix cache (and with it every compressed block); the same
    request afterwards is answered identically."""
    payload = _payload(prompt_ids["textwrap_2500"][:1200], "code", max_new_tokens=48)
    first = vericache_server.generate(payload)
    assert requests.post(f"{vericache_server.url}/flush_cache", timeout=60).ok
    second = vericache_server.generate(payload)
    assert first["output_ids"] == second["output_ids"] == plain(payload)["output_ids"]
    assert second["meta_info"]["cached_tokens"] == 0


def _vericache_metrics(server: ServerProcess) -> dict[str, float]:
    text = requests.get(f"{server.url}/metrics", timeout=60).text
    values = {}
    for line in text.splitlines():
        if line.startswith("vericache:"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def test_metrics_count_what_meta_info_reports(vericache_server, prompt_ids):
    """/metrics (--enable-metrics) counts exactly the rounds and drafts meta_info reports."""
    before = _vericache_metrics(vericache_server)
    payload = _payload(prompt_ids["bisect_300"], "code", max_new_tokens=40)
    out = vericache_server.generate(payload)
    after = _vericache_metrics(vericache_server)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    rounds, drafted, accepted = _stats(out)
    assert delta["vericache:verify_rounds_total"] == rounds
    assert delta["vericache:drafted_tokens_total"] == drafted
    assert delta["vericache:accepted_drafts_total"] == accepted
    assert delta["vericache:emitted_tokens_total"] == len(out["output_ids"]) - 1
    assert after["vericache:compressed_tier_bytes"] > 0
