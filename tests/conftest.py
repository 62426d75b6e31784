"""Shared fixtures: the demo model, real SGLang servers (from the session's pool, shared by
every module asking for the same arguments and always stopped by PID: tests/support/servers.py),
HF transformers as the float32 reference, and a real Mooncake store."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.support.servers import (  # noqa: E402
    PLAIN_ARGS,
    VERICACHE_HOST_ARGS,
    ServerPool,
    ServerSpec,
)
from vericache_sglang import models  # noqa: E402
from vericache_tools.forked_launch import ForkedLauncher  # noqa: E402
from vericache_tools.mooncake_service import (  # noqa: E402
    MooncakeService,
    mooncake_unavailable_reason,
)
from vericache_tools.prompts import stdlib_ids  # noqa: E402
from vericache_tools.server_process import ServerProcess  # noqa: E402


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

    from vericache_tools import hf_eval

    model, tokenizer = hf_eval.load_model(demo_model)
    layers = hf_eval.prefill(model, stdlib_ids(tokenizer, "textwrap", 512), total_scores=False)
    return (torch.stack([layer.keys for layer in layers]),
            torch.stack([layer.values for layer in layers]))


@pytest.fixture(scope="session", autouse=True)
def forked_launcher() -> Iterator[ForkedLauncher]:
    """Servers of the session's environment start from a process that has imported SGLang's
    launcher, scheduler and detokenizer (`vericache_tools/forked_launch.py`): a tiny-model
    server answers 5 s after its start here, against 22-25 s from a shell, of some fifty
    starts a run."""
    launcher = ForkedLauncher()
    ServerProcess.forked_launcher = launcher
    try:
        yield launcher
    finally:
        ServerProcess.forked_launcher = None
        launcher.stop()


@pytest.fixture(scope="session")
def server_pool() -> Iterator[ServerPool]:
    """The session's servers, shared by every module asking for the same spec, all stopped by
    PID at the end (tests/support/servers.py)."""
    pool = ServerPool()
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="module")
def servers(server_pool: ServerPool):
    """Hold pooled servers for a module: `servers(spec, ...)` starts what is not running (side
    by side) and keeps them up until the module ends."""
    with ExitStack() as held:
        yield lambda *specs: held.enter_context(server_pool.hold(*specs))


@pytest.fixture(scope="module")
def no_idle_servers(server_pool: ServerPool) -> None:
    """For modules that start servers or Engines of their own (stopped within the module, or
    killed on purpose), and for SGLang's hierarchical cache, which keeps 10 GiB of host memory
    free: the pool's idle servers stop first."""
    server_pool.stop_idle()


def _order(item: pytest.Item) -> int:
    """Tests without servers first; then the modules with servers of their own; then those on
    the session's VeriCache server, then those on its plain server only, so each of the two
    starts once."""
    if item.get_closest_marker("server") is None:
        return 0
    fixtures = set(getattr(item, "fixturenames", ()))
    return 2 if "vericache_server" in fixtures else 3 if "plain_server" in fixtures else 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules that start servers run last, each module whole and in its usual order (a module
    sorts by its first test). A server takes up to 5 GB on CPU: this way they never run beside
    the Engine, launcher and HF tests of the other modules, and the pool keeps what runs within
    its memory budget (24 GB machines)."""
    # Modules that share a pooled pair run next to each other (at the first one's place), or
    # another module's servers would push the idle pair out of the pool in between.
    anchor, rank = {}, {}
    for item in items:
        group = getattr(item.module, "SHARES_SERVERS_WITH", item.module.__name__)
        rank.setdefault(item.module, (_order(item), anchor.setdefault(group, len(anchor))))
    items.sort(key=lambda item: rank[item.module])


@pytest.fixture(scope="session")
def plain_server(demo_model: Path, server_pool: ServerPool) -> Iterator[ServerProcess]:
    """Plain SGLang, float32: the reference every VeriCache output must equal. Held from its
    first use to the end of the session (its modules run last), so its answers stay valid for
    the session's remembered references (`tests/speculative/conftest.py`, `plain`)."""
    with server_pool.hold(ServerSpec.of(demo_model, PLAIN_ARGS)) as (server,):
        yield server


@pytest.fixture(scope="module")
def vericache_server(demo_model: Path, server_pool: ServerPool) -> Iterator[ServerProcess]:
    """The demo model served in float32 with VeriCache (`VERICACHE_HOST_ARGS`: 4-bit KIVI,
    16 drafts a round, the full KV in host memory), held by each module that asks. Those
    modules run one after another (`_order`), and the pool keeps it up between them; once
    they are done it is idle, and a later module that needs the memory stops it (SGLang's
    hierarchical cache sizes its host pool by the memory left: the disk tier's)."""
    with server_pool.hold(ServerSpec.of(demo_model, VERICACHE_HOST_ARGS)) as (server,):
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
