"""Compressed pages of a reloaded prefix come from the store's stream, not from requantizing.

A coded page's stream (`stores/pages.py`) holds the compressed pool's own pages as its last
lossy level, and decoding the exact KV decodes that level on the way. So when a VeriCache
store reads a page, it offers that level's codes here, keyed by the page's storage key (the
radix tree's page hash). SGLang then loads the page's KV from its host pool into device slots
when a request uses it (`UnifiedRadixCache.load_back`, or its buffer-only pipeline); the hooks
below map the loaded pages' hashes to those slots and install the codes as the compressed
pool's pages for them (`CompressedPagePool.install`). Drafting then reads them at once, and
the pool quantizes none of the reloaded prefix from the full KV.

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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.compress.quant import QuantTier
from vericache_sglang.integration.internals import internal

if TYPE_CHECKING:
    from vericache_sglang.tiers.compressed_pool import CompressedPagePool

logger = logging.getLogger(__name__)

PIPELINE_CACHE = internal("sglang.srt.mem_cache.buffer_mode.pipeline.BufferModePipeline",
                          "_cache", "private attribute", __name__, on_instances=True)
"""The radix cache a buffer-mode pipeline loads back into (its page size)."""

LOAD_BACK = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.load_back"
BUFFER_LOAD_BACK = ("sglang.srt.mem_cache.buffer_mode.pipeline.BufferModePipeline"
                    "._allocate_and_queue_load_back")
"""SGLang's two load-backs: from its host pool (`load_back`), and with
`--hicache-host-memory-mode buffer_only` (VeriCache's host tier holds the full KV, SGLang's
host memory only stages pages) from the staged prefetch."""


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


def install_reloaded_codes(load_back: Callable[..., bool], tree: Any, node_id: Any,
                           mem_quota: int | None = None, req: Any = None) -> bool:
    """Around `UnifiedRadixCache.load_back`: once SGLang loaded a request's host pages onto
    the device (they end the request's matched path, after `req.last_node`), install the
    codes the store decoded for them, and note where pages waiting for their exact KV now
    are (`pending.py`), in the server's store state."""
    from .state import served_store_state  # state.py builds on this module

    last = getattr(req, "last_node", None)
    loaded = load_back(tree, node_id, mem_quota=mem_quota, req=req)
    state = served_store_state()
    if not loaded or not (len(state.reloaded) or state.pending.enabled) or last is None:
        return loaded
    slots = tree.tree_core.collect_full_device_indices(node_id, last)
    page_size = tree.page_size
    chain = tree.get_prefix_hash_values(node_id) + tree.tree_core.get_hash_values(node_id)
    pages = slots.numel() // page_size
    if pages and len(chain) >= pages:
        state.reloaded.install(chain[-pages:], slots.cpu(), page_size)
        state.pending.loaded(chain[-pages:], slots.cpu(), page_size)
    return loaded


def install_staged_codes(result: tuple[Any, str], pipeline: Any, req: Any, staged: Any,
                         *args: Any, **kwargs: Any) -> None:
    """After `BufferModePipeline._allocate_and_queue_load_back`: the staged prefetch's pages
    (`staged.hash_values`, page by page with `staged.host_indices`) were queued into device
    slots (`device_indices` of the load SGLang returns, for the host rows past the
    already-resident head): install the codes the store decoded for them."""
    from .state import served_store_state  # state.py builds on this module

    load = result[0]
    reloaded = served_store_state().reloaded
    if load is None or not len(reloaded):
        return None
    slots = load.device_indices
    page_size = PIPELINE_CACHE.get(pipeline).page_size
    head = (len(staged.host_indices) - slots.numel()) // page_size
    pages = slots.numel() // page_size
    keys = staged.hash_values[head:head + pages]
    if len(keys) == pages:
        reloaded.install(keys, slots.cpu(), page_size)
    return None
