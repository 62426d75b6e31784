"""The full KV in host memory (`--vericache-full-tier host`, the default): a device budget that
plain SGLang fills with five 2,000-token requests serves eight at once, output identical to
plain SGLang's (which gets enough device memory), and the device holds no more than the budget.

One VeriCache server with --max-total-tokens 12000 and no --max-running-requests: 12,000 tokens
of float32 full KV (553 MB) is the device budget, spent on the compressed pool, the staging area
and the drafting windows of the running requests the plan admits (`tiers/budget.py`); the full
KV lives in the host pool beside it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.identity import payload, send_all
from tests.support.servers import FULL_KV_BYTES_PER_TOKEN, ServerSpec
from vericache_sglang.speculative.meta_info import READ_BYTES_KEY
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_args import server_args
from vericache_tools.server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]

DEVICE_TOKENS = 12000
MODULES = ["textwrap", "argparse", "difflib", "inspect", "typing", "functools", "pathlib",
           "tarfile"]


@pytest.fixture(scope="module")
def host_server(demo_model: Path, servers) -> ServerProcess:
    args = server_args(metrics=True, custom_logit_processor=True, warmup=False)
    return servers(ServerSpec.of(demo_model, [*args, "--enable-vericache",
                                              "--vericache-full-tier", "host"],
                                 max_total_tokens=DEVICE_TOKENS))[0]


def _state(server: ServerProcess) -> dict:
    return server.server_info()["internal_states"][0]["vericache_state"]


def _read_bytes(state: dict) -> int:
    return sum(phase["bytes"] for phase in state["full_tier_reads"].values())


def _within_budget(state: dict) -> None:
    assert state["full_tier"] == "host"
    assert state["device_budget_bytes"] == DEVICE_TOKENS * FULL_KV_BYTES_PER_TOKEN
    assert 0 < state["device_bytes"]["total"] <= state["device_budget_bytes"]


def test_eight_long_requests_at_once_under_a_small_device_budget(host_server, plain, tokenizer):
    prompts = [stdlib_ids(tokenizer, module, 2000, start=500) for module in MODULES]
    # Plain SGLang with the same --max-total-tokens holds the KV of fewer than six of them.
    assert sum(len(ids) + 32 for ids in prompts[:6]) > DEVICE_TOKENS
    payloads = [payload(ids, "code", max_new_tokens=32) for ids in prompts]
    expected = [out["output_ids"] for out in plain.all(payloads)]
    before = _read_bytes(_state(host_server))
    got = send_all(host_server, payloads)
    assert [out["output_ids"] for out in got] == expected
    state = _state(host_server)
    # Each request's own reads (meta_info): every verification round streams its ~2,000-token
    # prefix; together no more than the server read (pages compressed are not attributed).
    per_request = [out["meta_info"][READ_BYTES_KEY][0] for out in got]
    assert all(n >= 2000 * FULL_KV_BYTES_PER_TOKEN for n in per_request)
    assert sum(per_request) <= _read_bytes(state) - before
    assert state["peak_running_requests"] == 8
    _within_budget(state)
    # One fetch of the context serves every token a round emits, and a plain step (the
    # policy's choice where drafting does not pay) reads it once, as plain decoding does:
    # fewer full-KV bytes read per emitted token than the context's KV.
    read = state["decode_read_bytes_per_emitted_token"]
    print(f"\n[host tier] {read / FULL_KV_BYTES_PER_TOKEN:.0f} tokens of full KV read per "
          f"emitted token, contexts of 2,000 tokens; totals {state['totals']}")
    assert 0 < read < 2000 * FULL_KV_BYTES_PER_TOKEN
    # The draft length at its default, chosen by measured cost, times a drafting round and a
    # plain step first at each batch size: both ran, and every output above is plain SGLang's.
    assert state["totals"]["verify_rounds"] > 0 and state["totals"]["plain_decode_steps"] > 0
    info = host_server.server_info()["vericache"]["memory"]
    assert info["full_kv_pool_tokens"] > 8 * 2032

    # A new request over 1,900 tokens of the first prompt reuses them from the host tier (and
    # their compressed pages): only its own tail is prefilled.
    reuse = payload(prompts[0][:1900] + prompts[1][:100], "code", max_new_tokens=32)
    out = host_server.generate(reuse)
    assert out["output_ids"] == plain(reuse)["output_ids"]
    assert out["meta_info"]["cached_tokens"] >= 1900


def test_a_4300_token_prompt_prefilled_in_chunks(host_server, plain, tokenizer):
    """Chunks of 2,048 tokens: the second and third attend to the earlier ones streamed from
    the host tier. 4,300 tokens is what that takes (a third chunk, of 204 tokens, over the
    4,096 before it): a longer prompt reads the same below and only prefills longer."""
    before = _state(host_server)["full_tier_reads"]["prefill"]["bytes"]
    request = payload(stdlib_ids(tokenizer, "argparse", 4300), "code", max_new_tokens=24)
    assert len(request["input_ids"]) > 2 * 2048
    out = host_server.generate(request)
    assert out["output_ids"] == plain(request)["output_ids"]
    assert out["meta_info"][READ_BYTES_KEY][0] >= 6144 * FULL_KV_BYTES_PER_TOKEN
    state = _state(host_server)
    # The prefix of chunks two and three, every layer: 2,048 + 4,096 tokens of full KV.
    assert state["full_tier_reads"]["prefill"]["bytes"] - before >= \
        6144 * FULL_KV_BYTES_PER_TOKEN
    _within_budget(state)


def test_pools_return_to_baseline_after_flush_and_do_not_grow(host_server, tokenizer):
    """After /flush_cache no host slot and no compressed page is in use; a hundred more
    requests and another flush leave the same, and device bytes stay within the budget."""
    def flush_and_check() -> None:
        host_server.flush_cache()
        state = _state(host_server)
        assert state["full_kv_tokens_used"] == 0
        assert state["compressed_pool_pages_used"] == 0
        _within_budget(state)

    flush_and_check()
    source = stdlib_ids(tokenizer, "heapq", 3000)
    for batch in range(10):
        payloads = [payload(source[300 * batch + 30 * i: 300 * batch + 30 * i + 40], "code",
                            max_new_tokens=8) for i in range(10)]
        assert all(len(out["output_ids"]) == 8 for out in send_all(host_server, payloads))
    flush_and_check()
