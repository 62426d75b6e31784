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
host-to-device copy still queued carries it) and its device slots; a page answered on the
coarse level (`link.py`) brings its pool-level codes too, which replace the coarse ones in the
compressed pool. Only a prefill whose cached prefix holds a waiting page's device slots (the
forward's context) waits for it, at most `--vericache-store-timeout` seconds; every other
forward runs on. A page whose exact part failed (store fault, or past that deadline) is never
promoted: its device slots and host page keep the drafting level, marked failed, until a
prefill whose context holds them recomputes them (`early.recompute_prefixes`; its KV then heals
the host page), or SGLang frees or reuses them. Device and host frees reach this registry
(`released`, from the compressed pool's wrap of the allocator; `host_freed`, from a wrap of the
host pool's `free`), so a late exact KV never lands in slots that now hold other KV.
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

from vericache_sglang.integration.internals import internal

HOST_FREE = internal("sglang.srt.mem_cache.pool_host.base.HostKVCache", "free", "instance wrap",
                     __name__)
"""The host pool's free, where every host free of SGLang 0.5.23 ends: no free listener exists."""

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
    """Device slots SGLang loaded the page into, still holding the drafting level (None once
    they were written exact, or reused for other KV)."""
    failed: bool = False
    """Its exact part will not come (a store fault, or past the deadline): its device slots
    and host page hold the drafting level until a prefill recomputes them."""

    @property
    def arriving(self) -> bool:
        """Its exact KV is still on its way."""
        return not self.failed and not self.exact.done()

    @property
    def lost(self) -> bool:
        """Its exact KV will not come (marked failed, or its future ended in an error)."""
        return self.failed or (self.exact.done() and self.exact.exception() is not None)


@dataclass
class Settled:
    """What one settle did: device slots to write with exact KV, and device slots inside the
    forward's context whose exact KV cannot come (the worker recomputes them)."""

    writes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(slots [page], the page's exact KV [2, L, page, H, D])."""
    codes: list[tuple[torch.Tensor, list]] = field(default_factory=list)
    """(slots [page], pool-level codes per layer) of pages answered on a coarser level: they
    replace the coarse codes in the compressed pool (`stores/link.py`)."""
    failed: dict[int, torch.Tensor] = field(default_factory=dict)
    """Failed pages inside the context, by entry: their slots, to recompute and then
    `heal`."""
    waited_seconds: float = 0.0


class PendingExact:
    """A server's pages answered on their drafting level (see the module docstring; one per
    server, in its `StoreState`).

    Entries are per answer, not per key: two prefetches of one prefix that raced both answer
    into host pages of their own, and SGLang keeps one of them and frees the other.

    A forward names its context, the device slots it reads as exact KV (`context`): only the
    pages there are waited for, recomputed or written, so a batch that reads none of them
    (another request's decode or prefill) never waits on the store."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pages: dict[int, _Page] = {}
        self._by_host: dict[int, int] = {}
        self._by_key: dict[str, set[int]] = {}
        self.host_pool: Any = None
        self._kv_of: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.enabled = False
        self.deadline = 0.0
        """Seconds a forward waits for the exact KV of its context's pages; past it they
        count as failed and are recomputed (`--vericache-store-timeout`, set by `attach`)."""
        self.answered = self.settled = self.poisoned = self.recomputed = 0
        self.timed_out = 0
        self.refined = 0
        """Compressed pool pages whose coarse codes the pool level's replaced
        (`StoreState.write_settled`)."""
        self.waited_seconds = 0.0

    def attach(self, host_pool: Any, kv_of: Callable[[torch.Tensor], torch.Tensor],
               deadline: float) -> None:
        """Serve `host_pool`'s pages (`kv_of` views a flat page as [2, L, page, H, D]): learn
        when SGLang frees them (a wrap of its `free`, which every host free in SGLang 0.5.23
        ends in)."""
        self.host_pool = host_pool
        self._kv_of = kv_of
        self.deadline = deadline

        def free_and_forget(free: Callable[[torch.Tensor], int]) -> Callable[[torch.Tensor], int]:
            def wrapped(indices: torch.Tensor) -> int:
                self.host_freed(indices)
                return free(indices)
            return wrapped

        HOST_FREE.wrap(host_pool, free_and_forget)
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

    def _in(self, context: torch.Tensor | None) -> list[int]:
        """Entries with device slots in `context` (every one on the device when None)."""
        found = []
        for entry_id, entry in self._pages.items():
            slots = entry.device_slots
            if slots is None:
                continue
            if context is None or bool(torch.isin(slots, context).any()):
                found.append(entry_id)
        return found

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

    def released(self, slots: torch.Tensor) -> None:
        """These device slots no longer hold the pages loaded there (SGLang freed them, or
        loads other pages into them): nothing is written or recomputed there for them."""
        if not self._pages:
            return
        slots = slots.reshape(-1).to(torch.int64).cpu()
        with self._lock:
            for entry_id in self._in(slots):
                entry = self._pages[entry_id]
                entry.device_slots = None
                if entry.host_index is None:
                    self._drop(entry_id)

    def loaded(self, keys: list[str], slots: torch.Tensor, page_size: int) -> None:
        """Pages `keys` were loaded into device `slots` (page after page)."""
        if not self._pages:
            return
        self.released(slots)
        with self._lock:
            for i, key in enumerate(keys):
                for entry_id in self._by_key.get(key, ()):
                    self._pages[entry_id].device_slots = (
                        slots[i * page_size:(i + 1) * page_size].to(torch.int64).clone())

    def waiting_in(self, context: torch.Tensor | None = None) -> bool:
        """Whether a page in `context` (anywhere on the device when None) still waits for
        its exact KV or its recompute."""
        with self._lock:
            return any(self._pages[i].arriving or self._pages[i].lost
                       for i in self._in(context))

    def arriving_in(self, context: torch.Tensor) -> bool:
        """Whether a page in `context` still waits for its exact KV to arrive."""
        with self._lock:
            return any(self._pages[i].arriving for i in self._in(context))

    def expire(self, context: torch.Tensor) -> None:
        """The deadline passed for the pages in `context` still arriving: they count as
        failed, and their prefix is recomputed."""
        context = context.reshape(-1).to(torch.int64).cpu()
        with self._lock:
            self._expire([i for i in self._in(context) if self._pages[i].arriving])

    def _expire(self, entry_ids: list[int]) -> None:
        late = [i for i in entry_ids if i in self._pages]
        for entry_id in late:
            self._pages[entry_id].failed = True
        self.timed_out += len(late)
        if late:
            logger.warning("VeriCache store: %d pages' exact KV did not come within %.0f s "
                           "(--vericache-store-timeout); their prefix is recomputed",
                           len(late), self.deadline)

    def settle(self, *, context: torch.Tensor | None, block: bool,
               failures: bool = True) -> Settled:
        """Write every arrived exact page into its host page, and hand back its device writes;
        with `block`, first wait (up to the deadline) for the exact KV of every page in
        `context`, the device slots the coming forward reads (None: none). Failed pages in
        `context` come back for recompute (without `failures` they stay for a later settle:
        drafting is under way)."""
        result = Settled()
        context = None if context is None else context.reshape(-1).to(torch.int64).cpu()
        if context is not None and block:
            with self._lock:
                waiting = {i: self._pages[i].exact for i in self._in(context)
                           if self._pages[i].arriving}
            if waiting:
                began = time.perf_counter()
                _, late = wait_all(waiting.values(), timeout=self.deadline)
                result.waited_seconds = time.perf_counter() - began
                self.waited_seconds += result.waited_seconds
                with self._lock:
                    self._expire([i for i, future in waiting.items() if future in late])
        with self._lock:
            inside = set() if context is None else set(self._in(context))
            for entry_id, entry in list(self._pages.items()):
                if entry.lost:
                    # Poisoned: its host and device copies keep the drafting level until a
                    # prefill whose context holds them recomputes them; SGLang frees or
                    # reuses them before that, or never reads them again.
                    entry.failed = True
                    if entry.device_slots is None and entry.host_index is None:
                        self._drop(entry_id)
                    elif failures and entry_id in inside:
                        result.failed[entry_id] = entry.device_slots
                    continue
                if not entry.exact.done():
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

    def heal(self, recomputed: torch.Tensor, failed: dict[int, torch.Tensor],
             device_kv: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The worker recomputed the device slots `recomputed`: each failed page whose slots
        are all among them now holds exact KV there; copy it (`device_kv(slots)`,
        [2, L, page, H, D]) into the host page still holding the drafting level, and forget
        the page. A page only partly recomputed stays failed for a later prefill."""
        recomputed = recomputed.reshape(-1).to(torch.int64).cpu()
        with self._lock:
            for entry_id, slots in failed.items():
                entry = self._pages.get(entry_id)
                if entry is None or not bool(torch.isin(slots, recomputed).all()):
                    continue
                if entry.host_index is not None:
                    flat = self.host_pool.get_dummy_flat_data_page()
                    self._kv_of(flat).copy_(device_kv(slots))
                    self.host_pool.set_from_flat_data_page(entry.host_index, flat)
                self._drop(entry_id)
                self.recomputed += 1

    def clear(self) -> None:
        """SGLang flushed its caches: nothing loaded or held refers to these pages now."""
        with self._lock:
            self._pages.clear()
            self._by_host.clear()
            self._by_key.clear()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            waiting = len(self._pages)
            failed = sum(entry.failed for entry in self._pages.values())
        return {"answered_on_drafting_level": self.answered, "settled": self.settled,
                "exact_failed": self.poisoned, "exact_timed_out": self.timed_out,
                "recomputed_pages": self.recomputed, "waiting_pages": waiting,
                "failed_pages_held": failed, "barrier_wait_seconds": self.waited_seconds,
                "refined_pool_pages": self.refined}


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
