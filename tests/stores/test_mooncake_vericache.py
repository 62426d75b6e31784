"""VeriCache stores coded pages in a Mooncake store and a later server reloads them; a plain
SGLang server on the same store skips them cleanly; a store that dies or is down loses nothing.

Pages of 64 tokens (`--page-size 64`, what HiCache storage deployments use), a store of this
module's own (it is killed here). Server A (VeriCache, `--hicache-storage-backend mooncake`)
answers a 3,200-token prompt and stops once the store holds its 50 pages, coded, three objects
each (`stores/mooncake.py`). A plain SGLang server with the same arguments but VeriCache then asks
the prompt plus a question, and a short prompt: SGLang's raw K and V objects of those pages are
not in the store, so it finds no storage hit and prefills everything; its outputs are the
references. Server B (A's flags), started beside it, answers the question with all 3,200 tokens
loaded from A's objects. B also drafts before the exact KV for a JSON-schema request (plain
SGLang's output) and for sampled requests (plain SGLang's distribution, 47 draws at temperature
0.5: enough that a greedy sampler fails the test, tests/test_homogeneity.py), and answers the
question while another request decodes: the loading prefill parks beside it, drafting between
its steps, and the decoding request keeps streaming (`speculative/parking.py`). Server D, of
another compressor (2-bit KIVI, reading pages whole), shares the store with B: they take turns
over the question (A's 4-bit pages) and the short prompt (D's 2-bit pages), each answer plain
SGLang's, each server counting the other's pages, and neither removing one. A page whose exact
part never comes is never served as exact, the fault injected at a named point: the exact object
(`<page>_0_x`) of the fourth page of a 640-token prefix B stored is rewritten with one byte
flipped, so the page answers on its drafting level and its exact part fails its digest (and the
pages after it with it); B then answers that prefix plus a question during the early drafting,
while another request decodes, and after the client that asked first gave up, and once more
from the store: plain SGLang's answer each time, the fault counted. Then the store is killed
under B, and B still answers (the question, then the short prompt) with the references.
Server C starts while the store is down, answers the short prompt, and reaches the store once
it is back (retrying every 2 s, `VERICACHE_STORE_RETRY_SECONDS`), under SGLang's own fault
injector (`SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE`): every answer equals the reference.
At most two servers are up at once.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from sglang.srt.mem_cache.utils import get_hash_str
from transformers import AutoTokenizer

from tests.support.homogeneity import two_sample_pvalue
from tests.support.identity import send_all
from tests.support.servers import FULL_KV_BYTES_PER_TOKEN, SERVER_ARGS, side_by_side
from vericache_sglang.speculative.meta_info import EARLY_DRAFTS_KEY
from vericache_sglang.stores.reconnect import RETRY_ENV
from vericache_tools.mooncake_service import (
    MooncakeService,
    mooncake_unavailable_reason,
)
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_process import ServerProcess
from vericache_tools.streaming import StreamingRequest

pytestmark = [pytest.mark.server, pytest.mark.timeout(900),
              pytest.mark.usefixtures("no_idle_servers")]

PAGE_SIZE = 64
PROMPT_TOKENS = 3200
PAGES = PROMPT_TOKENS // PAGE_SIZE
SHORT_TOKENS = 640
OTHER_TOKENS = 1280
DEVICE_TOKENS = 8192
SAMPLES = 47
"""Sampled answers per server over a stored prefix (each of B's read from the store)."""
SAMPLED_TOKENS = 4
RUNNING_TOKENS = 160
"""A request decoding while another's stored prefix loads: long enough to outlast it."""
STORE_ARGS = [*SERVER_ARGS, "--page-size", str(PAGE_SIZE), "--enable-hierarchical-cache",
              "--hicache-ratio", "1", "--hicache-write-policy", "write_through",
              "--hicache-storage-prefetch-policy", "wait_complete"]
FAULT_TOKENS = 640
"""The stored prefix of each fault test: 10 pages."""
BAD_PAGE = 3
FAULTS = ("fault_drafting", "fault_bystander", "fault_aborted")
VERICACHE_ARGS = ["--enable-vericache", "--vericache-draft-length", "16"]


def _server(model: Path, store: MooncakeService, vericache: bool,
            env: dict[str, str] | None = None, full_tier: str = "device",
            early: bool = False, extra: list[str] | None = None,
            compressor: str = "kivi:bits=4") -> ServerProcess:
    """A server on the store. VeriCache's full KV is in SGLang's device pool by default, so
    SGLang's own host pool holds fetched pages and its `load_back` brings them to the device
    (`auto` puts it in the host tier: SGLang's buffer-only pipeline, which
    tests/speculative/test_page_size.py's server B reloads through). `early`: pages answer
    on their drafting level, the exact part behind (`--vericache-early-drafting`)."""
    vericache_args = ([*VERICACHE_ARGS, "--vericache-compressor", compressor,
                       "--vericache-full-tier", full_tier,
                       *(["--vericache-early-drafting"] if early else []), *(extra or [])]
                      if vericache else [])
    return ServerProcess(model, [*STORE_ARGS, *store.server_args(), *vericache_args],
                         max_total_tokens=DEVICE_TOKENS, env={**store.env(), **(env or {})})


def _request(ids: list[int], new_tokens: int = 12) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 0,
                                                  "max_new_tokens": new_tokens,
                                                  "ignore_eos": True}}


def _sampled(prompts: dict[str, list[int]], n: int = 1) -> dict:
    """A sampled request over the stored `other2` prefix (the csv module's source; a
    question from bisect's after it)."""
    return {"input_ids": prompts["other2"] + prompts["question"][-30:],
            "sampling_params": {"temperature": 0.5, "max_new_tokens": SAMPLED_TOKENS,
                                "ignore_eos": True, "n": n}}


def _early_drafts(out: dict) -> int:
    """Tokens the request drafted before its prefix's exact KV had arrived."""
    return out["meta_info"].get(EARLY_DRAFTS_KEY, [0])[0]


def _state(server: ServerProcess) -> dict:
    return server.server_info()["internal_states"][0]["vericache_state"]


def _storage_hit(out: dict) -> int:
    return (out["meta_info"].get("cached_tokens_details") or {}).get("storage", 0)


@pytest.fixture(scope="module")
def store() -> Iterator[MooncakeService]:
    reason = mooncake_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with MooncakeService(segment_size=1024 << 20) as service:
        yield service


@pytest.fixture(scope="module")
def prompts(demo_model) -> dict[str, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    prompt = stdlib_ids(tokenizer, "inspect", PROMPT_TOKENS, start=100)
    return {"prompt": prompt,
            "question": prompt + stdlib_ids(tokenizer, "bisect", 60, start=300),
            "short": stdlib_ids(tokenizer, "heapq", SHORT_TOKENS, start=50),
            "other": stdlib_ids(tokenizer, "textwrap", OTHER_TOKENS, start=0),
            "other2": stdlib_ids(tokenizer, "csv", OTHER_TOKENS, start=0),
            "running": stdlib_ids(tokenizer, "heapq", 200, start=20),
            **{name: stdlib_ids(tokenizer, module, FAULT_TOKENS, start=10 + i)
               + stdlib_ids(tokenizer, "bisect", 40, start=300)
               for i, (name, module) in enumerate(zip(FAULTS, ("string", "shlex", "fnmatch"),
                                                      strict=True))}}


def _together(prompts: dict[str, list[int]]) -> list[dict]:
    """Three requests sent at once over two stored prefixes of 1,280 tokens (three prefetches
    fit SGLang's prefetch share of the host pool, half of 8,192 tokens): two questions on one
    prefix, under a stop string and a JSON schema, and the other prefix."""
    stop = _request(prompts["other"] + prompts["question"][-60:])
    stop["sampling_params"]["stop"] = ["=="]  # the 7th to 9th tokens here
    schema = _request(prompts["other"] + prompts["short"][:40])
    schema["sampling_params"]["json_schema"] = json.dumps({
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    return [stop, schema, _request(prompts["other2"])]


@pytest.fixture(scope="module")
def stored(store, demo_model, prompts) -> dict:
    """Server A's answer to the prompt, what it wrote, and the store's objects and bytes."""
    with _server(demo_model, store, vericache=True) as a:
        keys_before = store.wait_keys(0)
        bytes_before = store.stored_bytes()
        first = a.generate(_request(prompts["prompt"]))
        # Three objects per page, written behind the answer: all must be there before A stops.
        keys = store.wait_keys(keys_before + 3 * PAGES) - keys_before
        written = _state(a)["store_io"]
        stored_bytes = store.stored_bytes() - bytes_before
        for name in ("other", "other2"):
            a.generate(_request(prompts[name]))
        store.wait_keys(keys_before + 3 * (PAGES + 2 * OTHER_TOKENS // PAGE_SIZE))
    return {"first": first, "keys": keys, "written": written, "bytes": stored_bytes}


@pytest.fixture(scope="module")
def plain_and_b(stored, store, demo_model) -> Iterator[list[ServerProcess]]:
    """Plain SGLang and server B on the same store, started side by side once A has stopped.
    B has one codec process: a page's exact part takes ~0.1 s to decode, so a prefix's exact
    parts arrive over seconds after its drafting parts, and the store can die in between.
    Deadline 0: every page drafts on its coarse level, and its refinement comes behind."""
    del stored
    with side_by_side(_server(demo_model, store, vericache=False),
                      _server(demo_model, store, vericache=True, early=True,
                              extra=["--vericache-store-codec-processes", "1",
                                     "--vericache-drafting-deadline", "0"])) as servers:
        yield servers


@pytest.fixture(scope="module")
def reference(plain_and_b, prompts) -> dict[str, dict]:
    """Plain SGLang on the same store (after A): the question and the short prompt; it stops
    before B is asked anything."""
    plain = plain_and_b[0]
    began = time.monotonic()
    out = {"question": plain.generate(_request(prompts["question"]))}
    out["question_s"] = time.monotonic() - began
    out["short"] = plain.generate(_request(prompts["short"]))
    out["together"] = send_all(plain, _together(prompts))
    out["sampled"] = plain.generate(_sampled(prompts, SAMPLES))
    for name in FAULTS:
        out[name] = plain.generate(_request(prompts[name]))
    out["running"] = plain.generate(_request(prompts["running"], RUNNING_TOKENS))
    plain.stop()
    return out


@pytest.fixture(scope="module")
def server_b(plain_and_b, reference) -> ServerProcess:
    del reference  # asked first, and its server stopped
    return plain_and_b[1]


def test_each_page_is_three_coded_objects(stored):
    raw = PAGES * PAGE_SIZE * FULL_KV_BYTES_PER_TOKEN
    print(f"\n[mooncake coded] {stored['keys']} objects, "
          f"{stored['bytes'] / (PAGES * PAGE_SIZE):.0f} B per token "
          f"({stored['bytes'] / raw:.3f} of raw float32)")
    assert stored["first"]["meta_info"]["cached_tokens"] == 0
    assert stored["keys"] == 3 * PAGES  # the coarse, refinement and exact parts
    assert stored["written"]["written_coded_pages"] >= PAGES
    assert stored["bytes"] < 0.95 * raw


def test_plain_sglang_skips_the_coded_pages(reference):
    for name in ("question", "short"):
        assert _storage_hit(reference[name]) == 0
        assert reference[name]["meta_info"]["cached_tokens"] == 0


def test_the_next_server_reloads_the_coded_pages(server_b, reference, prompts):
    began = time.monotonic()
    reloaded = server_b.generate(_request(prompts["question"]))
    reload_s = time.monotonic() - began
    details = reloaded["meta_info"]["cached_tokens_details"]
    assert details["device"] == 0 and details["host"] == 0
    assert details["storage"] == PROMPT_TOKENS, details
    assert details["storage_backend"] == "VeriCacheMooncakeStore"
    state = _state(server_b)
    # Each page answered on its coarse object, and its refinement and exact objects were
    # read behind it; the refinement's pool-level codes replaced the coarse ones.
    assert state["store_io"]["read_coarse_pages"] >= PAGES
    assert state["store_io"]["read_refine_pages"] >= PAGES
    assert state["store_io"]["read_exact_pages"] >= PAGES
    early = state["early_drafting"]
    assert early["answered_on_drafting_level"] >= PAGES and early["settled"] >= PAGES
    assert early["refined_pool_pages"] > 0 and early["store_link_mbit"] > 0
    # With one codec process the exact parts come after the drafting parts: the request
    # drafted before they were in, counted (how many drafts is a race with the exact parts'
    # decoding, faster since the lockstep decoder: runs have drafted one or more).
    assert early["early_prefills"] >= 1 and early["early_drafts"] >= 1
    # Every page's compressed form came from its stream: two key groups per page, installed.
    assert state["reloaded_pages"]["installed_pages"] >= 2 * PAGES, state["reloaded_pages"]
    print(f"\n[mooncake coded] B answered in {reload_s:.1f} s, plain prefilling in "
          f"{reference['question_s']:.1f} s")
    assert reloaded["output_ids"] == reference["question"]["output_ids"]


def test_requests_at_once_over_stored_prefixes(server_b, reference, prompts):
    """Three requests at once read two stored prefixes (one of them twice), under a stop
    string and a JSON schema: every answer is plain SGLang's, and the stored pages were read,
    several pages decoded at once."""
    server_b.flush_cache()
    before = _state(server_b)["store_io"].get("read_coarse_pages", 0)
    answers = send_all(server_b, _together(prompts))
    for mine, plain in zip(answers, reference["together"], strict=True):
        assert mine["output_ids"] == plain["output_ids"]
        assert mine["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert reference["together"][0]["meta_info"]["finish_reason"]["type"] == "stop"
    read = _state(server_b)["store_io"]["read_coarse_pages"] - before
    hits = [_storage_hit(answer) for answer in answers]
    print(f"\n[mooncake together] storage hits {hits}, {read} pages read")
    assert hits[2] >= OTHER_TOKENS - PAGE_SIZE  # (its last token is computed)
    # How the two requests on the shared prefix split its pages is SGLang's prefetch
    # scheduling; at least one of them read some.
    assert hits[0] + hits[1] > 0
    assert read >= (hits[2] + max(hits[:2])) // PAGE_SIZE


def test_a_loading_prefix_waits_beside_a_decoding_request(server_b, reference, prompts):
    """A request decodes while another's 3,200-token stored prefix loads: the loading prefill
    parks beside it (`speculative/parking.py`), drafting between its steps, and the decoding
    request keeps streaming; both answer plain SGLang's tokens."""
    server_b.flush_cache()
    before = _state(server_b)["early_drafting"]
    decoding = StreamingRequest(server_b.url, _request(prompts["running"], RUNNING_TOKENS),
                                first_timeout=300)
    sent = time.monotonic()
    out = server_b.generate(_request(prompts["question"]))
    answered = time.monotonic()
    running = decoding.join()
    after = _state(server_b)["early_drafting"]
    assert _storage_hit(out) == PROMPT_TOKENS
    assert out["output_ids"] == reference["question"]["output_ids"]
    assert running["output_ids"] == reference["running"]["output_ids"]
    assert after["prefills_parked"] == before["prefills_parked"] + 1
    steps = after["parked_draft_steps"] - before["parked_draft_steps"]
    during = [t for t in decoding.times if sent < t < answered]
    gaps = [b - a for a, b in itertools.pairwise(decoding.times)]
    print(f"\n[parked] {after['parked_seconds'] - before['parked_seconds']:.2f} s parked, "
          f"{steps} drafting steps between the decoding request's; it streamed {len(during)} "
          f"times meanwhile, largest gap {max(gaps):.2f} s; early drafts {_early_drafts(out)}")
    assert steps > 0 and during
    assert _early_drafts(out) >= 1


def test_grammar_and_sampled_requests_draft_before_the_exact_kv(server_b, reference, prompts):
    """Alone, after a flush, so that each reads its prefix from the store: a JSON-schema
    request drafts under its grammar before the exact KV and answers plain SGLang's tokens;
    sampled requests draft from q, their first token is SGLang's sampler's over the exact KV
    and the stashed drafts are rejection sampled (verified, counted). Their tokens follow
    plain SGLang's distribution: a few draws, a chi-square test per position."""
    schema = _together(prompts)[1]
    server_b.flush_cache()
    answer = server_b.generate(schema)
    assert _storage_hit(answer) > 0
    # How many drafts come before the exact KV is a race between the drafting forwards and
    # the exact parts' decoding (faster since the lockstep decoder: one run drafted one).
    assert _early_drafts(answer) >= 1
    assert answer["output_ids"] == reference["together"][1]["output_ids"]
    before = _state(server_b)["early_drafting"]
    sampled = []
    for _ in range(SAMPLES):
        server_b.flush_cache()
        sampled.append(server_b.generate(_sampled(prompts)))
    after = _state(server_b)["early_drafting"]
    drafted = [_early_drafts(out) for out in sampled]
    print(f"\n[mooncake sampled] early drafts {drafted}; stash verified "
          f"{after['stash_verified'] - before['stash_verified']}, accepted "
          f"{after['stash_accepted'] - before['stash_accepted']}")
    assert all(_storage_hit(out) > 0 for out in sampled)
    assert all(n >= 1 for n in drafted)
    assert after["stash_verified"] > before["stash_verified"]
    plain = [out["output_ids"] for out in reference["sampled"]]
    ours = [out["output_ids"] for out in sampled]
    assert all(len(ids) == SAMPLED_TOKENS for ids in plain + ours)
    pvalues = [two_sample_pvalue([ids[pos] for ids in plain], [ids[pos] for ids in ours])[0]
               for pos in range(SAMPLED_TOKENS)]
    print(f"[mooncake sampled] p per position {[f'{p:.3g}' for p in pvalues]}")
    assert min(pvalues) >= 1e-3 / SAMPLED_TOKENS, pvalues


def _counted_foreign(server: ServerProcess) -> float:
    """`vericache:disk_faults_total{kind="foreign"}` on the server's /metrics."""
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    found = re.search(r'^vericache:disk_faults_total{[^}]*kind="foreign"[^}]*} (\S+)$', text,
                      re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_servers_of_other_compressors_share_the_store(server_b, store, reference, prompts,
                                                      demo_model):
    """D (2-bit KIVI, plain reads) stores the short prompt first; then D and B (4-bit, early
    drafting) take turns, twice, over the question (A's pages) and the short prompt (D's),
    each after a flush. D reads A's 4-bit pages whole: another compressor's stream holds this
    page's exact KV, its codes are not D's pool's pages (skipped, counted; the pool quantizes
    them, and SGLang's load-back, where the codes are installed, goes on). B's drafting read
    of D's pages is foreign: a miss, counted, and B prefills. Every answer is plain SGLang's,
    and the store holds the same objects throughout, none removed."""
    with _server(demo_model, store, vericache=True, compressor="kivi:bits=2") as d:
        first = d.generate(_request(prompts["short"]))
        assert _storage_hit(first) == 0
        assert first["output_ids"] == reference["short"]["output_ids"]
        server_b.flush_cache()  # every page of the question (and its answer) is stored
        assert (server_b.generate(_request(prompts["question"]))["output_ids"]
                == reference["question"]["output_ids"])
        keys = store.wait_keys(0)
        removed = store.metrics()["master_remove_requests_total"]
        before = {"b": _state(server_b), "d": _state(d), "b_metrics": _counted_foreign(server_b)}
        hits: dict[str, list[int]] = {"b": [], "d": []}
        for _ in range(2):
            for name, server in (("d", d), ("b", server_b)):
                for prompt in ("question", "short"):
                    server.flush_cache()
                    out = server.generate(_request(prompts[prompt]))
                    assert out["output_ids"] == reference[prompt]["output_ids"], (name, prompt)
                    hits[name].append(_storage_hit(out))
        after = {"b": _state(server_b), "d": _state(d), "b_metrics": _counted_foreign(server_b)}
        print(f"\n[mooncake shared] storage hits (question, short) D {hits['d']}, B "
              f"{hits['b']}; D skipped {after['d']['reloaded_pages']['skipped_pages']} pages' "
              f"codes, B counted {after['b']['disk_faults']['foreign']} foreign pages")
        # D reads both prefixes; B only its own compressor's, A's.
        assert hits["d"][0::2] == [PROMPT_TOKENS] * 2
        assert all(hit >= SHORT_TOKENS - PAGE_SIZE for hit in hits["d"][1::2])
        assert hits["b"] == [PROMPT_TOKENS, 0] * 2
        skipped = (after["d"]["reloaded_pages"]["skipped_pages"]
                   - before["d"]["reloaded_pages"]["skipped_pages"])
        installed = (after["d"]["reloaded_pages"]["installed_pages"]
                     - before["d"]["reloaded_pages"]["installed_pages"])
        assert skipped >= 2 * PAGES and installed > 0  # its own pages' codes it installs
        foreign = after["b"]["disk_faults"]["foreign"] - before["b"]["disk_faults"]["foreign"]
        assert foreign >= 2 and after["b_metrics"] - before["b_metrics"] >= 2
        for server in ("b", "d"):
            assert after[server]["disk_faults"]["corrupt"] == before[server]["disk_faults"][
                "corrupt"]
        assert store.wait_keys(0) == keys
        assert store.metrics()["master_remove_requests_total"] == removed


@pytest.fixture(scope="module")
def fault_pages(server_b, store, prompts):
    """The fault tests' prefixes, stored by B's own prefills (written through), and a store
    client of this process to damage them with."""
    for name in FAULTS:
        server_b.generate(_request(prompts[name][:FAULT_TOKENS], 1))
    return store.connect()


def _exact_object(model: Path, ids: list[int], page: int) -> str:
    """The name of page `page`'s exact object (`mooncake.VeriCacheMooncakeStore`, rank 0,
    under SGLang's Mooncake prefix: the served model's name, slashes as dashes)."""
    page_hash = get_hash_str(ids[:FAULT_TOKENS], None, page_size=PAGE_SIZE)[page]
    return f"{'-'.join(str(model).split('/'))}_{page_hash}_0_x"


def _corrupt(client, model: Path, ids: list[int]) -> str:
    """Flip one byte of the bad page's exact object, once B has written it; its name."""
    name = _exact_object(model, ids, BAD_PAGE)
    deadline = time.monotonic() + 60  # B writes behind its answers
    while client.is_exist(name) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    blob = bytearray(client.get(name))
    assert blob, f"{name} is not in the store"
    blob[len(blob) // 2] ^= 0xFF
    # Our own get just leased it: remove it past the lease, then put the changed bytes.
    assert client.remove(name, force=True) == 0 and client.put(name, bytes(blob)) == 0
    return name


def _faults(server: ServerProcess) -> tuple[int, int, int]:
    """(corrupt pages counted, pages whose exact part failed, pages recomputed after it)."""
    state = _state(server)
    early = state["early_drafting"]
    return (state["disk_faults"]["corrupt"], early["exact_failed"],
            early["recomputed_pages"])


def _ask_again(server: ServerProcess, ids: list[int], expected: list[int]) -> None:
    """A later request over the same prefix, from the store again: plain SGLang's answer."""
    server.flush_cache()
    assert server.generate(_request(ids))["output_ids"] == expected
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200


def test_a_corrupt_exact_part_during_early_drafting_is_recomputed(
        server_b, fault_pages, demo_model, prompts, reference):
    ids = prompts["fault_drafting"]
    server_b.flush_cache()
    name = _corrupt(fault_pages, demo_model, ids)
    corrupt, failed, recomputed = _faults(server_b)
    out = server_b.generate(_request(ids))
    assert out["output_ids"] == reference["fault_drafting"]["output_ids"]
    assert (out["meta_info"].get("cached_tokens_details") or {}).get("storage") == \
        FAULT_TOKENS
    after_corrupt, after_failed, after_recomputed = _faults(server_b)
    print(f"\n[fault during drafting] {after_failed - failed} pages' exact part failed, "
          f"{after_recomputed - recomputed} recomputed")
    assert after_corrupt == corrupt + 1
    # The bad page and the later ones not yet fetched when it failed (a page fetched beside
    # it may still arrive exact): each recomputed.
    assert 1 <= after_failed - failed <= FAULT_TOKENS // PAGE_SIZE - BAD_PAGE
    assert after_recomputed - recomputed == after_failed - failed
    # Only the page whose digest failed is removed; the pages before it stay.
    assert fault_pages.is_exist(name) != 1
    assert fault_pages.is_exist(_exact_object(demo_model, ids, BAD_PAGE - 1)) == 1
    _ask_again(server_b, ids, reference["fault_drafting"]["output_ids"])


def test_a_corrupt_exact_part_while_another_request_decodes(
        server_b, fault_pages, demo_model, prompts, reference):
    ids = prompts["fault_bystander"]
    server_b.flush_cache()
    _corrupt(fault_pages, demo_model, ids)
    corrupt = _faults(server_b)[0]
    decoding = StreamingRequest(server_b.url, _request(prompts["running"], RUNNING_TOKENS),
                                first_timeout=300)
    out = server_b.generate(_request(ids))
    assert out["output_ids"] == reference["fault_bystander"]["output_ids"]
    assert decoding.join()["output_ids"] == reference["running"]["output_ids"]
    assert _faults(server_b)[0] == corrupt + 1
    _ask_again(server_b, ids, reference["fault_bystander"]["output_ids"])


def test_a_corrupt_exact_part_after_its_client_gave_up(
        server_b, fault_pages, demo_model, prompts, reference):
    """The client that asked drops its connection (SGLang aborts the request) while the pages
    load; the next request over the prefix still gets plain SGLang's answer."""
    ids = prompts["fault_aborted"]
    server_b.flush_cache()
    _corrupt(fault_pages, demo_model, ids)
    corrupt = _faults(server_b)[0]
    with pytest.raises(requests.Timeout):
        requests.post(f"{server_b.url}/generate", json=_request(ids, 64), timeout=1.0)
    again = server_b.generate(_request(ids))
    assert again["output_ids"] == reference["fault_aborted"]["output_ids"]
    # The first request's read met the fault, or (aborted before its prefetch) the second's.
    assert _faults(server_b)[0] == corrupt + 1
    _ask_again(server_b, ids, reference["fault_aborted"]["output_ids"])


def test_a_store_that_died_loses_nothing(server_b, store, reference, prompts):
    """The store is killed under B: the question's stored prefix and a prompt the store has
    never seen are computed, with plain SGLang's output, the failed lookups and writes
    counted, and B keeps serving. (A page whose exact part fails mid-read, injected at a named
    point, is the corrupt-object tests' above.)"""
    server_b.flush_cache()
    before = _state(server_b)["disk_faults"]
    store.kill()
    for name in ("question", "short"):
        out = server_b.generate(_request(prompts[name]))
        assert out["output_ids"] == reference[name]["output_ids"]
        assert _storage_hit(out) == 0
    after = _state(server_b)["disk_faults"]
    print(f"\n[mooncake killed] faults {before} -> {after}")
    assert (after["missing"] + after["read_error"] + after["write_error"]
            > before["missing"] + before["read_error"] + before["write_error"])
    assert requests.get(f"{server_b.url}/health", timeout=30).status_code == 200


def test_a_store_down_at_startup_is_reached_once_it_is_back(store, reference, prompts,
                                                              demo_model):
    """C starts while the store is down (killed above) and serves; once the store is back,
    C writes to it and reads from it, with SGLang's injector failing a third of the calls."""
    if store.alive():
        store.kill()
    env = {RETRY_ENV: "2", "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": "0.3"}
    with _server(demo_model, store, vericache=True, env=env, full_tier="auto") as c:
        # The injector fails a third of the lookups before they reach the store, so one
        # request's lookup may never meet the down store: ask until one has (at most six
        # times: all six injected has odds of 0.3^6, under 1 in 1,000).
        for _ in range(6):
            c.flush_cache()
            down = c.generate(_request(prompts["short"]))
            assert down["output_ids"] == reference["short"]["output_ids"]
            assert _storage_hit(down) == 0
            if _state(c)["disk_faults"]["unavailable"] > 0:
                break
        assert _state(c)["disk_faults"]["unavailable"] > 0
        store.start()
        time.sleep(3)
        # Written through to the store once C reaches it (a page an injected failure kept
        # out is written again by the next request computing it). C probes the store every
        # 2 s and then builds its client, which a loaded machine can take a while to do.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            c.flush_cache()
            out = c.generate(_request(prompts["short"]))
            assert out["output_ids"] == reference["short"]["output_ids"]
            if _state(c)["store_io"].get("written_coded_pages", 0) >= SHORT_TOKENS // PAGE_SIZE:
                break
        io = _state(c)["store_io"]
        print(f"\n[mooncake back] {io}")
        assert io.get("written_coded_pages", 0) > 0
        assert requests.get(f"{c.url}/health", timeout=30).status_code == 200
