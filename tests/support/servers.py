"""Real SGLang servers for the tests, shared by every module that asks for the same arguments.

A server costs about 30 s to start on these machines (SGLang's imports, in each of its three
processes) and up to about 5 GB of memory with the demo model. Modules therefore ask the
session's `ServerPool` for a server by its `ServerSpec` (model, arguments, pool size,
environment): the first module starts it, later ones with the same spec get it running. The
pool keeps the servers' measured memory within a budget; when another server is needed it stops
the one least recently used that no test holds. Servers are always stopped by PID, at the
latest at the end of the session.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from vericache_sglang.config import VeriCacheConfig, attach_config
from vericache_tools.server_args import server_args
from vericache_tools.server_process import ServerProcess

log = logging.getLogger(__name__)

SERVER_ARGS = server_args(max_running_requests=16, metrics=True, custom_logit_processor=True,
                          warmup=False)
"""Arguments every test server of the demo model shares, so that a VeriCache server and the
plain one differ only by the VeriCache flags: sixteen requests may run at once (VeriCache
reserves the device's drafting windows for that many), requests may bring a custom logit
processor, /metrics is served, and there is no warm-up request (the tests' first requests are
theirs)."""

PLAIN_ARGS = [*SERVER_ARGS, "--disable-overlap-schedule"]
"""Plain SGLang as VeriCache runs it: VeriCache implies --disable-overlap-schedule, and SGLang's
overlap scheduler prepares step n+1 before it records step n's token, so its penalties count
the output one token late (greedy output under penalties differs with and without it).
test_identity.py checks that plain SGLang's default, overlap on, gives VeriCache's tokens for
requests without penalties."""

FULL_KV_BYTES_PER_TOKEN = 46080
"""The demo model's float32 KV per token: 30 layers x 3 KV heads x 64 x 2 (K, V) x 4 bytes."""

HOST_BUDGET = str(32768 * FULL_KV_BYTES_PER_TOKEN)
"""The session's VeriCache server keeps the full KV of as many tokens in host memory as plain
SGLang's pool holds (--max-total-tokens 32768), so two servers take the same memory on CPU."""

FIXED_DRAFT_LENGTH = ["--vericache-draft-length", "16", "--vericache-min-draft-length", "16",
                      "--vericache-max-draft-length", "16"]
"""Every round drafts 16 tokens, for the tests that count a round's drafts and rounds (the
cost-based draft length takes plain steps where drafting does not pay on this CPU; it runs on
the servers at every default)."""

VERICACHE_HOST_ARGS = [*SERVER_ARGS, "--enable-vericache", "--vericache-compressor", "kivi:bits=4",
                       *FIXED_DRAFT_LENGTH, "--vericache-full-tier", "host",
                       "--vericache-full-tier-budget", HOST_BUDGET]
"""The session's VeriCache server: 4-bit KIVI, every round drafting 16 tokens, the n-gram
drafter (VeriCache's default without a draft model), the full KV in host memory."""


VARIANT_CONTEXT = 1024
VARIANT_ARGS = [*SERVER_ARGS, "--context-length", str(VARIANT_CONTEXT),
                "--grammar-backend", "llguidance"]
"""One plain SGLang / VeriCache pair serves two modules' settings, a server start saved: a
context of 1,024 tokens (test_context_boundary.py: requests ending at it) and the llguidance
grammar backend (test_grammar_backends.py: a chat request of about 900 tokens under a grammar).
Neither setting changes what the other module asks: its requests are unconstrained, or end
well inside the context."""
VARIANT_VERICACHE_ARGS = [*VARIANT_ARGS, "--enable-vericache", "--vericache-compressor",
                          "kivi:bits=4", "--vericache-draft-length", "64",
                          "--vericache-min-draft-length", "64", "--vericache-max-draft-length",
                          "64"]
"""VeriCache beside it: every round drafts 64 tokens (the default bound's widest), so every
decode step near the context reserves the widest verify width, and every constrained request
drafts under its grammar."""


@dataclass(frozen=True)
class ServerSpec:
    """What makes two servers interchangeable: the same model, arguments, pool and environment."""

    model: Path
    args: tuple[str, ...]
    max_total_tokens: int = 32768
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, model: Path, args: list[str], max_total_tokens: int = 32768,
           env: dict[str, str] | None = None) -> ServerSpec:
        return cls(Path(model), tuple(args), max_total_tokens, tuple(sorted((env or {}).items())))

    def process(self) -> ServerProcess:
        return ServerProcess(self.model, list(self.args), max_total_tokens=self.max_total_tokens,
                             env=dict(self.env))


def variant_specs(model: Path) -> tuple[ServerSpec, ServerSpec]:
    """The plain and VeriCache servers of `VARIANT_ARGS`, in that order."""
    return (ServerSpec.of(model, VARIANT_ARGS, max_total_tokens=8192),
            ServerSpec.of(model, VARIANT_VERICACHE_ARGS, max_total_tokens=8192))


NEW_SERVER_BYTES = 5 << 30
"""What a server not started yet is assumed to take (the demo model's, measured: about 5 GB)."""


def memory_budget() -> int:
    """Half the machine's memory for pooled servers (12 GB on the 24 GB CI machines): the rest
    is for the servers and Engines tests start themselves, the stores and the test process."""
    import psutil

    return psutil.virtual_memory().total // 2


def _try_start(server: ServerProcess) -> BaseException | None:
    try:
        server.start()
    except BaseException as error:  # reported after every start has ended
        return error
    return None


def start_side_by_side(servers: list[ServerProcess]) -> list[ServerProcess]:
    """Start `servers` at once; if one fails, stop them all and raise its error. Two starts
    side by side cost less than two in turn, while nothing else runs (measured here: one
    tiny-model server 25 s, two at once 33 s, four 75 s)."""
    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        outcomes = list(pool.map(_try_start, servers))
    failed = [error for error in outcomes if error is not None]
    if failed:
        for server in servers:
            server.stop()
        raise failed[0]
    return servers


@contextmanager
def side_by_side(*servers: ServerProcess) -> Iterator[list[ServerProcess]]:
    """Servers a module starts for itself, at once, all stopped (by PID) when the block ends;
    one may be stopped earlier, once it has answered."""
    try:
        yield start_side_by_side(list(servers))
    finally:
        for server in servers:
            server.stop()


@dataclass
class _Entry:
    server: ServerProcess
    rss: int
    holders: int = 0


@dataclass
class ServerPool:
    """Running servers by spec, within `budget` bytes of measured memory unless more are held
    at once."""

    budget: int = field(default_factory=memory_budget)
    _entries: OrderedDict[ServerSpec, _Entry] = field(default_factory=OrderedDict)

    @contextmanager
    def hold(self, *specs: ServerSpec) -> Iterator[list[ServerProcess]]:
        """The servers of `specs`, started side by side where not running yet, and kept up
        (never stopped to make room) until the block ends."""
        missing = list(dict.fromkeys(s for s in specs if s not in self._entries))
        self.make_room(len(missing), keep=frozenset(specs))
        started = {spec: spec.process() for spec in missing}
        start_side_by_side(list(started.values()))
        for spec, server in started.items():
            self._entries[spec] = _Entry(server, server.rss_bytes())
        entries = [self._entries[spec] for spec in specs]
        for spec, entry in zip(specs, entries, strict=True):
            entry.holders += 1
            self._entries.move_to_end(spec)
        try:
            yield [entry.server for entry in entries]
        finally:
            for entry in entries:
                entry.holders -= 1

    def make_room(self, needed: int = 1, keep: frozenset[ServerSpec] = frozenset()) -> None:
        """Stop idle servers, least recently used first, until `needed` more servers fit the
        budget: what a test that starts a server or an Engine of its own calls first."""
        for spec in list(self._entries):
            used = sum(entry.rss for entry in self._entries.values())
            if used + needed * NEW_SERVER_BYTES <= self.budget:
                return
            entry = self._entries[spec]
            if entry.holders == 0 and spec not in keep:
                log.info("stopping a pooled server to make room: %s", spec.args)
                entry.server.stop()
                del self._entries[spec]

    def stop_idle(self) -> None:
        """Stop every server no test holds."""
        for spec, entry in list(self._entries.items()):
            if entry.holders == 0:
                entry.server.stop()
                del self._entries[spec]

    def stop_all(self) -> None:
        for entry in self._entries.values():
            entry.server.stop()
        self._entries.clear()


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
