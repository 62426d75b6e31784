"""A draft model as level 2 is lossless: a small causal LM with its own KV proposes, the target
over the compressed tier checks, the full KV verifies; the output equals plain SGLang's token
for token, even when the draft model proposes garbage (the target's first 4 layers under its
head, which agree with the target's next token on about 1% of positions).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from tests.conftest import SERVER_ARGS
from tests.speculative.identity import (
    assert_batch_identical,
    levels,
    payload,
    send_all,
    stream_chunks,
)
from vericache_sglang.server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]


def _weight_bytes(model_dir: Path) -> tuple[int, int]:
    """(float32 bytes of the embedding, float32 bytes of every other weight) of a model
    directory, from its safetensors file."""
    embedding = other = 0
    with safe_open(model_dir / "model.safetensors", "pt") as weights:
        for name in weights.keys():  # noqa: SIM118 (safe_open has no __iter__)
            shape = weights.get_slice(name).get_shape()
            count = 4
            for size in shape:
                count *= size
            if "embed_tokens" in name:
                embedding += count
            else:
                other += count
    return embedding, other


def test_an_untrained_draft_model_costs_speed_not_output(demo_models, plain, prompt_ids):
    """The 4-layer truncation proposes up to 3 tokens; two requests at once (32 tokens each:
    its proposals make every round slow), a stop string and a streamed request: plain
    SGLang's tokens. Its proposals were checked and nearly all rejected. The server reports
    the draft model's device bytes, measured from its tensors: its layers, not the embedding
    it reads from the target."""
    names = ["heapq_400", "chat_fnmatch"]
    with ServerProcess(demo_models.target, [
        *SERVER_ARGS, "--enable-vericache", "--vericache-draft-model", str(demo_models.draft),
        "--vericache-drafter-max-length", "3",
    ]) as server:
        got = assert_batch_identical(server, plain, {name: prompt_ids[name] for name in names},
                                     "kivi:bits=4 + 4-layer truncation", max_new_tokens=32)
        proposed = sum(levels(out)[1] for out in got)
        kept = sum(levels(out)[2] for out in got)
        print(f"  level 2: {kept}/{proposed} proposals kept")
        assert 0 <= kept < proposed / 2

        stopped = payload(prompt_ids["bisect_300"], "code", max_new_tokens=64, stop=["return"])
        streamed = payload(prompt_ids["csv_700"], "code", max_new_tokens=32)
        chunks = stream_chunks(server, streamed)
        assert chunks[-1]["output_ids"] == plain(streamed)["output_ids"]
        assert send_all(server, [stopped])[0]["output_ids"] == plain(stopped)["output_ids"]

        state = server.server_info()["internal_states"][0]["vericache_state"]
        assert state["totals"]["drafter_proposed"] > 0
    embedding, layers = _weight_bytes(demo_models.draft)
    assert layers <= state["drafter_device_bytes"] < layers + embedding // 100
