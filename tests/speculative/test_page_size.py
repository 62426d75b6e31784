"""VeriCache under SGLang's `--page-size 64` (HiCache storage deployments use 32-64): output
identical to plain SGLang with the same page size, token for token, in float32, and a prefix
stored by one server in coded pages reloaded by the next.

SGLang's paged allocator hands out and frees KV slots a page at a time: each decode step
reserves whole pages past a request's committed length, a finished request's row goes back
through `free_segment`, the radix tree caches and evicts whole pages only. The compressed pool
is keyed by those slots and freed with them (tests/tiers/test_compressed_pool.py checks that
for every free path of the paged allocator). Here: real prompts in one batch, one of them over
2,048 tokens (chunked prefill), then a cached prefix reused with another suffix.

Storage: the VeriCache server (A) keeps its full KV on the disk tier (`--vericache-full-tier
disk`, SGLang's hierarchical cache over its `file` backend), which stores every page as one
CacheGen stream (`stores/file.py`). A stops once the 48 whole pages of the reused request's
argparse prefix (3,072 tokens) are files. Server B is started afterwards the way a user adds
storage: `--enable-hierarchical-cache --hicache-storage-backend file` and SGLang's own extra
config naming A's directory, every other HiCache and VeriCache memory setting at its default
(one host pool: VeriCache's host tier holds the full KV, SGLang's host memory only stages
pages). B answers the reused request with its prefix loaded from A's files, as plain SGLang
answers it, and its compressed pool takes the reloaded prefix's pages from the streams' pool
level instead of quantizing them again (`stores/reloaded.py`). (A 3,200-token stored prefix
is tests/stores/test_mooncake_vericache.py's.)

Plain SGLang answers first and is stopped before the VeriCache servers start, so one server
of this module is up at a time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from sglang.srt.mem_cache.utils import get_hash_str

from tests.support.identity import PROMPTS, payload, send_all, stats, vericache_metrics
from tests.support.servers import (
    FIXED_DRAFT_LENGTH,
    FULL_KV_BYTES_PER_TOKEN,
    HOST_BUDGET,
    SERVER_ARGS,
)
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_process import ServerProcess

# Servers of its own, one after the other; SGLang's hierarchical cache keeps 10 GiB free.
pytestmark = [pytest.mark.server, pytest.mark.timeout(900),
              pytest.mark.usefixtures("no_idle_servers")]

PAGE_SIZE = 64
PAGED_ARGS = [*SERVER_ARGS, "--page-size", str(PAGE_SIZE)]
VERICACHE_ARGS = [
    *PAGED_ARGS,
    "--enable-vericache",
    "--vericache-compressor", "kivi:bits=4",
    *FIXED_DRAFT_LENGTH,
    "--vericache-full-tier-budget", HOST_BUDGET,
    "--vericache-full-tier", "disk",
    # The storage hit is whole, not what a slow CPU loaded before a timeout.
    "--hicache-storage-prefetch-policy", "wait_complete",
]
LONG_PROMPT = "argparse_3200"
NAMES = [LONG_PROMPT, "heapq_400", "chat_palindrome"]
NEW_TOKENS = 24
REUSED = 3100
"""Tokens of the long prompt the second request repeats: the tree has cached 3,072 of them
(48 whole pages), the rest and its own suffix are prefilled."""
SUFFIX = 60
STORED_TOKENS = REUSED // PAGE_SIZE * PAGE_SIZE
"""The stored prefix B reloads: the 48 whole pages of argparse the batch wrote through (A did
not write a reused request's own page, of prefix and suffix, within minutes in a run)."""


def _payloads(tokenizer) -> dict:
    """The batch, and a request over the first `REUSED` tokens of its long prompt followed by
    another suffix (sent after the batch)."""
    prompts = {**PROMPTS, LONG_PROMPT: lambda tok: stdlib_ids(tok, "argparse", 3200, start=6000)}
    ids = {name: prompts[name](tokenizer) for name in NAMES}
    suffix = PROMPTS["bisect_300"](tokenizer)[:SUFFIX]
    return {
        "batch": [payload(ids[name], name, max_new_tokens=NEW_TOKENS) for name in NAMES],
        "reuse": payload(ids[LONG_PROMPT][:REUSED] + suffix, "code",
                         max_new_tokens=NEW_TOKENS),
    }


@pytest.fixture(scope="module")
def paged_requests(tokenizer) -> dict:
    return _payloads(tokenizer)


@pytest.fixture(scope="module")
def plain_answers(demo_model: Path, paged_requests) -> dict:
    with ServerProcess(demo_model, PAGED_ARGS) as server:
        return {"batch": send_all(server, paged_requests["batch"]),
                "reuse": server.generate(paged_requests["reuse"])}


def _page_files(directory: Path, request: dict) -> list[Path]:
    """The files of the stored prefix's pages that exist (SGLang's chained page hashes)."""
    keys = get_hash_str(request["input_ids"], None, PAGE_SIZE)
    return [p for key in keys[:STORED_TOKENS // PAGE_SIZE]
            for p in directory.glob(f"{key}_*.bin")]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("coded-pages")


@pytest.fixture(scope="module")
def vericache_answers(demo_model: Path, paged_requests, plain_answers, store_dir) -> dict:
    """Server A's answers, its `/server_info`, and the files of the stored prompt's pages,
    written before A stopped."""
    del plain_answers  # asked first, and its server stopped
    with ServerProcess(demo_model, [*VERICACHE_ARGS, "--vericache-disk-dir", str(store_dir)]
                       ) as server:
        answers = {"batch": send_all(server, paged_requests["batch"]),
                   "reuse": server.generate(paged_requests["reuse"])}
        deadline = time.monotonic() + 300
        while (len(files := _page_files(store_dir, paged_requests["reuse"]))
               < STORED_TOKENS // PAGE_SIZE and time.monotonic() < deadline):
            time.sleep(1)
        return {**answers, "info": server.server_info(), "files": files}


@pytest.fixture(scope="module")
def reloaded_answer(demo_model: Path, paged_requests, vericache_answers, store_dir) -> dict:
    """Server B's answer to the reused request, its prefix stored by A (A has stopped). B runs
    with `--vericache-store-reads auto`: knowing no read rate yet, it reads the prefix (which
    measures one); after a cache flush it answers the request again, its stored prefix now read
    or recomputed by the faster of the rates it measured (`recomputed`)."""
    del vericache_answers
    with ServerProcess(demo_model, [
        *PAGED_ARGS, "--enable-vericache", "--vericache-compressor", "kivi:bits=4",
        "--vericache-draft-length", "16", "--enable-hierarchical-cache",
        "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
        json.dumps({"file_storage_path": str(store_dir)}),
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--vericache-store-reads", "auto",
    ]) as server:
        out = server.generate(paged_requests["reuse"])
        state = _vericache_state(server)
        answer = {**out, "store_io": state["store_io"], "reloaded": state["reloaded_pages"],
                  "quantized": state["compressed_pages_quantized"],
                  "metrics": vericache_metrics(server)}
        server.flush_cache()
        again = server.generate(paged_requests["reuse"])
        return {**answer, "recomputed": {
            **again, "measured": state["store_reads"],
            "store_reads": _vericache_state(server)["store_reads"],
            "metrics": vericache_metrics(server)}}


def _vericache_state(server: ServerProcess) -> dict:
    return server.server_info()["internal_states"][0]["vericache_state"]


def test_the_server_runs_with_pages_of_64(vericache_answers):
    info = vericache_answers["info"]
    assert info["page_size"] == PAGE_SIZE
    assert info["speculative_algorithm"] == "VERICACHE"


def test_a_batch_is_identical_to_plain_sglang(vericache_answers, plain_answers):
    got, want = vericache_answers["batch"], plain_answers["batch"]
    for name, out, expected in zip(NAMES, got, want, strict=True):
        assert out["output_ids"] == expected["output_ids"], name
        assert out["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
    rounds, drafted, accepted = (sum(column) for column in zip(*map(stats, got), strict=True))
    # Drafting happened (far fewer rounds than tokens), and some drafts were rejected.
    assert rounds < sum(len(out["output_ids"]) for out in got) / 2
    assert 0 < accepted < drafted


def test_a_cached_prefix_with_another_suffix_is_identical(vericache_answers, plain_answers):
    out, expected = vericache_answers["reuse"], plain_answers["reuse"]
    assert out["output_ids"] == expected["output_ids"]
    # The tree caches whole pages: all of the prefix's but the partial last one.
    assert (out["meta_info"]["cached_tokens"] == expected["meta_info"]["cached_tokens"]
            == REUSED // PAGE_SIZE * PAGE_SIZE)
    rounds, _, accepted = stats(out)
    assert rounds < len(out["output_ids"]) / 2 and accepted > 0


def test_a_prefix_stored_in_coded_pages_is_reloaded_by_the_next_server(
        vericache_answers, reloaded_answer, plain_answers):
    files = vericache_answers["files"]
    assert len(files) == STORED_TOKENS // PAGE_SIZE
    stored = sum(f.stat().st_size for f in files)
    raw = STORED_TOKENS * FULL_KV_BYTES_PER_TOKEN
    print(f"\n[coded pages] {len(files)} files, {stored / raw:.3f} of the raw float32 KV")
    assert all(f.read_bytes()[:4] == b"VCKV" for f in files)
    assert stored < 0.92 * raw  # measured 0.90 (3.6 bytes per float32 element)

    out, expected = reloaded_answer, plain_answers["reuse"]
    assert out["output_ids"] == expected["output_ids"]
    details = out["meta_info"]["cached_tokens_details"]
    assert details["device"] == 0 and details["host"] == 0
    assert details["storage"] >= STORED_TOKENS, details
    io = out["store_io"]
    assert io["read_coded_pages"] >= STORED_TOKENS // PAGE_SIZE
    assert io.get("read_raw_pages", 0) == 0


def test_a_reloaded_prefix_takes_its_compressed_pages_from_the_stored_streams(
        reloaded_answer):
    """B installed the pool level of every stored page it read as the compressed pool's pages
    (two key groups per 64-token page), and quantized none: drafting reads groups older than
    KIVI's 128-token recent window, and those of this request all lie in the stored prefix."""
    reloaded, groups = reloaded_answer["reloaded"], STORED_TOKENS // 32
    print(f"\n[reloaded pages] {reloaded}, quantized {reloaded_answer['quantized']}")
    assert reloaded["offered_pages"] >= STORED_TOKENS // PAGE_SIZE
    assert reloaded["installed_pages"] == groups
    assert reloaded_answer["metrics"]["vericache:reloaded_pages_installed_total"] == groups
    assert (REUSED + SUFFIX + NEW_TOKENS - 128) // 32 <= groups
    assert reloaded_answer["quantized"] == 0


def test_a_stored_prefix_is_read_or_recomputed_as_the_measured_rates_say(reloaded_answer,
                                                                        plain_answers):
    """With `--vericache-store-reads auto`, once the server has measured a read and a prefill,
    it recomputes a stored prefix whose pages read slower per token than it prefills (the
    declined pages counted) and reads it otherwise; either way it answers as plain SGLang does.
    Which way depends on this machine's codec and prefill speed (coded float32 pages decoded
    slower than the demo model prefilled until the codec processes and commit d768871); the
    rule's both outcomes are tests/stores/test_admission.py's."""
    recomputed_answer = reloaded_answer["recomputed"]
    measured, reads = recomputed_answer["measured"], recomputed_answer["store_reads"]
    print(f"\n[store reads auto] measured before the request {measured}; after {reads}")
    assert measured["read_seconds_per_token"] > 0 and measured["prefill_seconds_per_token"] > 0
    out, expected = recomputed_answer, plain_answers["reuse"]
    assert out["output_ids"] == expected["output_ids"]
    declined = reads["declined_pages"] - measured["declined_pages"]
    assert (recomputed_answer["metrics"]["vericache:store_reads_declined_total"]
            == reads["declined_pages"])
    if measured["read_seconds_per_token"] > measured["prefill_seconds_per_token"]:
        assert out["meta_info"]["cached_tokens"] == 0  # nothing loaded: the prefix recomputed
        assert declined >= STORED_TOKENS // PAGE_SIZE
    else:
        assert out["meta_info"]["cached_tokens_details"]["storage"] >= STORED_TOKENS
        assert declined == 0
