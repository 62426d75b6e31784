"""Every model family SGLang users serve: VeriCache's tokens equal plain SGLang's (a family it
cannot serve exactly is refused at startup with one line: tests/test_cli.py).

Each family is a tiny seeded random-weight model (`tests/support/families.py`) carrying its
attention features (sliding windows of 128 tokens, Gemma 2's softcapping, experts). Plain SGLang
and VeriCache (every default but a fixed draft length of 16, so that every round drafts over
the family's attention: the cost-based length takes plain steps where a random model's drafts
are rejected) serve it side by side in float32; three greedy requests of 640-token
real prompts (crossing the windows and many KIVI groups) run together for 48 tokens, and the
outputs must be equal token for token. Where plain SGLang needs the CPU support's fixes to run
a family as the model defines it (softcapping in torch_native, Qwen2-MoE's shared-expert
gate), plain SGLang's tokens are also checked against HF transformers' greedy decoding, so the
reference is the model itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.families import FAMILIES, build
from tests.support.identity import send_all, stats
from tests.support.servers import FIXED_DRAFT_LENGTH, ServerSpec
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_args import server_args

pytestmark = pytest.mark.server

ARGS = server_args(chunked_prefill_size=None, max_running_requests=4, overlap=False,
                   warmup=False)
NEW_TOKENS = 48
SOURCES = (("textwrap", 0), ("argparse", 3000), ("difflib", 1000))
PROMPT_TOKENS = 640

FEATURE_WORDS = {"sliding window": "with a sliding window", "softcapping": "with logit softcapping"}
"""A family's attention features -> the words VeriCache's startup line uses for them."""
SERVED = [name for name in FAMILIES if name not in ("llama", "deepseek-v2")]
"""The demo model is a Llama, which every other server test serves; DeepSeek's MLA is refused
at startup (tests/test_cli.py)."""
CHECKED_AGAINST_HF = {"gemma2", "gemma3", "qwen2-moe"}
"""Families whose plain-SGLang reference rests on the CPU support (softcapping, the MoE gate)
or on sliding windows: their plain tokens are checked against HF transformers too."""


@pytest.fixture(scope="module")
def prompts(demo_model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    return [stdlib_ids(tokenizer, module, PROMPT_TOKENS, start=start)
            for module, start in SOURCES]


def _payload(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}


def _hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    # Eager attention: transformers' SDPA path drops Gemma 2's softcapping.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
                for ids in prompts]


def _config(path: Path) -> dict:
    import json

    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("name", SERVED)
def test_family_identical_to_plain_sglang(name: str, demo_model: Path, prompts, server_pool):
    path = build(name, demo_model)
    payloads = [_payload(ids) for ids in prompts]
    # Started side by side, asked one after the other (each server's forwards use both cores);
    # the pool stops them when the next family's servers need the room.
    with server_pool.hold(ServerSpec.of(path, ARGS, max_total_tokens=8192),
                          ServerSpec.of(path, [*ARGS, "--enable-vericache", *FIXED_DRAFT_LENGTH],
                                        max_total_tokens=8192)) as (plain, vericache):
        want = send_all(plain, payloads)
        got = send_all(vericache, payloads)
        memory = vericache.server_info()["vericache"]["memory"]
    for i, (out, ref) in enumerate(zip(got, want, strict=True)):
        assert out["output_ids"] == ref["output_ids"], f"{name}: prompt {i} differs"
        # A model that repeats one token compares nothing.
        assert len(set(ref["output_ids"])) >= 8, f"{name}: degenerate output"
    rounds, drafted, accepted = (sum(c) for c in zip(*map(stats, got), strict=True))
    assert rounds > 0 and accepted > 0, f"{name}: nothing was drafted and kept"
    # The layers carry the family's features, as VeriCache's startup line reads them.
    line = next(line for line in vericache.log_path.read_text().splitlines()
                if "VeriCache attention:" in line)
    for feature, words in FEATURE_WORDS.items():
        assert (words in line) == (feature in FAMILIES[name].features), (name, line)
    windowed = memory["compressed_pool_windowed_layers"]
    assert bool(windowed) == ("sliding window" in FAMILIES[name].features)
    # Bytes per token, measured from the pools' tensors: the full KV as the geometry says (K
    # and V of every layer, float32), compressed pages for the layers without a window only.
    config = _config(path)
    layers = config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    full = memory["full_kv_bytes_per_token"]
    assert full == pytest.approx(2 * layers * config["num_key_value_heads"] * head_dim * 4,
                                 rel=1e-3)
    assert memory["compressed_bytes_per_token"] < full / 3 * (layers - len(windowed)) / layers
    print(f"\n[{name}] {rounds} rounds, {accepted}/{drafted} drafts kept; bytes per token: "
          f"full {full:.0f}, compressed {memory['compressed_bytes_per_token']:.0f}")
    if name in CHECKED_AGAINST_HF:
        assert [ref["output_ids"] for ref in want] == _hf_greedy(path, prompts), (
            f"{name}: plain SGLang's reference is not the model's own greedy output")
