"""A store that could not be reached when the server started: serve misses, retry, reconnect.

SGLang builds its storage backend once, when HiCache attaches storage, and a backend whose
constructor raises (Mooncake's master or metadata server down) stops the server. On a VeriCache
server a store is a cache, not a dependency: `ReconnectingStore` stands in for the backend,
answers every lookup with a miss (the prefix is recomputed, with the same output), refuses every
write, counts each call as an `unavailable` fault (`/metrics`, `/server_info`), and tries to
build the real backend again at most every `VERICACHE_STORE_RETRY_SECONDS` (default 30 s), in a
thread of its own: a store client may retry for a long time (Mooncake's setup tries 20 times,
about 90 s) and SGLang's prefetch and backup threads must not wait for it. Each attempt first
asks whether the store answers at all (`reachable`, a quick probe); each that fails is logged at
WARNING and counted (the server's `ReconnectStats`, `vericache:store_reconnect_failures`).
Once built, the host pools SGLang registered are handed to the backend and every call goes to
it.

Only an outage is retried. A build that fails while the store answers, with an error that is
not one a client raises for a store it cannot reach or set up (`OUTAGES`), is a configuration
the client refuses or a bug, which no retry mends: at startup the server stops with one line
naming the store and the cause; on a later attempt it is logged at ERROR and the attempts end.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult

from vericache_sglang import startup

if TYPE_CHECKING:
    from .state import StoreState

logger = logging.getLogger(__name__)

RETRY_ENV = "VERICACHE_STORE_RETRY_SECONDS"
DEFAULT_RETRY_SECONDS = 30.0

OUTAGES = (ConnectionError, TimeoutError, RuntimeError)
"""What a store client raises when it cannot reach or set up the store. Mooncake's constructor
raises `RuntimeError` when its `setup` returns an error code (the master or the metadata server
not answering: "Failed to setup Mooncake store, error code: -1") or its warmup put fails (no
segment takes it). Any other exception (`ValueError`, `TypeError`, `KeyError`, `ImportError`,
...) is the server's own unless the store stopped answering its probe meanwhile."""
NOT_OUTAGES = (NotImplementedError, RecursionError)
"""Runtime errors of code, never of a store."""


class StoreUnusable(Exception):
    """A store's backend cannot be built while the store answers; the message is one line that
    names the store and the cause."""


def retry_seconds() -> float:
    """How long a server waits between attempts to reach an unreachable store."""
    value = os.environ.get(RETRY_ENV, "")
    try:
        seconds = float(value) if value else DEFAULT_RETRY_SECONDS
    except ValueError:
        raise ValueError(f"{RETRY_ENV} must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise ValueError(f"{RETRY_ENV} must be positive, got {value!r}")
    return seconds


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _attempt(name: str, build: Callable[[], HiCacheStorage],
             reachable: Callable[[], str | None]) -> tuple[HiCacheStorage | None, str]:
    """Probe, then build: the backend, or None and why the store cannot be reached. Raises
    `StoreUnusable` when the build fails and neither the error nor the probe says outage."""
    why = reachable()
    if why is not None:
        return None, why
    try:
        return build(), ""
    except Exception as error:  # noqa: BLE001 - sorted below: an outage, or the server's own
        if isinstance(error, OUTAGES) and not isinstance(error, NOT_OUTAGES):
            return None, _one_line(error)
        why = reachable()
        if why is None:
            raise StoreUnusable(f"the {name} store (--hicache-storage-backend {name}) cannot "
                                f"be used: {_one_line(error)}") from error
        return None, f"{why} ({_one_line(error)})"


def build_or_reconnect(name: str, build: Callable[[], HiCacheStorage],
                       reachable: Callable[[], str | None], state: StoreState) -> HiCacheStorage:
    """`build()`, or a `ReconnectingStore` retrying it when the store cannot be reached,
    counting in the server's `state`. `reachable()` is a quick probe: None when the store
    answers, else why not. Runs in the scheduler while it starts: a build that no retry mends
    stops the server with one line."""
    try:
        backend, why = _attempt(name, build, reachable)
    except StoreUnusable as error:
        raise startup.scheduler_error(str(error)) from None
    return (backend if backend is not None
            else ReconnectingStore(name, build, reachable, why, state))


class ReconnectingStore(HiCacheStorage):
    """The backend SGLang talks to while the store is unreachable (see the module docstring)."""

    def __init__(self, name: str, build: Callable[[], HiCacheStorage],
                 reachable: Callable[[], str | None], why: str, state: StoreState) -> None:
        self.name = name
        self.state = state
        """The server's store state: its faults and reconnect attempts are counted there."""
        self._build = build
        self._reachable = reachable
        self._interval = retry_seconds()
        self._lock = threading.Lock()
        self._backend: HiCacheStorage | None = None
        self._attempt: threading.Thread | None = None
        self._unusable = False
        """Set when an attempt built nothing while the store answered: no retry mends it."""
        self._last_try = time.monotonic()
        self._pools: list[tuple[str | None, Any]] = []
        self._pools_done = False
        logger.error("VeriCache: the %s store cannot be reached (%s); serving without it, "
                     "every prefix computed, retrying every %.0f s (%s)", name, why,
                     self._interval, RETRY_ENV)

    def _live(self) -> HiCacheStorage | None:
        """The real backend once an attempt has built it; None until then (the call is
        counted as an `unavailable` fault), starting an attempt when the interval is over."""
        with self._lock:
            backend = self._backend
            idle = self._attempt is None or not self._attempt.is_alive()
            if (backend is None and idle and not self._unusable
                    and time.monotonic() - self._last_try >= self._interval):
                self._attempt = threading.Thread(target=self._try_build, daemon=True,
                                                 name=f"vericache-{self.name}-reconnect")
                self._attempt.start()
        if backend is None:
            self.state.stats.record("unavailable", self.name, "the store cannot be reached")
        return backend

    def _try_build(self) -> None:
        """One attempt, in its own thread: probe, build, hand over the host pools (counted in
        the state's `reconnects`)."""
        try:
            backend, why = _attempt(self.name, self._build_with_pools, self._reachable)
        except StoreUnusable as error:
            self.state.reconnects.record(failed=True)
            self._unusable = True
            logger.error("VeriCache: %s; serving without it until the server restarts", error)
            return
        finally:
            self._last_try = time.monotonic()
        self.state.reconnects.record(failed=backend is None)
        if backend is None:
            logger.warning("VeriCache: the %s store is still unreachable (%s); next attempt in "
                           "%g s", self.name, why, self._interval)
            return
        with self._lock:
            self._backend = backend
        logger.info("VeriCache: the %s store is reachable again", self.name)

    def _build_with_pools(self) -> HiCacheStorage:
        """The backend, holding the host pools SGLang registered with this stand-in."""
        backend = self._build()
        for name, pool in self._pools:
            if name is None:
                backend.register_mem_pool_host(pool)
            else:
                backend.register_mem_host_pool_v2(pool, name)
        if self._pools_done:
            backend.on_host_pools_registered()
        return backend

    # -- registration: recorded, replayed on the backend once it is built -----------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._pools.append((None, mem_pool_host))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: str) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._pools.append((host_pool_name, host_pool))

    def on_host_pools_registered(self) -> None:
        self._pools_done = True

    def clear(self) -> None:
        if self._backend is not None:
            self._backend.clear()

    def get_stats(self) -> Any:
        return self._backend.get_stats() if self._backend is not None else None

    def close(self) -> None:
        if self._backend is not None and hasattr(self._backend, "close"):
            self._backend.close()


def _no_keys(keys: list, *args: Any, **kwargs: Any) -> list[bool]:
    return [False] * len(keys)


def _no_transfers(transfers: list, *args: Any, **kwargs: Any) -> dict[str, list[bool]]:
    return {t.name: [False] * len(t.keys) for t in transfers}


UNREACHABLE_ANSWERS: dict[str, Callable[..., Any]] = {
    "batch_exists": lambda *args, **kwargs: 0,
    "batch_exists_v2": lambda *args, **kwargs: PoolTransferResult.empty(),
    "exists": lambda *args, **kwargs: False,
    "batch_get_v1": _no_keys,
    "batch_set_v1": _no_keys,
    "batch_get_v2": _no_transfers,
    "batch_set_v2": _no_transfers,
    "get": lambda *args, **kwargs: None,
    "batch_get": lambda keys, *args, **kwargs: [None] * len(keys),
    "set": lambda *args, **kwargs: False,
    "batch_set": lambda *args, **kwargs: False,
}
"""SGLang's storage calls, each with what it answers while the store is unreachable (called
with the call's arguments): lookups miss, reads and writes fail. Once the store is reached, the
call goes to the real backend."""


def _to_backend(name: str, unreachable: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: ReconnectingStore, *args: Any, **kwargs: Any) -> Any:
        backend = self._live()
        if backend is None:
            return unreachable(*args, **kwargs)
        return getattr(backend, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"The real backend's `{name}`, or the unreachable store's answer."
    return call


for _name, _answer in UNREACHABLE_ANSWERS.items():
    setattr(ReconnectingStore, _name, _to_backend(_name, _answer))
abc.update_abstractmethods(ReconnectingStore)
