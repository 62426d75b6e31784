"""Two-level drafting is lossless: with SGLang's n-gram corpus proposing under the compressed-KV
drafter, the output equals plain SGLang's token for token, on a 4-bit tier and on a
token-dropping tier, for batched, stopped, streamed and grammar-constrained requests.

Level 1 checks each proposal in one forward over the compressed tier; the statistics show it
did (fewer level-1 forwards than drafts, proposals kept and rejected), and /metrics counts what
meta_info reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SERVER_ARGS
from tests.speculative.identity import (
    LOGPROB_PARAMS,
    assert_batch_identical,
    assert_logprobs_equal,
    json_schema_request,
    levels,
    payload,
    send_all,
    stats,
    stream_chunks,
    vericache_metrics,
)
from vericache_sglang.server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def ngram_server(demo_model: Path) -> Iterator[ServerProcess]:
    with ServerProcess(demo_model, [*SERVER_ARGS, "--enable-vericache",
                                    "--vericache-drafter", "ngram"]) as server:
        yield server


def test_token_dropping_tier(demo_model, plain, prompt_ids):
    """SnapKV keeping half the tokens under the n-gram drafter, three requests at once, a fixed
    draft length of 8 with proposals of up to 4 tokens: plain SGLang's tokens. (First in the
    module, so that its server is not up beside the module's shared one.)"""
    names = ["heapq_400", "csv_700", "chat_palindrome"]
    with ServerProcess(demo_model, [
        *SERVER_ARGS, "--enable-vericache", "--vericache-compressor", "snapkv:ratio=0.5",
        "--vericache-draft-length", "8", "--vericache-min-draft-length", "8",
        "--vericache-max-draft-length", "8", "--vericache-drafter", "ngram",
        "--vericache-drafter-max-length", "4",
    ]) as server:
        got = assert_batch_identical(server, plain, {name: prompt_ids[name] for name in names},
                                     "snapkv:ratio=0.5, k=8 + ngram")
    assert sum(levels(out)[2] for out in got) > 0


def test_real_prompts_in_one_batch(ngram_server, plain, prompt_ids):
    """Eight prompts of test_identity.py in flight together (the long ones run there; CI
    time): same tokens as plain SGLang; the drafter's proposals were checked (some kept, some
    not) and level 1 ran fewer forwards than it drafted tokens."""
    names = ["textwrap_2000", "heapq_400", "bisect_300", "csv_700", "fibonacci",
             "chat_palindrome", "chat_list_tuple", "chat_fnmatch"]
    got = assert_batch_identical(ngram_server, plain, {name: prompt_ids[name] for name in names},
                                 "kivi:bits=4 + ngram")
    forwards, proposed, kept = (sum(column) for column in zip(*map(levels, got), strict=True))
    drafted = sum(stats(out)[1] for out in got)
    print(f"\n  level 1: {forwards} forwards for {drafted} drafts; "
          f"level 2: {kept}/{proposed} proposals kept")
    assert 0 < kept < proposed
    assert forwards < drafted


def test_stops_streaming_and_grammar(ngram_server, plain, prompt_ids, tokenizer):
    """Stop strings inside a round, a streamed request and a JSON schema (its proposals
    checked under the schema's mask at each position) together: plain SGLang's tokens, and
    /metrics counts the levels meta_info reports."""
    batch = [payload(prompt_ids["csv_700"], "code", max_new_tokens=96, stop=["\n\n"]),
             payload(prompt_ids["bisect_300"], "code", max_new_tokens=64, stop=["return"]),
             json_schema_request(tokenizer)]
    before = vericache_metrics(ngram_server)
    got = send_all(ngram_server, batch)
    after = vericache_metrics(ngram_server)
    for request, out in zip(batch, got, strict=True):
        assert out["output_ids"] == plain(request)["output_ids"]
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["vericache:draft_forwards_total"] == sum(levels(out)[0] for out in got)
    assert delta["vericache:drafter_proposed_total"] == sum(levels(out)[1] for out in got)
    assert delta["vericache:drafter_kept_total"] == sum(levels(out)[2] for out in got)
    assert levels(got[2])[1] > 0  # the drafter proposed for the grammar request

    request = payload(prompt_ids["heapq_400"], "code", max_new_tokens=64)
    chunks = stream_chunks(ngram_server, request)
    assert chunks[-1]["output_ids"] == plain(request)["output_ids"]


def test_penalties_bias_and_logprobs_stack(ngram_server, plain, prompt_ids):
    """Penalized, biased and logprob requests draft through proposals too, each proposal row
    under its own position's penalty state: plain SGLang's tokens and logprobs."""
    penalized = payload(prompt_ids["csv_700"], "code", max_new_tokens=48,
                        frequency_penalty=0.4, presence_penalty=0.2)
    biased = {**payload(prompt_ids["heapq_400"], "code", max_new_tokens=48,
                        logit_bias={"13": 4.0, "284": -3.0}), **LOGPROB_PARAMS}
    got = send_all(ngram_server, [penalized, biased])
    assert got[0]["output_ids"] == plain(penalized)["output_ids"]
    want = plain(biased)
    assert got[1]["output_ids"] == want["output_ids"]
    assert_logprobs_equal(got[1], want)
    assert all(levels(out)[2] > 0 for out in got)  # proposals were kept


def test_sampled_requests_stack_beside_greedy_ones(ngram_server, plain, prompt_ids):
    """Sampled requests check proposals too (level 1 samples against each point-mass proposal;
    the exactness of that is test_sampling.py's): in a batch with them, the greedy requests
    still get plain SGLang's tokens, and the sampled ones drafted through proposals."""
    greedy = [payload(prompt_ids[name], "code", max_new_tokens=48)
              for name in ("heapq_400", "csv_700")]
    sampled = [payload(prompt_ids[name], "code", max_new_tokens=48, temperature=0.7, top_p=0.9)
               for name in ("heapq_400", "bisect_300")]
    got = send_all(ngram_server, [*greedy, *sampled])
    for request, out in zip(greedy, got[:2], strict=True):
        assert out["output_ids"] == plain(request)["output_ids"]
    for out in got[2:]:
        rounds, _, accepted = stats(out)
        assert len(out["output_ids"]) == 48 == 1 + accepted + rounds
    assert sum(levels(out)[1] for out in got[2:]) > 0


def test_flush_cache_resets_the_corpus(ngram_server, plain, prompt_ids):
    """The corpus learns every answer, so the same request sent again drafts from its own
    earlier answer and level 1 keeps more proposals. /flush_cache forgets it, as SGLang's NGRAM
    worker resets its corpus: after a flush the request drafts exactly as it did on the flushed
    server the first time. Every answer is plain SGLang's."""
    request = payload(prompt_ids["chat_fnmatch"], "chat", max_new_tokens=48)
    ngram_server.flush_cache()
    first = ngram_server.generate(request)
    again = ngram_server.generate(request)
    ngram_server.flush_cache()
    flushed = ngram_server.generate(request)
    want = plain(request)["output_ids"]
    assert first["output_ids"] == again["output_ids"] == flushed["output_ids"] == want
    assert levels(again)[2] > levels(first)[2]  # its own answer was in the corpus
    assert levels(flushed) == levels(first)
