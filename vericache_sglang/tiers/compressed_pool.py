"""The compressed pool: quantized KV pages beside SGLang's KV pool, shared along the radix tree.

A page is one key group (`group` consecutive tokens of a request, starting at a multiple of
`group`) of every layer: packed key codes with a per-channel scale and zero point, packed value
codes with per-token scales (the `vericache_kernels.layout` layout, one group per page). A page
is keyed by the full-pool slots its tokens occupy. SGLang's radix tree hands a request that
reuses a cached prefix exactly the slots that prefix was computed into, so the request finds
the prefix's pages by its own slots: a prefix is compressed once and stored once, however many
requests share it, and a request that arrives after the first one finished compresses nothing
of it. A page lives as long as its slots: when SGLang's allocator frees a slot (the request
ended without caching it, or the tree evicted it), every page holding that slot is freed with
it, so eviction frees both forms together and the tree's locks pin both.

Only compressors whose blocks are a pure function of the group's tokens can share pages
(`Compressor.prefix_stable`, e.g. KIVI). The partial last group and the full-precision recent
window are the request's own: drafting reads them exactly from the full KV.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection
from types import SimpleNamespace

import torch

import vericache_kernels as kernels
from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.compress.quant import KiviQuantizer, QuantTier
from vericache_sglang.integration.internals import internal

ALLOCATOR = "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator"
PAGED_ALLOCATOR = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"

logger = logging.getLogger(__name__)


class CompressedPagePool:
    """Preallocated compressed pages of every layer, keyed by the full-pool slots they cover."""

    def __init__(self, compressor: KiviQuantizer, full_pool, *, num_pages: int,
                 windowed_layers: Collection[int] = ()) -> None:
        """`full_pool`: SGLang's KV pool (`MHATokenToKVPool`), whose slots key the pages and
        whose K/V they are compressed from. `windowed_layers`: sliding-window layers, which
        drafting reads exactly within their window (`DraftAttnBackend._window_attention`):
        the pool holds no pages for them."""
        if not compressor.prefix_stable:
            raise ValueError(f"{compressor.spec()} is not prefix-stable: its blocks depend on "
                             "more than a group's own tokens, so they cannot be shared pages")
        plan = compressor.plan(0)
        num_layers, kv_heads = full_pool.layer_num, full_pool.head_num
        head_dim, device = full_pool.head_dim, full_pool.device
        self.full_pool = full_pool
        self.compressor = compressor
        self.group = plan.group
        self.residual = plan.residual
        self.v_group = math.gcd(self.group, head_dim)
        self.num_pages = num_pages
        self.bits = [compressor.plan(layer).old_bits for layer in range(num_layers)]
        self.windowed_layers = frozenset(windowed_layers)
        fp16 = {"dtype": torch.float16, "device": device}
        self.k_codes, self.k_scale, self.k_zero = [], [], []
        self.v_codes, self.v_scale, self.v_zero = [], [], []
        for layer, bits in enumerate(self.bits):
            per_byte = 8 // bits
            pages = 0 if layer in self.windowed_layers else num_pages
            self.k_codes.append(torch.zeros(pages, kv_heads, head_dim, self.group // per_byte,
                                            dtype=torch.uint8, device=device))
            self.k_scale.append(torch.zeros(pages, kv_heads, head_dim, **fp16))
            self.k_zero.append(torch.zeros(pages, kv_heads, head_dim, **fp16))
            self.v_codes.append(torch.zeros(pages, self.group, kv_heads, head_dim // per_byte,
                                            dtype=torch.uint8, device=device))
            meta = (pages, self.group, kv_heads, head_dim // self.v_group)
            self.v_scale.append(torch.zeros(meta, **fp16))
            self.v_zero.append(torch.zeros(meta, **fp16))
        # Which slots each page covers (-1: free), and the page of each slot tuple.
        self.page_slots = torch.full((num_pages, self.group), -1, dtype=torch.int64, device=device)
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._free = list(range(num_pages - 1, -1, -1))
        self.compressed_pages = 0
        """Pages quantized since start: a shared prefix counts once."""
        self.installed_pages = 0
        """Pages taken from a store's decoded codes instead (`install`)."""
        self._warned_full = False
        self.on_read: Callable[[int, float], None] | None = None
        """Told (bytes, seconds) of each read of the full pool (when it is off the device)."""

    # -- what drafting reads --------------------------------------------------------------------
    def compressible_len(self, committed: int) -> int:
        """Tokens of a request with `committed` verified tokens that belong in pages: whole
        groups older than the full-precision recent window (KIVI's residual)."""
        return max(committed - self.residual, 0) // self.group * self.group

    def pages(self, slots: torch.Tensor, known: torch.Tensor | None = None) -> torch.Tensor:
        """Page ids (int64, on the pool's device) of the whole groups of a request whose
        tokens sit at full-pool `slots` (in token order, a multiple of `group` long),
        compressing from the full pool the groups no page holds yet. When the pool is full,
        the ids of the leading groups that fit: the rest is read exactly (more accurate
        drafts, never wrong output).

        `known`: the request's page ids from an earlier round. A request's groups only grow
        between rounds, so when those pages still cover the same slots (one comparison on the
        device; a page lives exactly as long as its slots) only the groups added since are
        looked up: a round's host work follows what the request added, not its context."""
        groups = slots.reshape(-1, self.group)
        kept = 0
        if known is not None and 0 < len(known) <= len(groups) and torch.equal(
                self.page_slots[known], groups[: len(known)].to(self.page_slots.device)):
            kept = len(known)
            if kept == len(groups):
                return known
        added = torch.tensor(self._lookup(groups[kept:]), dtype=torch.int64,
                             device=self.page_slots.device)
        return torch.cat([known[:kept], added]) if kept else added

    def _lookup(self, groups: torch.Tensor) -> list[int]:
        """Page ids of `groups` [n, group] by their slots, compressing those no page holds
        (the leading ones that fit when the pool is full)."""
        keys = self._keys(groups)
        pages = [self._page_of.get(key, -1) for key in keys]
        missing = [i for i, page in enumerate(pages) if page < 0]
        if len(missing) > len(self._free):
            self._warn_full(len(missing))
            pages = pages[: missing[len(self._free)]]
            missing = missing[: len(self._free)]
        if missing:
            new = self._claim(keys, missing)
            for i, page in zip(missing, new, strict=True):
                pages[i] = page
            self._compress(torch.tensor(new, device=groups.device), groups[missing])
        return pages

    @staticmethod
    def _keys(groups: torch.Tensor) -> list[bytes]:
        """The key of each group of slots [n, group]: its int64 slots' bytes, so that slots
        of any integer dtype (a request's row, SGLang's load-back indices) find one page."""
        return [row.numpy().tobytes() for row in groups.to("cpu", torch.int64)]

    def _claim(self, keys: list[bytes], indices: list[int]) -> list[int]:
        """Free pages for `keys[i]`, i in `indices` (at most the free count), now theirs."""
        new = [self._free.pop() for _ in indices]
        for i, page in zip(indices, new, strict=True):
            self._page_of[keys[i]] = page
            self._key_of[page] = keys[i]
        return new

    def install(self, slots: torch.Tensor, tiers: list[QuantTier], *,
                replace: bool = False) -> int:
        """Take the pages of tokens at full-pool `slots` (whole groups, in token order) from
        `tiers`, their codes per layer as a store decoded them (the CacheGen stream's pool
        level, `stores/reloaded.py`), instead of quantizing the full KV loaded into those
        slots: the same bits, without reading the full KV. Groups a page already holds are
        left out, or with `replace` overwritten (a coarse level's codes giving way to the pool
        level's, `stores/link.py`); groups past a full pool are left out. Returns the pages
        written. Raises ValueError for codes that do not fit (`fits`)."""
        if not self.fits(slots, tiers):
            raise ValueError("codes of another geometry than this pool's pages")
        groups = slots.reshape(-1, self.group)
        keys = self._keys(groups)
        held = [i for i, key in enumerate(keys) if key in self._page_of] if replace else []
        wanted = [i for i, key in enumerate(keys) if key not in self._page_of]
        if len(wanted) > len(self._free):
            self._warn_full(len(wanted))
            wanted = wanted[: len(self._free)]
        if not wanted and not held:
            return 0
        new = self._claim(keys, wanted)
        rows = torch.tensor(held + wanted)
        pages = [self._page_of[keys[i]] for i in held] + new
        tokens = (rows[:, None] * self.group + torch.arange(self.group)).flatten()
        self._write(torch.tensor(pages, device=self.page_slots.device), groups[rows],
                    [QuantTier(t.bits, t.k_codes[rows], t.k_scale[rows], t.k_zero[rows],
                               t.v_codes[tokens], t.v_scale[tokens], t.v_zero[tokens])
                     for t in tiers])
        self.installed_pages += len(new)
        return len(pages)

    def fits(self, slots: torch.Tensor, tiers: list[QuantTier]) -> bool:
        """Whether `tiers` are codes of this pool's pages for the tokens at `slots` (whole
        groups): one tier per layer, of the layer's bits, key group, heads and head size."""
        tokens = slots.numel()
        if len(tiers) != len(self.bits) or tokens % self.group:
            return False
        return all(t.bits == bits and len(t) == tokens
                   and t.k_codes.shape == (tokens // self.group, *k_codes.shape[1:])
                   and t.v_codes.shape == (tokens, *v_codes.shape[2:])
                   for t, bits, k_codes, v_codes in zip(tiers, self.bits, self.k_codes,
                                                        self.v_codes, strict=True))

    def layer(self, layer_id: int, page_table: torch.Tensor,
              lengths: torch.Tensor) -> kernels.PagedKV:
        """One layer's pages as the decode-attention kernels read them."""
        return kernels.PagedKV(
            self.k_codes[layer_id], self.k_scale[layer_id], self.k_zero[layer_id],
            self.v_codes[layer_id], self.v_scale[layer_id], self.v_zero[layer_id],
            page_table=page_table, lengths=lengths, bits=self.bits[layer_id], group=self.group,
            v_group=self.v_group,
        )

    # -- lifetime -------------------------------------------------------------------------------
    def free_slots(self, slots: torch.Tensor) -> None:
        """The allocator freed these full-pool slots: free every page that holds one of them."""
        if not self._key_of or slots.numel() == 0:
            return
        hit = torch.isin(self.page_slots, slots.to(self.page_slots.device)).any(dim=1)
        for page in hit.nonzero().flatten().tolist():
            del self._page_of[self._key_of.pop(page)]
            self._free.append(page)
        self.page_slots[hit] = -1

    def follow(self, allocator) -> None:
        """Free pages with the full-pool slots they were made from (`follow_frees`)."""
        follow_frees(allocator, self.free_slots, self.clear)

    def clear(self) -> None:
        """Free every page (the allocator was reset)."""
        self._page_of.clear()
        self._key_of.clear()
        self._free = list(range(self.num_pages - 1, -1, -1))
        self.page_slots.fill_(-1)

    # -- accounting -----------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the pool allocated."""
        return [*self.k_codes, *self.k_scale, *self.k_zero, *self.v_codes, *self.v_scale,
                *self.v_zero, self.page_slots]

    @property
    def used_pages(self) -> int:
        return len(self._key_of)

    def allocated_bytes(self) -> int:
        """Bytes of the pool's storages (all pages, used or not)."""
        return storage_bytes(self.tensors())

    def held_bytes(self) -> int:
        """Bytes of the pages in use: the allocated storage's share per page, times pages."""
        return self.allocated_bytes() * self.used_pages // self.num_pages

    # -- internals ------------------------------------------------------------------------------
    def _compress(self, pages: torch.Tensor, groups: torch.Tensor) -> None:
        """Quantize the K/V at `groups` [n, group] of the full pool into `pages` [n]."""
        rows = groups.flatten()
        tiers: list[QuantTier | None] = []
        for layer, bits in enumerate(self.bits):
            if layer in self.windowed_layers:
                tiers.append(None)
                continue
            began = time.perf_counter()
            keys = self.full_pool.get_key_buffer(layer)[rows]
            values = self.full_pool.get_value_buffer(layer)[rows]
            if self.on_read is not None:
                self.on_read(storage_bytes([keys, values]), time.perf_counter() - began)
            tiers.append(QuantTier(bits, *kernels.quantize_keys(keys, self.group, bits),
                                   *kernels.quantize_values(values, self.v_group, bits)))
        self._write(pages, groups, tiers)
        self.compressed_pages += len(pages)

    def _write(self, pages: torch.Tensor, groups: torch.Tensor,
               tiers: list[QuantTier | None]) -> None:
        """Store per-layer `tiers` of `groups` [n, group] (n key groups, in order) as
        `pages` [n]; windowed layers keep none."""
        n = len(pages)
        for layer, tier in enumerate(tiers):
            if layer in self.windowed_layers:
                continue
            self.k_codes[layer][pages] = tier.k_codes.to(self.k_codes[layer].device)
            self.k_scale[layer][pages] = tier.k_scale.to(self.k_scale[layer].device)
            self.k_zero[layer][pages] = tier.k_zero.to(self.k_zero[layer].device)
            for pool, part in ((self.v_codes, tier.v_codes), (self.v_scale, tier.v_scale),
                               (self.v_zero, tier.v_zero)):
                pool[layer][pages] = part.reshape(n, self.group, *part.shape[1:]).to(
                    pool[layer].device)
        self.page_slots[pages] = groups.to(self.page_slots.device)

    def _warn_full(self, wanted: int) -> None:
        if not self._warned_full:
            logger.warning("VeriCache compressed pool full (%d pages, %d more wanted): the "
                           "rest of those prefixes is drafted from the full KV", self.num_pages,
                           wanted - len(self._free))
            self._warned_full = True


def pool_bytes_per_token(compressor: KiviQuantizer, *, num_layers: int, kv_heads: int,
                         head_dim: int) -> float:
    """Device bytes the pool spends per context token, all layers: measured from the storages
    of a one-page pool of that geometry (on CPU), divided by the tokens a page holds."""
    geometry = SimpleNamespace(layer_num=num_layers, head_num=kv_heads, head_dim=head_dim,
                               device="cpu")
    pool = CompressedPagePool(compressor, geometry, num_pages=1)
    return pool.allocated_bytes() / pool.group


# Pages beyond one per group of slots, as a share: a request that shares a prefix only up to
# the middle of a page needs a page of its own for that group while the prefix's stays live.
SPLIT_PAGE_SHARE = 1 / 8


def pool_pages(compressor: KiviQuantizer, max_total_tokens: int) -> int:
    """Pages for a full KV pool of `max_total_tokens` slots (see `SPLIT_PAGE_SHARE`)."""
    groups = -(-max_total_tokens // compressor.plan(0).group)
    return math.ceil(groups * (1 + SPLIT_PAGE_SHARE))


ALLOCATOR_FREE = internal(ALLOCATOR, "free", "instance wrap", __name__)
ALLOCATOR_CLEAR = internal(ALLOCATOR, "clear", "instance wrap", __name__)
ALLOCATOR_FREE_PAGES = internal(PAGED_ALLOCATOR, "free_page_ids", "instance wrap", __name__)
"""The token allocator's frees: no free listener exists (docs/sglang-hooks.md)."""


def follow_frees(allocator, freed: Callable[[torch.Tensor], None],
                 cleared: Callable[[], None]) -> None:
    """Call `freed(slots)` for every device slot SGLang's `allocator` frees, and `cleared()`
    when it is reset: wrap the allocator instance's `free` (which `free_group_end` calls too)
    and `clear`, and with pages of more than one slot its `free_page_ids` too: a paged
    allocator's `free_segment` (a finished request's row, a tree node's eviction) and its free
    groups release pages through it without calling `free`. A paged allocator frees the whole
    page of any slot it is given, so every slot of those pages counts as freed."""
    page_size = getattr(allocator, "page_size", 1)

    def slots_of_pages(page_ids: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(page_size, device=page_ids.device)
        return (page_ids.to(torch.int64)[:, None] * page_size + offsets).flatten()

    def free_both(free: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        def wrapped(free_index: torch.Tensor) -> None:
            if allocator.free_group is None:  # a group's frees come back here at its end
                freed(free_index if page_size == 1 else
                      slots_of_pages(torch.unique(free_index // page_size)))
            free(free_index)
        return wrapped

    def clear_both(clear: Callable[[], None]) -> Callable[[], None]:
        def wrapped() -> None:
            cleared()
            clear()
        return wrapped

    def free_pages_both(free_page_ids: Callable[[torch.Tensor], None]
                        ) -> Callable[[torch.Tensor], None]:
        def wrapped(page_ids: torch.Tensor) -> None:
            # In a free group the ids wait for `free_group_end`, which releases them
            # without coming back here: their slots are the owner's no more either way.
            freed(slots_of_pages(page_ids))
            free_page_ids(page_ids)
        return wrapped

    ALLOCATOR_FREE.wrap(allocator, free_both)
    ALLOCATOR_CLEAR.wrap(allocator, clear_both)
    if page_size > 1:
        ALLOCATOR_FREE_PAGES.wrap(allocator, free_pages_both)
