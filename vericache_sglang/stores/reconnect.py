"""A store that could not be reached when the server started: serve misses, retry, reconnect.

SGLang builds its storage backend once, when HiCache attaches storage, and a backend whose
constructor raises (Mooncake's master or metadata server down) stops the server. On a VeriCache
server a store is a cache, not a dependency: `ReconnectingStore` stands in for the backend,
answers every lookup with a miss (the prefix is recomputed, with the same output), refuses every
write, counts each call as an `unavailable` fault (`/metrics`, `/server_info`), and tries to
build the real backend again at most every `VERICACHE_STORE_RETRY_SECONDS` (default 30 s), in a
thread of its own: a store client may retry for a long time (Mooncake's setup tries 20 times,
about 90 s) and SGLang's prefetch and backup threads must not wait for it. Each attempt first
asks whether the store answers at all (`reachable`, a quick probe). Once built, the host pools
SGLang registered are handed to the backend and every call goes to it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult

from .pages import STORE_STATS

logger = logging.getLogger(__name__)

RETRY_ENV = "VERICACHE_STORE_RETRY_SECONDS"
DEFAULT_RETRY_SECONDS = 30.0


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


def build_or_reconnect(name: str, build: Callable[[], HiCacheStorage],
                       reachable: Callable[[], str | None]) -> HiCacheStorage:
    """`build()`, or a `ReconnectingStore` retrying it when the store cannot be reached.
    `reachable()` is a quick probe: None when the store answers, else why not."""
    why = reachable()
    if why is None:
        try:
            return build()
        except Exception as error:  # noqa: BLE001 - any failure to reach the store is the same
            why = str(error)
    return ReconnectingStore(name, build, reachable, why)


class ReconnectingStore(HiCacheStorage):
    """The backend SGLang talks to while the store is unreachable (see the module docstring)."""

    def __init__(self, name: str, build: Callable[[], HiCacheStorage],
                 reachable: Callable[[], str | None], why: str) -> None:
        self.name = name
        self._build = build
        self._reachable = reachable
        self._interval = retry_seconds()
        self._lock = threading.Lock()
        self._backend: HiCacheStorage | None = None
        self._attempt: threading.Thread | None = None
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
            if (backend is None and idle
                    and time.monotonic() - self._last_try >= self._interval):
                self._attempt = threading.Thread(target=self._try_build, daemon=True,
                                                 name=f"vericache-{self.name}-reconnect")
                self._attempt.start()
        if backend is None:
            STORE_STATS.record("unavailable", self.name, "the store cannot be reached")
        return backend

    def _try_build(self) -> None:
        """One attempt, in its own thread: probe, build, hand over the host pools."""
        try:
            why = self._reachable()
            if why is not None:
                logger.debug("VeriCache: the %s store is still unreachable: %s", self.name, why)
                return
            backend = self._build()
            for name, pool in self._pools:
                if name is None:
                    backend.register_mem_pool_host(pool)
                else:
                    backend.register_mem_host_pool_v2(pool, name)
            if self._pools_done:
                backend.on_host_pools_registered()
        except Exception as error:  # noqa: BLE001 - still unreachable
            logger.debug("VeriCache: the %s store is still unreachable: %s", self.name, error)
        else:
            with self._lock:
                self._backend = backend
            logger.info("VeriCache: the %s store is reachable again", self.name)
        finally:
            self._last_try = time.monotonic()

    # -- registration: recorded, replayed on the backend once it is built -----------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._pools.append((None, mem_pool_host))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: str) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._pools.append((host_pool_name, host_pool))

    def on_host_pools_registered(self) -> None:
        self._pools_done = True

    # -- lookups are misses, writes fail, until the store is reached --------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        backend = self._live()
        return backend.batch_exists(keys, extra_info) if backend else 0

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None,
                        extra_info: Any = None) -> PoolTransferResult:
        backend = self._live()
        return (backend.batch_exists_v2(keys, pool_transfers, extra_info) if backend
                else PoolTransferResult.empty())

    def exists(self, key: str) -> bool:
        backend = self._live()
        return backend.exists(key) if backend else False

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        backend = self._live()
        return (backend.batch_get_v1(keys, host_indices, extra_info) if backend
                else [False] * len(keys))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        backend = self._live()
        return (backend.batch_set_v1(keys, host_indices, extra_info) if backend
                else [False] * len(keys))

    def batch_get_v2(self, transfers: list, extra_info: Any = None) -> dict[str, list[bool]]:
        backend = self._live()
        return (backend.batch_get_v2(transfers, extra_info) if backend
                else {t.name: [False] * len(t.keys) for t in transfers})

    def batch_set_v2(self, transfers: list, extra_info: Any = None) -> dict[str, list[bool]]:
        backend = self._live()
        return (backend.batch_set_v2(transfers, extra_info) if backend
                else {t.name: [False] * len(t.keys) for t in transfers})

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        backend = self._live()
        return backend.get(key, target_location, target_sizes) if backend else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> Any:
        backend = self._live()
        return (backend.batch_get(keys, target_locations, target_sizes) if backend
                else [None] * len(keys))

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        backend = self._live()
        return backend.set(key, value, target_location, target_sizes) if backend else False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        backend = self._live()
        return (backend.batch_set(keys, values, target_locations, target_sizes) if backend
                else False)

    def clear(self) -> None:
        if self._backend is not None:
            self._backend.clear()

    def get_stats(self) -> Any:
        return self._backend.get_stats() if self._backend is not None else None

    def close(self) -> None:
        if self._backend is not None and hasattr(self._backend, "close"):
            self._backend.close()
