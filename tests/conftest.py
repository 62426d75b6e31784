"""Shared fixtures: the demo model, real SGLang servers (one per configuration, shared by the
whole session and always stopped by PID), HF transformers as the float32 reference, and real
long prompts from the Python standard library (vericache_sglang.prompts)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from vericache_sglang import models  # noqa: E402
from vericache_sglang.config import VeriCacheConfig, attach_config  # noqa: E402
from vericache_sglang.prompts import stdlib_ids, stdlib_source  # noqa: E402, F401 (tests import it here)
from vericache_sglang.server_process import ServerProcess  # noqa: E402
from vericache_sglang.stores.mooncake_service import (  # noqa: E402
    MooncakeService,
    mooncake_unavailable_reason,
)


@pytest.fixture(scope="session")
def demo_models() -> models.PreparedModels:
    return models.prepare()


@pytest.fixture(scope="session")
def demo_model(demo_models: models.PreparedModels) -> Path:
    return demo_models.target


@pytest.fixture(scope="session")
def model_kv(demo_model: Path):
    """Real KV for the codec and store tests: the demo model in float32 over 512 tokens of a
    stdlib source, every layer, as [L, n, H, D] keys and values (in memory only)."""
    import torch

    from bench import hf_eval

    model, tokenizer = hf_eval.load_model(demo_model)
    layers = hf_eval.prefill(model, stdlib_ids(tokenizer, "textwrap", 512), total_scores=False)
    return (torch.stack([layer.keys for layer in layers]),
            torch.stack([layer.values for layer in layers]))


# Arguments every test server shares, so that a VeriCache server and the plain one differ only
# by the VeriCache flags. Prompts over 2,048 tokens are prefilled in chunks; sampling is seeded
# so that a sampling test's outcome is reproducible; sixteen requests may run at once (VeriCache
# reserves the device's drafting windows for that many); requests may bring a custom logit
# processor; no warm-up request (3 s of every start; the tests' first requests are theirs).
SERVER_ARGS = ["--dtype", "float32", "--chunked-prefill-size", "2048", "--enable-metrics",
               "--random-seed", "0", "--max-running-requests", "16",
               "--enable-custom-logit-processor", "--skip-server-warmup"]

FULL_KV_BYTES_PER_TOKEN = 46080
"""The demo model's float32 KV per token: 30 layers x 3 KV heads x 64 x 2 (K, V) x 4 bytes."""

HOST_BUDGET = str(32768 * FULL_KV_BYTES_PER_TOKEN)
"""The session's VeriCache server keeps the full KV of as many tokens in host memory as plain
SGLang's pool holds (--max-total-tokens 32768), so two servers take the same memory on CPU."""


def vericache_server_args(settings: dict | None = None, **given) -> SimpleNamespace:
    """The ServerArgs fields `algorithm.configure` reads, at SGLang's defaults unless given,
    with VeriCache enabled and `settings` attached, for testing startup without a launch."""
    args = SimpleNamespace(**{
        "speculative_algorithm": None, "speculative_num_draft_tokens": None,
        "speculative_num_steps": None, "speculative_eagle_topk": None,
        "enable_mixed_chunk": False, "kv_cache_dtype": "auto", "grammar_backend": "xgrammar",
        "disable_overlap_schedule": False, "context_length": None, "decode_log_interval": 40,
        "sampling_backend": None, "model_path": "unused", "tokenizer_path": None,
        "tp_size": 1, "pp_size": 1, **given})
    attach_config(args, VeriCacheConfig.build({"enable_vericache": True, **(settings or {})}))
    return args


SESSION_SERVERS = {"plain_server", "vericache_server"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules whose tests use the session's servers run last, each module whole and in its
    usual order. A server takes about 5 GB on CPU: this way they never run beside the Engine,
    launcher and HF tests, a module's own server is stopped before the next module starts, and
    three servers at most are up at once (24 GB machines)."""
    late = {item.module for item in items
            if SESSION_SERVERS & set(getattr(item, "fixturenames", ()))}
    items.sort(key=lambda item: item.module in late)


PLAIN_ARGS = [*SERVER_ARGS, "--disable-overlap-schedule"]
"""Plain SGLang as VeriCache runs it: VeriCache implies --disable-overlap-schedule, and SGLang's
overlap scheduler prepares step n+1 before it records step n's token, so its penalties count
the output one token late (greedy output under penalties differs with and without it).
test_identity.py checks that plain SGLang's default, overlap on, gives VeriCache's tokens for
requests without penalties."""


@pytest.fixture(scope="session")
def plain_server(demo_model: Path) -> Iterator[ServerProcess]:
    """Plain SGLang, float32: the reference every VeriCache output must equal."""
    with ServerProcess(demo_model, PLAIN_ARGS) as server:
        yield server


@pytest.fixture(scope="session")
def vericache_server(demo_model: Path) -> Iterator[ServerProcess]:
    """The demo model served in float32 with VeriCache: 4-bit KIVI, draft length adapting
    from 16, the full KV in host memory (servers of other modules mostly run the default,
    which on a CPU is the device placement)."""
    server = ServerProcess(demo_model, [
        *SERVER_ARGS,
        "--enable-vericache",
        "--vericache-compressor", "kivi:bits=4",
        "--vericache-draft-length", "16",
        "--vericache-full-tier", "host",
        "--vericache-full-tier-budget", HOST_BUDGET,
    ])
    with server:
        yield server


@pytest.fixture(scope="session")
def mooncake_store() -> Iterator[MooncakeService]:
    """One Mooncake store on 127.0.0.1 for the whole run (1 GiB segment), stopped at the end;
    skips, saying why, where Mooncake cannot run. Tests that need a store of their own (one
    that fills up, or to kill) start a MooncakeService themselves."""
    reason = mooncake_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with MooncakeService() as store:
        yield store


@pytest.fixture(scope="session")
def hf_reference(demo_model: Path):
    """Greedy decoding with HF transformers in float32: the ground truth for identity tests."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()

    def greedy(input_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=tokenizer.eos_token_id,
            )
        return out[0, len(input_ids):].tolist()

    greedy.tokenizer = tokenizer
    return greedy
