"""Real KV for the codec tests: the demo model in float32 over 512 tokens of a stdlib source,
every layer, as [L, n, H, D] (session-scoped, in memory only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import hf_eval
from vericache_sglang.prompts import stdlib_ids

TOKENS = 512


@pytest.fixture(scope="session")
def model_kv(demo_model: Path) -> tuple[torch.Tensor, torch.Tensor]:
    model, tokenizer = hf_eval.load_model(demo_model)
    layers = hf_eval.prefill(model, stdlib_ids(tokenizer, "textwrap", TOKENS),
                             total_scores=False)
    return (torch.stack([layer.keys for layer in layers]),
            torch.stack([layer.values for layer in layers]))
