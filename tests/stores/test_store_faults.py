"""A stored page whose exact part never comes is never served as exact (issue 45, item 1).

Server F drafts before a stored prefix's exact KV (`--vericache-early-drafting`) over a
Mooncake store. The fault is injected at a named point: the exact object (`<page>_0_x`) of
the fourth page of a stored 640-token prefix is overwritten with its own bytes, one flipped,
so the page answers on its drafting level and its exact part fails its digest; the six pages
after it fail with it (`mooncake._read_exact`). Each test then asks F for that prefix plus a
question, once during the early drafting, once while another request decodes, once after the
client gave up on the request that loaded the pages, and asks again; every answer must be
plain SGLang's (same flags, no VeriCache, float32, greedy), the fault counted, and F still
serving. The bookkeeping of each order of events (a page failing outside the forward, freed,
loaded again; a deadline) is tests/stores/test_pending.py's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from sglang.srt.mem_cache.utils import get_hash_str
from transformers import AutoTokenizer

from tests.conftest import SERVER_ARGS
from vericache_sglang.prompts import stdlib_ids
from vericache_sglang.server_process import ServerProcess
from vericache_sglang.stores.mooncake_service import MooncakeService

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

PAGE_SIZE = 64
PREFIX_TOKENS = 640
BAD_PAGE = 3
STORE_ARGS = [*SERVER_ARGS, "--page-size", str(PAGE_SIZE), "--enable-hierarchical-cache",
              "--hicache-ratio", "1", "--hicache-write-policy", "write_through",
              "--hicache-storage-prefetch-policy", "wait_complete"]
EARLY_ARGS = ["--enable-vericache", "--vericache-compressor", "kivi:bits=4",
              "--vericache-draft-length", "16", "--vericache-early-drafting",
              "--vericache-full-tier", "device", "--vericache-store-codec-processes", "1"]
SCENARIOS = ("drafting", "bystander", "aborted")


def _request(ids: list[int], new_tokens: int = 12) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 0,
                                                  "max_new_tokens": new_tokens,
                                                  "ignore_eos": True}}


@pytest.fixture(scope="module")
def prompts(demo_model: Path) -> dict[str, list[int]]:
    """A stored prefix per scenario, a question after each, and the bystander's prompt."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    question = stdlib_ids(tokenizer, "bisect", 40, start=300)
    out = {"running": stdlib_ids(tokenizer, "heapq", 200, start=20)}
    for i, (name, module) in enumerate(zip(SCENARIOS, ("string", "shlex", "fnmatch"),
                                           strict=True)):
        out[name] = stdlib_ids(tokenizer, module, PREFIX_TOKENS, start=10 + i)
        out[f"{name}_question"] = out[name] + question
    return out


def _server(model: Path, store: MooncakeService, extra: list[str]) -> ServerProcess:
    return ServerProcess(model, [*STORE_ARGS, *store.server_args(), *extra],
                         max_total_tokens=8192, env=store.env())


@pytest.fixture(scope="module")
def reference(demo_model: Path, mooncake_store: MooncakeService, prompts) -> dict[str, list]:
    """Plain SGLang's answers (it reads none of VeriCache's coded objects)."""
    with _server(demo_model, mooncake_store, []) as plain:
        out = {name: plain.generate(_request(prompts[f"{name}_question"]))["output_ids"]
               for name in SCENARIOS}
        out["running"] = plain.generate(_request(prompts["running"], 48))["output_ids"]
    return out


@pytest.fixture(scope="module")
def server_f(reference, demo_model: Path, mooncake_store: MooncakeService,
             prompts) -> Iterator[ServerProcess]:
    """F, with each scenario's prefix stored (written through by F's own prefill)."""
    with _server(demo_model, mooncake_store, EARLY_ARGS) as f:
        for name in SCENARIOS:
            f.generate(_request(prompts[name], 1))
        yield f


@pytest.fixture(scope="module")
def client(mooncake_store: MooncakeService):
    return mooncake_store.connect()


def _exact_object(model: Path, ids: list[int], page: int) -> str:
    """The name of page `page`'s exact object (`mooncake.VeriCacheMooncakeStore`, rank 0,
    under SGLang's Mooncake prefix: the served model's name, slashes as dashes)."""
    page_hash = get_hash_str(ids[:PREFIX_TOKENS], None, page_size=PAGE_SIZE)[page]
    return f"{'-'.join(str(model).split('/'))}_{page_hash}_0_x"


def _corrupt(client, model: Path, ids: list[int]) -> str:
    """Flip one byte of the bad page's exact object, once F has written it; its name."""
    name = _exact_object(model, ids, BAD_PAGE)
    deadline = time.monotonic() + 60  # F writes behind its answers
    while client.is_exist(name) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    blob = bytearray(client.get(name))
    assert blob, f"{name} is not in the store"
    blob[len(blob) // 2] ^= 0xFF
    # Our own get just leased it: remove it past the lease, then put the changed bytes.
    assert client.remove(name, force=True) == 0 and client.put(name, bytes(blob)) == 0
    return name


def _early(server: ServerProcess) -> dict:
    return server.server_info()["internal_states"][0]["vericache_state"]


def _faults(server: ServerProcess) -> tuple[int, int, int]:
    """(corrupt pages counted, pages whose exact part failed, pages recomputed after it)."""
    state = _early(server)
    early = state["early_drafting"]
    return (state["disk_faults"]["corrupt"], early["exact_failed"],
            early["recomputed_pages"])


def _ask_again(server: ServerProcess, ids: list[int], expected: list[int]) -> None:
    """A later request over the same prefix, from the store again: plain SGLang's answer."""
    server.flush_cache()
    assert server.generate(_request(ids))["output_ids"] == expected
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200


def test_a_corrupt_exact_part_during_early_drafting_is_recomputed(
        server_f, client, demo_model, prompts, reference):
    ids = prompts["drafting_question"]
    server_f.flush_cache()
    name = _corrupt(client, demo_model, ids)
    corrupt, failed, recomputed = _faults(server_f)
    out = server_f.generate(_request(ids))
    assert out["output_ids"] == reference["drafting"]
    assert (out["meta_info"].get("cached_tokens_details") or {}).get("storage") == \
        PREFIX_TOKENS
    after_corrupt, after_failed, after_recomputed = _faults(server_f)
    print(f"\n[fault during drafting] {after_failed - failed} pages' exact part failed, "
          f"{after_recomputed - recomputed} recomputed")
    assert after_corrupt == corrupt + 1
    # The bad page and the later ones not yet fetched when it failed (a page fetched beside
    # it may still arrive exact): each recomputed.
    assert 1 <= after_failed - failed <= PREFIX_TOKENS // PAGE_SIZE - BAD_PAGE
    assert after_recomputed - recomputed == after_failed - failed
    # Only the page whose digest failed is removed; the pages before it stay.
    assert client.is_exist(name) != 1
    assert client.is_exist(_exact_object(demo_model, ids, BAD_PAGE - 1)) == 1
    _ask_again(server_f, ids, reference["drafting"])


def test_a_corrupt_exact_part_while_another_request_decodes(
        server_f, client, demo_model, prompts, reference):
    ids = prompts["bystander_question"]
    server_f.flush_cache()
    _corrupt(client, demo_model, ids)
    corrupt = _faults(server_f)[0]
    running: dict = {}
    decoding = threading.Thread(target=lambda: running.update(
        server_f.generate(_request(prompts["running"], 48))))
    decoding.start()
    out = server_f.generate(_request(ids))
    decoding.join(timeout=600)
    assert out["output_ids"] == reference["bystander"]
    assert running["output_ids"] == reference["running"]
    assert _faults(server_f)[0] == corrupt + 1
    _ask_again(server_f, ids, reference["bystander"])


def test_a_corrupt_exact_part_after_its_client_gave_up(
        server_f, client, demo_model, prompts, reference):
    """The client that asked drops its connection (SGLang aborts the request) while the pages
    load; the next request over the prefix still gets plain SGLang's answer."""
    ids = prompts["aborted_question"]
    server_f.flush_cache()
    _corrupt(client, demo_model, ids)
    corrupt = _faults(server_f)[0]
    with pytest.raises(requests.Timeout):
        requests.post(f"{server_f.url}/generate", json=_request(ids, 64), timeout=1.0)
    assert server_f.generate(_request(ids))["output_ids"] == reference["aborted"]
    # The first request's read met the fault, or (aborted before its prefetch) the second's.
    assert _faults(server_f)[0] == corrupt + 1
    _ask_again(server_f, ids, reference["aborted"])
