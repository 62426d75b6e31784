"""VeriCache under SGLang's `--page-size 64` (HiCache storage deployments use 32-64): output
identical to plain SGLang with the same page size, token for token, in float32.

SGLang's paged allocator hands out and frees KV slots a page at a time: each decode step
reserves whole pages past a request's committed length, a finished request's row goes back
through `free_segment`, the radix tree caches and evicts whole pages only. The compressed pool
is keyed by those slots and freed with them (tests/tiers/test_compressed_pool.py checks that
for every free path of the paged allocator). Here: real prompts in one batch, one of them over
2,048 tokens (chunked prefill), then a cached prefix reused with another suffix.

Plain SGLang answers first and is stopped before the VeriCache server starts, so one server
of this module is up at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import HOST_BUDGET, SERVER_ARGS
from tests.speculative.identity import PROMPTS, payload, send_all, stats
from vericache_sglang.server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

PAGE_SIZE = 64
PAGED_ARGS = [*SERVER_ARGS, "--page-size", str(PAGE_SIZE)]
VERICACHE_ARGS = [
    *PAGED_ARGS,
    "--enable-vericache",
    "--vericache-compressor", "kivi:bits=4",
    "--vericache-draft-length", "16",
    "--vericache-full-tier-budget", HOST_BUDGET,
]
NAMES = ["argparse_2300", "heapq_400", "chat_palindrome"]
NEW_TOKENS = 40
REUSED = 2000
"""Tokens of argparse_2300 the second request repeats: the tree has cached 1,984 of them
(31 whole pages), the rest and its own suffix are prefilled."""


def _payloads(tokenizer) -> tuple[list[dict], dict]:
    """The batch, and a request over the first `REUSED` tokens of its long prompt followed by
    another suffix (sent after the batch)."""
    ids = {name: PROMPTS[name](tokenizer) for name in NAMES}
    batch = [payload(ids[name], name, max_new_tokens=NEW_TOKENS) for name in NAMES]
    suffix = PROMPTS["bisect_300"](tokenizer)[:60]
    reuse = payload(ids["argparse_2300"][:REUSED] + suffix, "code", max_new_tokens=NEW_TOKENS)
    return batch, reuse


def _serve(server: ServerProcess, batch: list[dict], reuse: dict) -> tuple[list[dict], dict]:
    return send_all(server, batch), server.generate(reuse)


@pytest.fixture(scope="module")
def paged_requests(tokenizer) -> tuple[list[dict], dict]:
    return _payloads(tokenizer)


@pytest.fixture(scope="module")
def plain_answers(demo_model: Path, paged_requests) -> tuple[list[dict], dict]:
    with ServerProcess(demo_model, PAGED_ARGS) as server:
        return _serve(server, *paged_requests)


@pytest.fixture(scope="module")
def vericache_answers(demo_model: Path, paged_requests, plain_answers
                      ) -> Iterator[tuple[list[dict], dict, dict]]:
    del plain_answers  # asked first, and its server stopped
    with ServerProcess(demo_model, VERICACHE_ARGS) as server:
        batch, reuse = _serve(server, *paged_requests)
        info = server.server_info()
        yield batch, reuse, info


def test_the_server_runs_with_pages_of_64(vericache_answers):
    *_, info = vericache_answers
    assert info["page_size"] == PAGE_SIZE
    assert info["speculative_algorithm"] == "VERICACHE"


def test_a_batch_is_identical_to_plain_sglang(vericache_answers, plain_answers):
    got, want = vericache_answers[0], plain_answers[0]
    for name, out, expected in zip(NAMES, got, want, strict=True):
        assert out["output_ids"] == expected["output_ids"], name
        assert out["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
    rounds, drafted, accepted = (sum(column) for column in zip(*map(stats, got), strict=True))
    # Drafting happened (far fewer rounds than tokens), and some drafts were rejected.
    assert rounds < sum(len(out["output_ids"]) for out in got) / 2
    assert 0 < accepted < drafted


def test_a_cached_prefix_with_another_suffix_is_identical(vericache_answers, plain_answers):
    out, expected = vericache_answers[1], plain_answers[1]
    assert out["output_ids"] == expected["output_ids"]
    # The tree caches whole pages: all of the prefix's but the partial last one.
    assert (out["meta_info"]["cached_tokens"] == expected["meta_info"]["cached_tokens"]
            == REUSED // PAGE_SIZE * PAGE_SIZE)
    rounds, _, accepted = stats(out)
    assert rounds < len(out["output_ids"]) / 2 and accepted > 0
