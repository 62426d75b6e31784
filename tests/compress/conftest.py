"""Real KV for the compressor tests: the demo model, in float32, run once over a stdlib source.

Session-scoped and in memory only. `demo_model` comes from tests/conftest.py (the prepared
SmolLM2-135M-Instruct directory).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vericache_tools import hf_eval
from vericache_tools.prompts import stdlib_ids

REAL_TOKENS = 640
REAL_LAYERS = (0, 14, 29)


@dataclass
class RealKV:
    """A few layers of real prompt K/V with queries and scores, plus the model's attention scale."""

    layers: dict[int, hf_eval.LayerKV]
    scaling: float
    num_q_heads: int


@pytest.fixture(scope="session")
def real_kv(demo_model: Path) -> RealKV:
    torch.manual_seed(0)
    model, tokenizer = hf_eval.load_model(demo_model)
    ids = stdlib_ids(tokenizer, "textwrap", REAL_TOKENS)
    layers = hf_eval.prefill(model, ids, total_scores=False, keep_queries=True)
    config = model.config
    return RealKV(
        {i: layers[i] for i in REAL_LAYERS},
        config.head_dim**-0.5,
        config.num_attention_heads,
    )
