"""A draft model as level 2 is lossless: a small causal LM with its own KV proposes, the target
over the compressed tier checks, the full KV verifies; the output equals plain SGLang's token
for token, with the distilled drafter the package ships (on a token-dropping tier, for
batched, stopped, streamed and JSON-schema requests) and when the draft model proposes garbage
(the target's first 4 layers under its head, which agree with the target's next token on about
1% of positions).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.support.identity import (
    assert_batch_identical,
    json_schema_request,
    levels,
    payload,
    send_all,
    stream_chunks,
)
from tests.support.servers import FIXED_DRAFT_LENGTH, SERVER_ARGS, ServerSpec

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]


def _weight_bytes(model_dir: Path) -> tuple[int, int]:
    """(float32 bytes of the embedding, float32 bytes of every other weight) of a model
    directory, from its safetensors file."""
    embedding = other = 0
    with safe_open(model_dir / "model.safetensors", "pt") as weights:
        for name in weights.keys():  # noqa: SIM118 (safe_open has no __iter__)
            shape = weights.get_slice(name).get_shape()
            count = 4
            for size in shape:
                count *= size
            if "embed_tokens" in name:
                embedding += count
            else:
                other += count
    return embedding, other


@pytest.fixture(scope="module")
def draft_servers(demo_models, server_pool):
    """The two servers of this module, started side by side: the untrained truncation as level
    2 (over 4-bit KIVI), and the shipped drafter over SnapKV keeping half the tokens."""
    with server_pool.hold(
        ServerSpec.of(demo_models.target, [
            *SERVER_ARGS, "--enable-vericache", "--vericache-draft-model",
            str(demo_models.draft), "--vericache-drafter-max-length", "3",
            *FIXED_DRAFT_LENGTH]),
        ServerSpec.of(demo_models.target, [
            *SERVER_ARGS, "--enable-vericache", "--vericache-compressor", "snapkv:ratio=0.5",
            "--vericache-draft-model", str(demo_models.drafter), *FIXED_DRAFT_LENGTH]),
    ) as servers:
        yield servers


def test_an_untrained_draft_model_costs_speed_not_output(demo_models, plain, prompt_ids,
                                                         draft_servers):
    """The 4-layer truncation proposes up to 3 tokens; two requests at once (32 tokens each:
    its proposals make every round slow): plain SGLang's tokens. Its proposals were checked and
    nearly all rejected. The server reports the draft model's device bytes, measured from its
    tensors: its layers, not the embedding it reads from the target."""
    names = ["heapq_400", "chat_fnmatch"]
    server = draft_servers[0]
    got = assert_batch_identical(server, plain, {name: prompt_ids[name] for name in names},
                                 "kivi:bits=4 + 4-layer truncation", max_new_tokens=32)
    proposed = sum(levels(out)[1] for out in got)
    kept = sum(levels(out)[2] for out in got)
    print(f"  level 2: {kept}/{proposed} proposals kept")
    assert 0 <= kept < proposed / 2
    state = server.server_info()["internal_states"][0]["vericache_state"]
    assert state["totals"]["drafter_proposed"] > 0
    embedding, layers = _weight_bytes(demo_models.draft)
    assert layers <= state["drafter_device_bytes"] < layers + embedding // 100


def test_the_distilled_drafter_on_a_token_dropping_tier(plain, prompt_ids, tokenizer,
                                                        draft_servers):
    """The shipped drafter under SnapKV keeping half the tokens: three real prompts at once,
    then a stop string, a JSON schema (proposals checked under the schema's mask) and a
    streamed request together: plain SGLang's tokens, and the drafter's proposals were kept
    more often than the truncation's. (The requests are test_drafter.py's, so that plain
    SGLang answers each once.)"""
    names = ["heapq_400", "csv_700", "chat_palindrome"]
    stopped = payload(prompt_ids["csv_700"], "code", max_new_tokens=96, stop=["\n\n"])
    constrained = json_schema_request(tokenizer)
    streamed = payload(prompt_ids["heapq_400"], "code", max_new_tokens=64)
    server = draft_servers[1]
    got = assert_batch_identical(server, plain, {name: prompt_ids[name] for name in names},
                                 "snapkv:ratio=0.5 + distilled drafter")
    with ThreadPoolExecutor(2) as pool:
        chunks = pool.submit(stream_chunks, server, streamed)
        got_together = send_all(server, [stopped, constrained])
        chunks = chunks.result()
    for request, out in zip([stopped, constrained], got_together, strict=True):
        assert out["output_ids"] == plain(request)["output_ids"]
    assert chunks[-1]["output_ids"] == plain(streamed)["output_ids"]
    proposed = sum(levels(out)[1] for out in [*got, *got_together])
    kept = sum(levels(out)[2] for out in [*got, *got_together])
    print(f"  level 2: {kept}/{proposed} proposals kept")
    assert levels(got_together[1])[1] > 0  # the drafter proposed for the grammar request
    # One run kept 162 of 602; the truncation in the test above keeps about 5%.
    assert proposed / 8 < kept < proposed
