"""Two-level drafting is lossless: with SGLang's n-gram corpus proposing under the compressed-KV
drafter, the output equals plain SGLang's token for token, for stopped, streamed, penalized,
sampled and grammar-constrained requests. The server is the session's VeriCache server (4-bit
KIVI), whose drafter is the n-gram one, VeriCache's default without a draft model. The
twelve-prompt batch and its drafting statistics run in test_identity.py on the same server; the
n-gram drafter over a token-dropping tier in test_identity_snapkv.py.

Level 1 checks each proposal in one forward over the compressed tier; the statistics show it
did (fewer level-1 forwards than drafts, proposals kept and rejected), and /metrics counts what
meta_info reports.
"""

from __future__ import annotations

import pytest

from tests.support.identity import (
    LOGPROB_PARAMS,
    assert_logprobs_equal,
    json_schema_request,
    levels,
    payload,
    send_all,
    stats,
    stream_chunks,
    vericache_metrics,
)

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]


def test_stops_streaming_and_grammar(vericache_server, plain, prompt_ids, tokenizer):
    """Stop strings inside a round, a streamed request and a JSON schema (its proposals
    checked under the schema's mask at each position) together: plain SGLang's tokens, and
    /metrics counts the levels meta_info reports."""
    batch = [payload(prompt_ids["csv_700"], "code", max_new_tokens=96, stop=["\n\n"]),
             payload(prompt_ids["bisect_300"], "code", max_new_tokens=64, stop=["return"]),
             json_schema_request(tokenizer)]
    before = vericache_metrics(vericache_server)
    got = send_all(vericache_server, batch)
    after = vericache_metrics(vericache_server)
    for request, out in zip(batch, got, strict=True):
        assert out["output_ids"] == plain(request)["output_ids"]
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["vericache:draft_forwards_total"] == sum(levels(out)[0] for out in got)
    assert delta["vericache:drafter_proposed_total"] == sum(levels(out)[1] for out in got)
    assert delta["vericache:drafter_kept_total"] == sum(levels(out)[2] for out in got)
    assert levels(got[2])[1] > 0  # the drafter proposed for the grammar request

    request = payload(prompt_ids["heapq_400"], "code", max_new_tokens=64)
    chunks = stream_chunks(vericache_server, request)
    assert chunks[-1]["output_ids"] == plain(request)["output_ids"]


def test_penalties_bias_and_logprobs_stack(vericache_server, plain, prompt_ids):
    """Penalized, biased and logprob requests draft through proposals too, each proposal row
    under its own position's penalty state: plain SGLang's tokens and logprobs."""
    penalized = payload(prompt_ids["csv_700"], "code", max_new_tokens=48,
                        frequency_penalty=0.4, presence_penalty=0.2)
    biased = {**payload(prompt_ids["heapq_400"], "code", max_new_tokens=48,
                        logit_bias={"13": 4.0, "284": -3.0}), **LOGPROB_PARAMS}
    got = send_all(vericache_server, [penalized, biased])
    assert got[0]["output_ids"] == plain(penalized)["output_ids"]
    want = plain(biased)
    assert got[1]["output_ids"] == want["output_ids"]
    assert_logprobs_equal(got[1], want)
    assert all(levels(out)[2] > 0 for out in got)  # proposals were kept


def test_sampled_requests_stack_beside_greedy_ones(vericache_server, plain, prompt_ids):
    """Sampled requests check proposals too (level 1 samples against each point-mass proposal;
    the exactness of that is test_sampling.py's): in a batch with them, the greedy requests
    still get plain SGLang's tokens, and the sampled ones drafted through proposals."""
    greedy = [payload(prompt_ids[name], "code", max_new_tokens=48)
              for name in ("heapq_400", "csv_700")]
    sampled = [payload(prompt_ids[name], "code", max_new_tokens=48, temperature=0.7, top_p=0.9)
               for name in ("heapq_400", "bisect_300")]
    got = send_all(vericache_server, [*greedy, *sampled])
    for request, out in zip(greedy, got[:2], strict=True):
        assert out["output_ids"] == plain(request)["output_ids"]
    for out in got[2:]:
        rounds, _, accepted = stats(out)
        assert len(out["output_ids"]) == 48 == 1 + accepted + rounds
    assert sum(levels(out)[1] for out in got[2:]) > 0


def test_flush_cache_resets_the_corpus(vericache_server, plain, prompt_ids):
    """The corpus learns every answer, so the same request sent again drafts from its own
    earlier answer and level 1 keeps more proposals. /flush_cache forgets it, as SGLang's NGRAM
    worker resets its corpus: after a flush the request drafts exactly as it did on the flushed
    server the first time. Every answer is plain SGLang's."""
    request = payload(prompt_ids["chat_fnmatch"], "chat", max_new_tokens=48)
    vericache_server.flush_cache()
    first = vericache_server.generate(request)
    again = vericache_server.generate(request)
    vericache_server.flush_cache()
    flushed = vericache_server.generate(request)
    want = plain(request)["output_ids"]
    assert first["output_ids"] == again["output_ids"] == flushed["output_ids"] == want
    assert levels(again)[2] > levels(first)[2]  # its own answer was in the corpus
    assert levels(flushed) == levels(first)
