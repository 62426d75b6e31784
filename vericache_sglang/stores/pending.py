"""Pages a store answered on their drafting level, whose exact KV is still on its way.

With `--vericache-early-drafting` a store read answers SGLang's prefetch as soon as a page's
drafting level has arrived and decoded (`mooncake.py`): its pool-level codes go to the
compressed pool (`reloaded.py`), its host page holds the level's lossy reconstruction, and the
page's exact part is fetched and decoded behind it. Until that exact KV is written over the
lossy one, nothing may read the page's full KV: this registry keeps, per page (by its storage
key, the radix tree's page hash), the host page it was written to, the device slots SGLang
loaded it into (`loaded`, from the load-back hook), and the future of its exact KV.

The worker settles pages on the scheduler thread (`settle`): before every forward (and between
early draft steps) it writes each arrived page's exact KV into its host page (first, so a
host-to-device copy still queued carries it) and its device slots, waiting for the pages on the
device before a forward that reads them; a page answered on the coarse level (`link.py`) brings
its pool-level codes too, which replace the coarse ones in the compressed pool. Pages only in
the host pool are written once their exact KV is there. A page whose exact part failed (store fault)
stays here as poisoned: its device slots are handed back for the worker to recompute, and its
host page, if SGLang loads it later, comes back the same way. A host page SGLang frees is
forgotten here (`host_freed`, from a wrap of the host pool's `free`), so a late exact KV
never lands in a page that now holds another prefix.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass
class _Page:
    key: str
    """The page's storage key (the radix tree's page hash)."""
    host_index: int | None
    """The host page holding the lossy reconstruction (None once SGLang freed it)."""
    exact: Future
    """The exact flat page (host layout) and the page's pool-level codes where it was answered
    on a coarser level (else None), or the error that stopped it."""
    device_slots: torch.Tensor | None = None
    """Device slots SGLang loaded the page into, not yet written with the exact KV."""


@dataclass
class Settled:
    """What one settle did: device slots to write with exact KV, and device slots whose exact
    KV cannot come (the worker recomputes them)."""

    writes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(slots [page], the page's exact KV [2, L, page, H, D])."""
    codes: list[tuple[torch.Tensor, list]] = field(default_factory=list)
    """(slots [page], pool-level codes per layer) of pages answered on a coarser level: they
    replace the coarse codes in the compressed pool (`stores/link.py`)."""
    failed: dict[int, torch.Tensor] = field(default_factory=dict)
    """Poisoned pages on the device, by entry: their slots, to recompute and then `heal`."""
    waited_seconds: float = 0.0


class PendingExact:
    """This process's pages answered on their drafting level (see the module docstring).

    Entries are per answer, not per key: two prefetches of one prefix that raced both answer
    into host pages of their own, and SGLang keeps one of them and frees the other."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pages: dict[int, _Page] = {}
        self._by_host: dict[int, int] = {}
        self._by_key: dict[str, set[int]] = {}
        self.host_pool: Any = None
        self._kv_of: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.enabled = False
        self.answered = self.settled = self.poisoned = self.recomputed = 0
        self.refined = 0
        """Compressed pool pages whose coarse codes the pool level's replaced (the worker)."""
        self.waited_seconds = 0.0

    def attach(self, host_pool: Any, kv_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Serve `host_pool`'s pages (`kv_of` views a flat page as [2, L, page, H, D]): learn
        when SGLang frees them (a wrap of its `free`, which every host free in SGLang 0.5.23
        ends in)."""
        self.host_pool = host_pool
        self._kv_of = kv_of
        free = host_pool.free

        def free_and_forget(indices: torch.Tensor) -> int:
            self.host_freed(indices)
            return free(indices)

        host_pool.free = free_and_forget
        self.enabled = True

    def _drop(self, entry_id: int) -> None:
        entry = self._pages.pop(entry_id)
        if entry.host_index is not None:
            self._by_host.pop(entry.host_index, None)
        ids = self._by_key.get(entry.key)
        if ids is not None:
            ids.discard(entry_id)
            if not ids:
                del self._by_key[entry.key]

    # -- store threads ----------------------------------------------------------------------
    def expect(self, key: str, host_index: int, exact: Future) -> None:
        """Page `key` was answered into host page `host_index`; `exact` brings its exact KV."""
        with self._lock:
            entry_id = next(self._ids)
            self._pages[entry_id] = _Page(key, host_index, exact)
            self._by_host[host_index] = entry_id
            self._by_key.setdefault(key, set()).add(entry_id)
            self.answered += 1

    def poison(self) -> None:
        """Count a page whose exact part failed (its future carries the error; the store
        logs the fault)."""
        with self._lock:
            self.poisoned += 1

    # -- scheduler thread -------------------------------------------------------------------
    def host_freed(self, indices: torch.Tensor) -> None:
        """SGLang freed these host slots (page-aligned token indices)."""
        if not self._by_host:
            return
        page = self.host_pool.page_size
        with self._lock:
            for index in indices.reshape(-1)[::page].tolist():
                entry_id = self._by_host.pop(int(index), None)
                if entry_id is None:
                    continue
                entry = self._pages[entry_id]
                entry.host_index = None
                if entry.device_slots is None:
                    self._drop(entry_id)

    def loaded(self, keys: list[str], slots: torch.Tensor, page_size: int) -> None:
        """Pages `keys` were loaded into device `slots` (page after page)."""
        if not self._pages:
            return
        with self._lock:
            for i, key in enumerate(keys):
                for entry_id in self._by_key.get(key, ()):
                    self._pages[entry_id].device_slots = (
                        slots[i * page_size:(i + 1) * page_size].clone())

    def on_device(self) -> bool:
        """Whether a page loaded onto the device still waits for its exact KV."""
        with self._lock:
            return any(e.device_slots is not None for e in self._pages.values())

    def device_ready(self) -> bool:
        """Whether every page loaded onto the device has its exact KV (or its fault)."""
        with self._lock:
            return all(e.exact.done() for e in self._pages.values()
                       if e.device_slots is not None)

    def settle(self, *, block: bool, failures: bool = True) -> Settled:
        """Write every arrived exact page into its host page, and hand back its device writes;
        with `block`, first wait for the exact KV of every page on the device. Without
        `failures`, failed pages stay here for a later settle (drafting is under way)."""
        result = Settled()
        with self._lock:
            device = [e.exact for e in self._pages.values() if e.device_slots is not None]
        if block and device:
            began = time.perf_counter()
            wait_all(device)
            result.waited_seconds = time.perf_counter() - began
            self.waited_seconds += result.waited_seconds
        with self._lock:
            for entry_id, entry in list(self._pages.items()):
                if not entry.exact.done():
                    continue
                if entry.exact.exception() is not None:
                    if not failures:
                        continue
                    # Poisoned: the lossy host page stays until SGLang frees it, and comes
                    # back here for recompute wherever it is loaded.
                    if entry.device_slots is not None:
                        result.failed[entry_id] = entry.device_slots
                        entry.device_slots = None
                        self.recomputed += 1
                    if entry.host_index is None:
                        self._drop(entry_id)
                    continue
                flat, codes = entry.exact.result()
                if entry.host_index is not None:
                    self.host_pool.set_from_flat_data_page(entry.host_index, flat)
                if entry.device_slots is not None:
                    result.writes.append((entry.device_slots, self._kv_of(flat)))
                    if codes is not None:
                        result.codes.append((entry.device_slots, codes))
                self._drop(entry_id)
                self.settled += 1
        return result

    def heal(self, failed: dict[int, torch.Tensor],
             device_kv: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The worker recomputed these poisoned pages' device slots: copy their KV
        (`device_kv(slots)`, [2, L, page, H, D]) into the host pages still holding the lossy
        level, and forget them."""
        with self._lock:
            for entry_id, slots in failed.items():
                entry = self._pages.get(entry_id)
                if entry is None:
                    continue
                if entry.host_index is not None:
                    flat = self.host_pool.get_dummy_flat_data_page()
                    self._kv_of(flat).copy_(device_kv(slots))
                    self.host_pool.set_from_flat_data_page(entry.host_index, flat)
                self._drop(entry_id)

    def clear(self) -> None:
        """SGLang flushed its caches: nothing loaded or held refers to these pages now."""
        with self._lock:
            self._pages.clear()
            self._by_host.clear()
            self._by_key.clear()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            waiting = len(self._pages)
        return {"answered_on_drafting_level": self.answered, "settled": self.settled,
                "exact_failed": self.poisoned, "recomputed_pages": self.recomputed,
                "waiting_pages": waiting, "barrier_wait_seconds": self.waited_seconds,
                "refined_pool_pages": self.refined}


PENDING = PendingExact()


def check_early_drafting(server_args: Any, config: Any) -> str | None:
    """Why `--vericache-early-drafting` cannot run with these arguments, or None."""
    from vericache_sglang.compress.quant import KiviQuantizer
    from vericache_sglang.compress.registry import parse_compressor_spec

    if not config.vericache_early_drafting:
        return None
    compressor = parse_compressor_spec(config.vericache_compressor)
    needs = [
        (server_args.enable_hierarchical_cache
         and server_args.hicache_storage_backend == "mooncake",
         "a Mooncake store (--enable-hierarchical-cache --hicache-storage-backend mooncake)"),
        (server_args.page_size and server_args.page_size % 64 == 0,
         "--page-size a multiple of 64 (stored pages coded as streams)"),
        (isinstance(compressor, KiviQuantizer) and compressor.prefix_stable,
         "a KIVI compressor without a recent band (the drafting level is the pool's pages)"),
        (config.vericache_full_tier == "device",
         "--vericache-full-tier device (SGLang's own host pool and load-back)"),
        (server_args.hicache_write_policy == "write_through",
         "--hicache-write-policy write_through (a host page waiting for its exact KV must "
         "never be backed up)"),
    ]
    missing = [what for ok, what in needs if not ok]
    return (None if not missing
            else "--vericache-early-drafting needs " + "; ".join(missing))
