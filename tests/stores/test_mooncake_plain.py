"""Plain SGLang (no VeriCache) stores a prefix in the session's Mooncake store and a later
server reloads it, on a machine without a GPU: HiCache's L3 tier through SGLang's own
`mooncake` backend, over TCP on 127.0.0.1, with the output a server without any storage
computes.

Server A answers a 1,200-token prompt and stops once its pages are in the store (HiCache
writes them behind the answer). Server B, started afterwards on the same store, answers the
prompt plus a suffix with the prefix loaded from storage; after a flush it answers the bare
prompt from storage again, equal to A's answer. A plain server without HiCache, started beside
B, answers the suffixed request from scratch, equal to B's answer.

`--hicache-storage-prefetch-policy wait_complete` makes the storage hit whole: SGLang's default
(`timeout`) may start the request before a slow CPU has loaded every page, and count fewer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.support.servers import FULL_KV_BYTES_PER_TOKEN, SERVER_ARGS, side_by_side
from vericache_tools.mooncake_service import MooncakeService
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.timeout(900),
              pytest.mark.usefixtures("no_idle_servers")]

DEVICE_TOKENS = 4096
PROMPT_TOKENS = 1200
HICACHE_RATIO = 2
"""Host pool of 8,192 tokens (377 MB of float32 KV): HiCache keeps 10 GiB of host memory
free besides its pool, so it must stay small on these machines."""

HICACHE_ARGS = ["--enable-hierarchical-cache", "--hicache-ratio", str(HICACHE_RATIO),
                "--hicache-write-policy", "write_through",
                "--hicache-storage-prefetch-policy", "wait_complete"]


def _request(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 16,
                                                  "ignore_eos": True}}


def _server(model: Path, store: MooncakeService | None) -> ServerProcess:
    """A plain SGLang server: with HiCache on `store`, or without HiCache when None."""
    if store is None:
        return ServerProcess(model, SERVER_ARGS, max_total_tokens=DEVICE_TOKENS)
    # Keys tagged with this module's name, so that pages other tests stored in the session's
    # store under the same model cannot turn A's first request into a hit.
    storage = store.server_args(extra_backend_tag=__name__.rpartition(".")[2])
    return ServerProcess(model, [*SERVER_ARGS, *HICACHE_ARGS, *storage],
                         max_total_tokens=DEVICE_TOKENS, env=store.env())


def test_a_prefix_stored_by_one_server_is_reloaded_by_the_next(mooncake_store, demo_model):
    began = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    prompt = stdlib_ids(tokenizer, "argparse", PROMPT_TOKENS, start=100)
    suffixed = prompt + stdlib_ids(tokenizer, "textwrap", 24, start=100)
    store = mooncake_store
    report: dict[str, float] = {"store_start_s": store.start_seconds}

    with _server(demo_model, store) as a:
        # The server's own start-up request is written through too: let it settle first.
        keys_before = store.wait_keys(0)
        bytes_before = store.stored_bytes()
        t = time.monotonic()
        first = a.generate(_request(prompt))
        report["compute_request_s"] = time.monotonic() - t
        assert first["meta_info"]["cached_tokens"] == 0
        # Every prompt page is two objects (K and V, page size 1); all must be in the store
        # before A stops, or B would find only part of the prefix.
        keys_after = store.wait_keys(keys_before + 2 * PROMPT_TOKENS)
        report["rss_with_store_gb"] = a.rss_bytes() / 2**30
    stored_tokens = (keys_after - keys_before) / 2
    report["stored_tokens"] = stored_tokens
    report["store_bytes_per_token"] = (store.stored_bytes() - bytes_before) / stored_tokens

    with side_by_side(_server(demo_model, store), _server(demo_model, None)) as (b, plain):
        t = time.monotonic()
        reloaded = b.generate(_request(suffixed))
        report["reload_request_s"] = time.monotonic() - t
        details = reloaded["meta_info"]["cached_tokens_details"]
        assert details["storage_backend"] == "MooncakeStore"
        assert details["device"] == 0 and details["host"] == 0
        assert PROMPT_TOKENS <= details["storage"] < len(suffixed), details
        # The same request as A's, after a flush: the prefix comes from storage again.
        b.flush_cache()
        again = b.generate(_request(prompt))
        assert again["meta_info"]["cached_tokens_details"]["storage"] >= PROMPT_TOKENS - 1
        assert again["output_ids"] == first["output_ids"]

        t = time.monotonic()
        expected = plain.generate(_request(suffixed))
        report["plain_request_s"] = time.monotonic() - t
        assert expected["meta_info"]["cached_tokens"] == 0
        report["rss_plain_gb"] = plain.rss_bytes() / 2**30
    assert reloaded["output_ids"] == expected["output_ids"]

    # The store's pages are the full float32 KV (plus the allocator's rounding), and HiCache's
    # host pool is all the memory a store-backed server adds to a plain one (1 GiB slack).
    per_token = report["store_bytes_per_token"]
    assert FULL_KV_BYTES_PER_TOKEN <= per_token < 1.1 * FULL_KV_BYTES_PER_TOKEN
    host_pool_gb = HICACHE_RATIO * DEVICE_TOKENS * FULL_KV_BYTES_PER_TOKEN / 2**30
    assert report["rss_with_store_gb"] < report["rss_plain_gb"] + host_pool_gb + 1.0
    report["test_s"] = time.monotonic() - began
    print("mooncake plain:", json.dumps({k: round(v, 3) for k, v in report.items()}))
