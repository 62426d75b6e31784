"""VeriCache serving is lossless: its output equals plain SGLang's, token for token.

Real servers, the demo model in float32 on both sides, the same server arguments apart from
the VeriCache flags (prompts over 2,048 tokens are prefilled in chunks on both). Every request
goes to plain SGLang once (the `plain` fixture remembers the answers). Here the VeriCache
server is `vericache_server` (tests/conftest.py): 4-bit KIVI, 16 drafts a round;
test_identity_snapkv.py runs the twelve prompts on a token-dropping tier with a
short fixed draft length.
"""

from __future__ import annotations

import json

import pytest
import requests
from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

from tests.support.identity import (
    CONSTRAINED_PROMPT,
    CONSTRAINTS,
    LOGPROB_PARAMS,
    LONGEST,
    assert_batch_identical,
    assert_logprobs_equal,
    chat,
    levels,
    payload,
    send_all,
    stats,
    stream_chunks,
    vericache_metrics,
)
from tests.support.servers import SERVER_ARGS, ServerSpec
from vericache_sglang.speculative.meta_info import READ_BYTES_KEY
from vericache_tools.prompts import stdlib_source
from vericache_tools.server_process import ServerProcess

# Server start-up and the twelve long generations run inside the first test.
pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]


def test_twelve_real_prompts_in_one_batch(vericache_server, plain, prompt_ids):
    """Same tokens as plain SGLang. The n-gram drafter's proposals were checked (some kept,
    some not), and level 1 ran fewer forwards than it drafted tokens (test_drafter.py)."""
    got = assert_batch_identical(vericache_server, plain, prompt_ids, "kivi:bits=4, k=16")
    forwards, proposed, kept = (sum(column) for column in zip(*map(levels, got), strict=True))
    drafted = sum(stats(out)[1] for out in got)
    print(f"  level 1: {forwards} forwards for {drafted} drafts; "
          f"level 2: {kept}/{proposed} proposals kept")
    assert 0 < kept < proposed
    assert forwards < drafted


def test_a_chat_over_four_thousand_tokens(vericache_server, plain, tokenizer):
    """A chat about 4,200 tokens of tarfile.py: plain SGLang's tokens (prefill in three
    chunks, a compressed tier of thousands of tokens, the full KV streamed from host memory).
    Code continuation over 4,300 tokens (three chunks) is test_full_tier.py's."""
    ids = {name: make(tokenizer) for name, make in LONGEST.items()}
    assert all(4000 <= len(prompt) <= 6000 for prompt in ids.values())
    assert_batch_identical(vericache_server, plain, ids, "kivi:bits=4, 4k prompt")


def test_requests_over_a_cached_prefix_compress_it_once(vericache_server, plain, tokenizer):
    """A first request leaves a 2,000-token prefix in the radix cache with its compressed
    pages; four concurrent requests over it then compress nothing of it and hold its pages
    once (pages are keyed by the KV slots the tree hands out). Outputs equal plain SGLang's,
    and the bytes gauge is the pages in use times a page's share of the pool /server_info
    measured."""
    ids = tokenizer(stdlib_source("calendar"))["input_ids"]
    prefix, tails = ids[2000:4000], [ids[4000 + 32 * i : 4032 + 32 * i] for i in range(5)]
    # The first request runs longer, so that it compresses every group the others reach:
    # its last round starts at 2,049 tokens or more (a first round emits at most 17), theirs at
    # 2,048 at most, i.e. 60 whole groups older than the 128-token recent window, all inside
    # the shared prefix.
    requests_ = [payload(prefix + tail, "code", max_new_tokens=64 if i == 0 else 16)
                 for i, tail in enumerate(tails)]
    expected = [out["output_ids"] for out in plain.all(requests_)]
    vericache_server.flush_cache()
    before = vericache_metrics(vericache_server)
    first = vericache_server.generate(requests_[0])
    after_first = vericache_metrics(vericache_server)
    got = send_all(vericache_server, requests_[1:])
    after = vericache_metrics(vericache_server)

    assert [out["output_ids"] for out in [first, *got]] == expected
    assert all(out["meta_info"]["cached_tokens"] >= 1999 for out in got)
    pages = after_first["vericache:compressed_pages_total"] - before.get(
        "vericache:compressed_pages_total", 0.0)
    assert 60 <= pages <= 61
    assert after["vericache:compressed_pages_total"] == after_first[
        "vericache:compressed_pages_total"]
    assert after["vericache:compressed_pool_pages"] == pages  # held once, not five times
    memory = vericache_server.server_info()["vericache"]["memory"]
    assert after["vericache:compressed_tier_bytes"] == (
        memory["compressed_pool_bytes"] * pages // memory["compressed_pool_pages"])


def test_streaming(vericache_server, plain, prompt_ids):
    """Streamed chunks add up to exactly the plain server's text."""
    request = payload(prompt_ids["csv_700"], "code", max_new_tokens=64)
    chunks = stream_chunks(vericache_server, request)
    assert len(chunks) > 1
    assert chunks[-1]["text"] == plain(request)["text"]
    assert chunks[-1]["output_ids"] == plain(request)["output_ids"]
    # The per-request read figure is for finished, non-streamed responses only.
    assert READ_BYTES_KEY not in chunks[-1]["meta_info"]


def _most_running_while_streaming(server: ServerProcess, request: dict) -> float:
    """The highest sglang:num_running_reqs /metrics shows while a streamed request runs."""
    seen = 0.0
    with requests.post(f"{server.url}/generate", json={**request, "stream": True},
                       stream=True, timeout=600) as response:
        for _ in response.iter_lines():
            text = requests.get(f"{server.url}/metrics", timeout=60).text
            seen = max([seen, *(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                if line.startswith("sglang:num_running_reqs{"))])
    return seen


def test_sglang_gauges_see_the_running_request(vericache_server, plain_server, prompt_ids):
    """SGLang's gauges read as they do for plain SGLang: a load balancer polling
    sglang:num_running_reqs while a request decodes sees it on both servers. (SGLang sets them
    every --decode-log-interval decode forwards, counted from the last flush: 40 forwards are
    40 tokens of plain SGLang but a whole VeriCache request.)"""
    request = payload(prompt_ids["csv_700"], "code", max_new_tokens=96)
    for server in (plain_server, vericache_server):
        server.flush_cache()
        assert _most_running_while_streaming(server, request) == 1, server.argv


@pytest.mark.parametrize("constraint", CONSTRAINTS.values(), ids=CONSTRAINTS.keys())
def test_constrained_decoding(vericache_server, plain, tokenizer, constraint):
    """The grammar masks the drafts and the verification alike: same tokens as plain SGLang,
    and drafting still happens."""
    request = payload(CONSTRAINED_PROMPT(tokenizer), "chat", max_new_tokens=64, **constraint)
    out = vericache_server.generate(request)
    assert out["output_ids"] == plain(request)["output_ids"]
    rounds, drafted, accepted = stats(out)
    assert drafted > 0 and rounds < len(out["output_ids"])
    if "json_schema" in constraint and out["meta_info"]["finish_reason"]["type"] == "stop":
        assert set(json.loads(out["text"])) >= {"name", "arguments", "returns"}


STOPS = {
    "max_new_tokens=1": {"max_new_tokens": 1},
    "max_new_tokens=2": {"max_new_tokens": 2},
    "max_new_tokens=37": {"max_new_tokens": 37},
    "stop=blank line": {"stop": ["\n\n"]},
    "stop=return|self": {"stop": ["return", "self"]},
    "stop_token_ids=newline": {"stop_token_ids": ["Ċ"]},
    "stop=) no_stop_trim": {"stop": [")"], "no_stop_trim": True},
}


def test_stops_and_lengths_end_where_plain_sglang_ends(vericache_server, plain, prompt_ids,
                                                       tokenizer):
    """Stop strings, stop tokens (here: the newline token) and max_new_tokens inside a round,
    all in one batch: no token past the stop, the same text and finish reason."""
    requests_ = []
    for params in STOPS.values():
        if "stop_token_ids" in params:
            params = {"stop_token_ids": tokenizer.convert_tokens_to_ids(params["stop_token_ids"])}
        requests_.append(payload(prompt_ids["heapq_400"], "code",
                                 **{"max_new_tokens": 64, "ignore_eos": False, **params}))
    expected = plain.all(requests_)
    got = send_all(vericache_server, requests_)
    for case, want, out in zip(STOPS, expected, got, strict=True):
        assert out["output_ids"] == want["output_ids"], case
        assert out["text"] == want["text"], case
        assert out["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], case


def test_logprob_requests_draft(vericache_server, plain, prompt_ids):
    """Returned logprobs come from the verification forward: the request drafts, and its
    tokens, logprobs, top logprobs and token-id logprobs are plain SGLang's."""
    request = {**payload(prompt_ids["bisect_300"], "code", max_new_tokens=48), **LOGPROB_PARAMS}
    out = vericache_server.generate(request)
    want = plain(request)
    assert out["output_ids"] == want["output_ids"]
    assert out["meta_info"]["spec_num_correct_drafts"] > 0
    assert_logprobs_equal(out, want)


def test_penalties_bias_and_requests_that_cannot_draft_share_a_batch(vericache_server, plain,
                                                                     demo_model, prompt_ids,
                                                                     server_pool):
    """One batch of requests that draft (greedy; logprobs; frequency and presence penalties,
    and a repetition penalty, with logprobs; logit bias; min_new_tokens) and one that cannot
    (a custom logit processor, with logprobs): every output and every logprob equals plain
    SGLang's, all but the last draft, and the counters add up to the tokens really drafted,
    accepted and emitted, the plain steps being the custom-processor request's.

    The reference is the session's plain SGLang, with --disable-overlap-schedule as VeriCache
    implies (conftest.PLAIN_ARGS). Plain SGLang's default, the overlap scheduler, answers the
    requests without penalizers too, and must give the same tokens and logprobs. The
    repetition penalty has a request of its own: SGLang applies a batch's penalizers in an
    order that differs from process to process (penalties.py), which moves a
    repetition-and-frequency request's logprobs by up to ~1e-3 between two plain servers."""
    requests_ = {
        "greedy": payload(prompt_ids["heapq_400"], "code", max_new_tokens=48),
        "logprobs": {**payload(prompt_ids["csv_700"], "code", max_new_tokens=48),
                     **LOGPROB_PARAMS},
        "penalties": {**payload(prompt_ids["bisect_300"], "code", max_new_tokens=48,
                                frequency_penalty=0.4, presence_penalty=0.2), **LOGPROB_PARAMS},
        "repetition": {**payload(prompt_ids["heapq_400"], "code", max_new_tokens=48,
                                 repetition_penalty=1.3), **LOGPROB_PARAMS},
        "logit_bias": payload(prompt_ids["bisect_300"], "code", max_new_tokens=48,
                              logit_bias={"13": 4.0, "284": -3.0}),
        "min_new_tokens": payload(prompt_ids["chat_list_tuple"], "chat", max_new_tokens=48,
                                  min_new_tokens=12),
        "custom_processor": {
            **payload(prompt_ids["bisect_300"], "code", max_new_tokens=32,
                      custom_params={"token_ids": [13, 284]}),
            "custom_logit_processor": DisallowedTokensLogitsProcessor.to_str(),
            **LOGPROB_PARAMS},
    }
    expected = dict(zip(requests_, plain.all(list(requests_.values())), strict=True))
    unpenalized = ("greedy", "logprobs", "logit_bias", "custom_processor")
    with server_pool.hold(ServerSpec.of(demo_model, SERVER_ARGS)) as (server,):
        overlapped = dict(zip(unpenalized, send_all(server, [requests_[name] for name in
                                                           unpenalized]), strict=True))
    before = vericache_metrics(vericache_server)
    got = dict(zip(requests_, send_all(vericache_server, list(requests_.values())), strict=True))
    after = vericache_metrics(vericache_server)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    for name, out in got.items():
        assert out["output_ids"] == expected[name]["output_ids"], name
    for name, out in overlapped.items():
        assert got[name]["output_ids"] == out["output_ids"], name
    for name in ("logprobs", "custom_processor"):
        assert_logprobs_equal(got[name], overlapped[name])
    for name in ("logprobs", "penalties", "repetition", "custom_processor"):
        assert_logprobs_equal(got[name], expected[name])
    for name in ("greedy", "logprobs", "penalties", "repetition", "logit_bias",
                 "min_new_tokens"):
        assert got[name]["meta_info"]["spec_num_correct_drafts"] > 0, name
    assert got["custom_processor"]["meta_info"]["spec_num_proposed_drafts"] == 0
    counts = [stats(out) for out in got.values()]
    assert delta["vericache:drafted_tokens_total"] == sum(c[1] for c in counts)
    assert delta["vericache:accepted_drafts_total"] == sum(c[2] for c in counts)
    plain_steps = delta["vericache:plain_decode_steps_total"]
    assert plain_steps == len(got["custom_processor"]["output_ids"]) - 1
    assert delta["vericache:emitted_tokens_total"] + plain_steps == sum(
        len(out["output_ids"]) - 1 for out in got.values())


def test_flush_cache_between_requests(vericache_server, plain, prompt_ids):
    """/flush_cache drops the radix cache (and with it every compressed block, which the size
    gauges show at once); the same request afterwards is answered identically."""
    request = payload(prompt_ids["textwrap_2000"][:600], "code", max_new_tokens=32)
    first = vericache_server.generate(request)
    assert vericache_metrics(vericache_server)["vericache:compressed_pool_pages"] > 0
    vericache_server.flush_cache()
    idle = vericache_metrics(vericache_server)
    assert idle["vericache:compressed_pool_pages"] == 0
    assert idle["vericache:compressed_tier_bytes"] == 0
    second = vericache_server.generate(request)
    assert first["output_ids"] == second["output_ids"] == plain(request)["output_ids"]
    assert second["meta_info"]["cached_tokens"] == 0


def test_metrics_count_what_meta_info_reports(vericache_server, prompt_ids):
    """/metrics (--enable-metrics) counts exactly the rounds and drafts meta_info reports."""
    before = vericache_metrics(vericache_server)
    out = vericache_server.generate(payload(prompt_ids["bisect_300"], "code", max_new_tokens=40))
    after = vericache_metrics(vericache_server)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    rounds, drafted, accepted = stats(out)
    assert delta["vericache:verify_rounds_total"] == rounds
    assert delta["vericache:drafted_tokens_total"] == drafted
    assert delta["vericache:accepted_drafts_total"] == accepted
    assert delta["vericache:emitted_tokens_total"] == len(out["output_ids"]) - 1
    assert after["vericache:compressed_tier_bytes"] > 0


def test_sglang_accept_rate_counts_the_drafts_proposed(vericache_server, prompt_ids):
    """SGLang's own figures count the drafts a round really proposed, not the longest draft
    (--speculative-num-draft-tokens - 1, which VeriCache sets to its bound): meta_info's
    spec_num_proposed_drafts equals VeriCache's drafted-tokens counter, its accept rate is
    accepted over that, and so is sglang:spec_accept_rate for a one-round request (the gauge
    holds the last step's rate)."""
    def accept_rate_gauge() -> float:
        text = requests.get(f"{vericache_server.url}/metrics", timeout=60).text
        return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("sglang:spec_accept_rate"))

    for max_new_tokens in (40, 5):
        before = vericache_metrics(vericache_server)
        out = vericache_server.generate(payload(prompt_ids["bisect_300"], "code",
                                                max_new_tokens=max_new_tokens))
        drafted = (vericache_metrics(vericache_server)["vericache:drafted_tokens_total"]
                   - before["vericache:drafted_tokens_total"])
        meta = out["meta_info"]
        assert meta["spec_num_proposed_drafts"] == drafted > 0
        assert meta["spec_accept_rate"] == pytest.approx(meta["spec_num_correct_drafts"] / drafted)
    assert meta["spec_verify_ct"] == 1, "the 5-token request should take one round"
    assert accept_rate_gauge() == pytest.approx(meta["spec_accept_rate"])


@pytest.mark.parametrize("ending", [
    {"stop": ["progress"]},
    CONSTRAINTS["regex"],
], ids=["stop_string", "grammar"])
def test_counters_stop_where_the_output_stops(vericache_server, plain, prompt_ids, tokenizer,
                                              ending):
    """A stop string or a grammar that ends a request inside a verified run: meta_info and
    /metrics count only the tokens the client gets (a round's drafts past the end were once
    counted as accepted and emitted). Every round but the last emits its accepted drafts plus
    one token of the full model; the last may end among its drafts."""
    ids = (prompt_ids["heapq_400"] if "stop" in ending else
           chat("Write a Python function that merges two sorted lists, with a docstring.",
                "heapq", 0, 400)(tokenizer))
    request = payload(ids, "code" if "stop" in ending else "chat", max_new_tokens=96, **ending)
    before = vericache_metrics(vericache_server)
    out = vericache_server.generate(request)
    after = vericache_metrics(vericache_server)
    assert out["output_ids"] == plain(request)["output_ids"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    rounds, _, accepted = stats(out)
    generated = out["meta_info"]["completion_tokens"] - 1  # the first token comes from prefill
    assert delta["vericache:emitted_tokens_total"] == generated
    assert delta["vericache:accepted_drafts_total"] == accepted
    assert generated - rounds <= accepted <= generated - rounds + 1
