"""Plain SGLang's hierarchical cache (`--enable-hierarchical-cache`, its default io backend
and host layout) runs on a machine without a GPU: a prefix evicted from the device pool is
served from host memory, through the torch transfer ops of the sgl_kernel stand-in, with the
output the same server computed from scratch the first time (no prefix cached: SGLang's own
prefill, HiCache only backing it up).

HiCache keeps 10 GiB of host memory free (`HICACHE_HOST_MEMORY_RESERVE_BYTES`), so the pool's
idle servers stop before this module starts its server (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.support.servers import SERVER_ARGS, ServerSpec
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.timeout(900),
              pytest.mark.usefixtures("no_idle_servers")]

DEVICE_TOKENS = 3072
MODULES = ["textwrap", "argparse", "difflib", "inspect"]


@pytest.fixture(scope="module")
def hicache_server(demo_model: Path, servers) -> ServerProcess:
    return servers(ServerSpec.of(demo_model, [*SERVER_ARGS, "--enable-hierarchical-cache",
                                              "--hicache-ratio", "2"],
                                 max_total_tokens=DEVICE_TOKENS))[0]


def _request(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 16,
                                                  "ignore_eos": True}}


def test_a_prefix_evicted_to_host_memory_is_reused(hicache_server, demo_model):
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    prompts = [stdlib_ids(tokenizer, module, 1000, start=200) for module in MODULES]
    # One after another, so that the device pool (3,072 tokens) evicts the first prompt's KV.
    assert sum(len(ids) + 16 for ids in prompts) > DEVICE_TOKENS
    first = [hicache_server.generate(_request(ids)) for ids in prompts]
    assert first[0]["meta_info"]["cached_tokens"] == 0
    again = hicache_server.generate(_request(prompts[0]))
    assert again["output_ids"] == first[0]["output_ids"]
    details = again["meta_info"]["cached_tokens_details"]
    assert details["host"] >= 900 and details["device"] == 0
