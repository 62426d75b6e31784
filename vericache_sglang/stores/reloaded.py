"""Compressed pages of a reloaded prefix come from the store's stream, not from requantizing.

A coded page's stream (`stores/pages.py`) holds the compressed pool's own pages as its last
lossy level, and decoding the exact KV decodes that level on the way. So when a VeriCache
store reads a page, it offers that level's codes here, keyed by the page's storage key (the
radix tree's page hash). SGLang then loads the page's KV from its host pool into device slots
when a request uses it (`UnifiedRadixCache.load_back`, or its buffer-only pipeline); the hooks
in `load_back.py` map the loaded pages' hashes to those slots and install the codes as the
compressed pool's pages for them (`CompressedPagePool.install`). Drafting then reads them at
once, and the pool quantizes none of the reloaded prefix from the full KV.

Codes wait here between the read and the load-back, as the host pool's page waits. They are
bounded as SGLang bounds prefetched pages (half the host pool, `prefetch_capacity_limit`), the
oldest dropped first; a page whose codes were dropped, or a page loaded by another path, is
quantized from the full KV as before: the same bits, so the output never depends on which.
Codes that are not this pool's pages (a stream another compressor wrote, whose exact KV is
used all the same; codes of another geometry) are skipped, counted, the page quantized from
its full KV likewise: the load-back hook never raises.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.compress.quant import QuantTier

if TYPE_CHECKING:
    from vericache_sglang.tiers.compressed_pool import CompressedPagePool

logger = logging.getLogger(__name__)

class ReloadedCodes:
    """Pool-level codes of pages read from the store, by storage key, until their KV is
    loaded onto the device (one per server, in its `StoreState`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._codes: OrderedDict[str, list[QuantTier]] = OrderedDict()
        self.pool: CompressedPagePool | None = None
        """The compressed pool installs go to; None: nothing is kept."""
        self.capacity = 0
        """Pages kept at most (the host pool's prefetch share)."""
        self.offered = self.installed = self.dropped = self.skipped = 0

    def accept(self, pool: CompressedPagePool | None) -> None:
        """Install reloaded pages into `pool` (the worker's; None: keep nothing)."""
        self.pool = pool

    def bound_by(self, host_pool: Any) -> None:
        """Keep at most the pages SGLang may prefetch into `host_pool` (half of it)."""
        self.capacity = host_pool.size // host_pool.page_size // 2

    @property
    def wanted(self) -> bool:
        return self.pool is not None and self.capacity > 0

    def offer(self, key: str, tiers: list[QuantTier]) -> None:
        """A store decoded page `key`; `tiers` are its pool-level codes, per layer."""
        if not self.wanted:
            return
        with self._lock:
            self._codes[key] = tiers
            self._codes.move_to_end(key)
            self.offered += 1
            while len(self._codes) > self.capacity:
                self._codes.popitem(last=False)
                self.dropped += 1

    def skip(self, key: str, why: str) -> None:
        """Page `key`'s codes are not this pool's pages (`why`): none installed, counted, the
        first logged."""
        if not self.wanted:
            return
        with self._lock:
            self.skipped += 1
            first = self.skipped == 1
        if first:
            logger.warning("VeriCache: the codes of reloaded page %s are not the compressed "
                           "pool's pages (%s); it is quantized from its KV (logged once, "
                           "counted in reloaded_pages.skipped_pages)", key[:16], why)

    def decoded(self, key: str, tiers: list[QuantTier], pool_level: bool) -> None:
        """A store decoded page `key`: offer its pool-level codes `tiers`. No codes from a
        stream whose last lossy level is meant to be the pool's (`pool_level`) mean another
        compressor wrote it (skipped, counted)."""
        if tiers:
            self.offer(key, tiers)
        elif pool_level:  # `decode_page` kept none back
            self.skip(key, "its stream's pool level is another compressor's")

    def take(self, key: str) -> list[QuantTier] | None:
        with self._lock:
            return self._codes.pop(key, None)

    def __len__(self) -> int:
        return len(self._codes)

    def held_bytes(self) -> int:
        """Host bytes of the codes waiting, from their storages."""
        with self._lock:
            tensors = [t for tiers in self._codes.values() for tier in tiers
                       for t in tier.tensors()]
        return storage_bytes(tensors)

    def snapshot(self) -> dict[str, int]:
        return {"offered_pages": self.offered, "installed_pages": self.installed,
                "dropped_pages": self.dropped, "skipped_pages": self.skipped,
                "waiting_pages": len(self), "waiting_bytes": self.held_bytes()}

    def install(self, keys: list[str], slots: Any, page_size: int) -> None:
        """Pages `keys` were loaded into device `slots` (page after page): install the codes
        waiting for them that fit the pool, skip the rest (`skip`)."""
        pool = self.pool
        for i, key in enumerate(keys):
            tiers = self.take(key)
            if tiers is None or pool is None:
                continue
            page = slots[i * page_size:(i + 1) * page_size]
            if pool.fits(page, tiers):
                self.installed += pool.install(page, tiers)
            else:
                self.skip(key, "codes of another geometry")
