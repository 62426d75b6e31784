"""VeriCache stores coded pages in the session's Mooncake store and a later server reloads them;
a plain SGLang server on the same store skips them cleanly and computes the same output.

Pages of 64 tokens (`--page-size 64`, what HiCache storage deployments use). Server A
(VeriCache, `--hicache-storage-backend mooncake`) answers a 3,200-token prompt and stops once
the store holds its 50 pages, one coded object each (`stores/mooncake.py`). Server B (the same
flags), started afterwards, answers the prompt plus a question with all 3,200 tokens loaded from
those objects. A plain SGLang server with the same arguments but VeriCache then asks the same
request: SGLang's raw K and V objects of those pages are not in the store, so it finds no
storage hit and prefills everything, and its output is the reference B must equal. One server
is up at a time.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.conftest import FULL_KV_BYTES_PER_TOKEN, SERVER_ARGS
from vericache_sglang.prompts import stdlib_ids
from vericache_sglang.server_process import ServerProcess
from vericache_sglang.stores.mooncake_service import MooncakeService

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

PAGE_SIZE = 64
PROMPT_TOKENS = 3200
PAGES = PROMPT_TOKENS // PAGE_SIZE
DEVICE_TOKENS = 8192
STORE_ARGS = [*SERVER_ARGS, "--page-size", str(PAGE_SIZE), "--enable-hierarchical-cache",
              "--hicache-ratio", "1", "--hicache-write-policy", "write_through",
              "--hicache-storage-prefetch-policy", "wait_complete"]
VERICACHE_ARGS = ["--enable-vericache", "--vericache-compressor", "kivi:bits=4",
                  "--vericache-draft-length", "16"]


def _server(model: Path, store: MooncakeService, vericache: bool) -> ServerProcess:
    # Keys tagged with this module's name: no other test's pages can hit.
    storage = store.server_args(extra_backend_tag=__name__.rpartition(".")[2])
    return ServerProcess(model, [*STORE_ARGS, *storage, *(VERICACHE_ARGS if vericache else [])],
                         max_total_tokens=DEVICE_TOKENS, env=store.env())


def _request(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 12,
                                                  "ignore_eos": True}}


def _vericache_state(server: ServerProcess) -> dict:
    return server.server_info()["internal_states"][0]["vericache_state"]


def test_coded_pages_are_reloaded_by_the_next_server_and_skipped_by_plain_sglang(
        mooncake_store, demo_model):
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    prompt = stdlib_ids(tokenizer, "inspect", PROMPT_TOKENS, start=100)
    question = prompt + stdlib_ids(tokenizer, "bisect", 60, start=300)
    store = mooncake_store

    with _server(demo_model, store, vericache=True) as a:
        keys_before = store.wait_keys(0)
        bytes_before = store.stored_bytes()
        first = a.generate(_request(prompt))
        assert first["meta_info"]["cached_tokens"] == 0
        # One object per page, written behind the answer: all must be there before A stops.
        keys = store.wait_keys(keys_before + PAGES) - keys_before
        written = _vericache_state(a)["store_io"]
    stored = store.stored_bytes() - bytes_before
    print(f"\n[mooncake coded] {keys} objects, {stored / (PAGES * PAGE_SIZE):.0f} B per token "
          f"({stored / (PAGES * PAGE_SIZE * FULL_KV_BYTES_PER_TOKEN):.3f} of raw float32)")
    assert keys == PAGES
    assert written["written_coded_pages"] >= PAGES
    assert stored < 0.95 * PAGES * PAGE_SIZE * FULL_KV_BYTES_PER_TOKEN

    with _server(demo_model, store, vericache=True) as b:
        t = time.monotonic()
        reloaded = b.generate(_request(question))
        reload_s = time.monotonic() - t
        details = reloaded["meta_info"]["cached_tokens_details"]
        assert details["device"] == 0 and details["host"] == 0
        assert details["storage"] == PROMPT_TOKENS, details
        assert details["storage_backend"] == "VeriCacheMooncakeStore"
        assert _vericache_state(b)["store_io"]["read_coded_pages"] >= PAGES

    with _server(demo_model, store, vericache=False) as plain:
        t = time.monotonic()
        expected = plain.generate(_request(question))
        plain_s = time.monotonic() - t
        assert (expected["meta_info"].get("cached_tokens_details") or {}).get("storage", 0) == 0
        assert expected["meta_info"]["cached_tokens"] == 0
    print(f"[mooncake coded] B answered in {reload_s:.1f} s, plain prefilling in {plain_s:.1f} s")
    assert reloaded["output_ids"] == expected["output_ids"]
