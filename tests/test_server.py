"""A real SGLang server with `--enable-vericache` serves the demo model, and its greedy output
equals HF transformers' token for token, in float32 on both sides."""

from __future__ import annotations

import pytest
import requests

from tests.support.servers import HOST_BUDGET
from vericache_tools.prompts import stdlib_source

pytestmark = pytest.mark.server

SHORT_PROMPTS = [
    "def fibonacci(n):",
    "The three primary colors are",
    "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the command line and",
]


def _server_greedy(server, input_ids: list[int], max_new_tokens: int) -> list[int]:
    out = server.generate({
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                            "ignore_eos": True},
    })
    return out["output_ids"]


@pytest.mark.parametrize("prompt", SHORT_PROMPTS)
def test_generate_matches_hf_greedy(vericache_server, hf_reference, prompt):
    ids = hf_reference.tokenizer(prompt)["input_ids"]
    assert _server_greedy(vericache_server, ids, 48) == hf_reference(ids, 48)


def test_long_stdlib_prompt_matches_hf_greedy(vericache_server, hf_reference):
    """2,000+ tokens of a standard-library module, continued by both."""
    tokenizer = hf_reference.tokenizer
    ids = tokenizer(stdlib_source("textwrap"))["input_ids"][:2300]
    assert len(ids) >= 2000
    assert _server_greedy(vericache_server, ids, 32) == hf_reference(ids, 32)


def test_generate_text_endpoint(vericache_server, hf_reference):
    """The plain text form of /generate answers with the same tokens as input_ids do."""
    prompt = SHORT_PROMPTS[0]
    out = vericache_server.generate({
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
    })
    ids = hf_reference.tokenizer(prompt)["input_ids"]
    assert out["output_ids"] == hf_reference(ids, 24)
    assert out["meta_info"]["prompt_tokens"] == len(ids)


def test_chat_completions_match_hf_greedy(vericache_server, hf_reference):
    tokenizer = hf_reference.tokenizer
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    r = requests.post(f"{vericache_server.url}/v1/chat/completions", json={
        "model": "default", "messages": messages, "temperature": 0, "max_tokens": 40,
    }, timeout=300)
    r.raise_for_status()
    answer = r.json()["choices"][0]["message"]["content"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    expected = hf_reference(list(ids), 40)
    if tokenizer.eos_token_id in expected:  # the server stops at end-of-sequence
        expected = expected[: expected.index(tokenizer.eos_token_id)]
    assert answer == tokenizer.decode(expected, skip_special_tokens=True)


def test_server_info_reports_vericache_settings(vericache_server):
    server_info = vericache_server.server_info()
    info = server_info["vericache"]
    memory = info.pop("memory")
    # Measured in the scheduler from the pools' storages: the full KV pool (host memory) holds
    # what SGLang reports, and 4-bit pages take under a fifth of float32 KV per token.
    assert memory["full_tier"] == "host"
    assert memory["verify_backend"] == "StagedFullKVAttnBackend"  # the host tier's staging
    assert memory["full_kv_pool_tokens"] == server_info["max_total_num_tokens"]
    assert memory["full_kv_pool_bytes"] <= int(HOST_BUDGET) * 1.001
    assert memory["compressed_page_tokens"] == 32
    assert 0 < memory["compressed_bytes_per_token"] < 0.2 * memory["full_kv_bytes_per_token"]
    # The device holds the compressed pool, the staging area and the drafting windows within
    # the bytes --max-total-tokens gives plain SGLang's KV pool.
    device_budget = 32768 * memory["full_kv_bytes_per_token"]
    assert memory["device_budget_bytes"] == device_budget
    assert (memory["compressed_pool_bytes"] + memory["staging_bytes"]
            + memory["window_reserve_bytes"]) <= device_budget
    compressor = info.pop("vericache_compressor")
    assert compressor.startswith("kivi:") and "bits=4" in compressor.split(":")[1].split(",")
    assert info == {
        "enable_vericache": True,
        "vericache_draft_length": 16,  # every round (FIXED_DRAFT_LENGTH)
        "vericache_min_draft_length": 16,
        "vericache_max_draft_length": 16,
        "vericache_drafter": "ngram",  # auto, without a draft model
        "vericache_draft_model": None,
        "vericache_drafter_min_length": 1,
        "vericache_drafter_max_length": 8,
        "vericache_full_tier": "host",
        "vericache_full_tier_budget": int(HOST_BUDGET),
        "vericache_disk_dir": None,
        "vericache_staging_budget": None,
        "vericache_store_reads": "always",
        "vericache_store_codec_processes": 0,  # one per core, at most 4
        "vericache_store_timeout": 30.0,
        "vericache_early_drafting": False,
        "vericache_drafting_deadline": 1.0,
    }
