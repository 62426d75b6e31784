"""SGLang's `mooncake` storage backend as VeriCache stores pages: one CacheGen stream per page.

The plugin registers `MooncakeBackend` under SGLang's own name `mooncake`, so
`--hicache-storage-backend mooncake` beside `--enable-vericache` gets it with SGLang's own flags
and extra config; a server without VeriCache gets SGLang's `MooncakeStore` itself.

With pages of a multiple of the codec group (`--page-size 64`) each page's CacheGen stream
(`pages.PageCoder`: the compressed pool's levels, then the exact K/V, digests keyed by the
stream's name `<key>_<rank>_c`) is stored as three objects: `<key>_<rank>_d`, the header and
the coarse lossy level, `_r`, the finer levels up to the compressed pool's (together what
drafting reads: about a fifth of a float32 page, half of a bf16 one), and `_x`, the exact part;
about 0.9 of the float32 bytes (0.75 of bf16) in all, instead of SGLang's two raw objects
`<key>_<rank>_k` and `_v`. A page is stored once its exact object is (it is written last). A
plain SGLang server on the same store finds no `_k` / `_v` objects for those pages and
prefills them: it skips them cleanly, and VeriCache skips the plain server's raw pages the
same way. Other page sizes are stored as SGLang stores them (raw, zero-copy).

Streams go through the store's byte `put` and ranged reads (the coded object's size is not the
page's, so SGLang's zero-copy reads into registered host pages do not apply): each object is
read in ranges sized from the measured link to fit Mooncake's read lease, so a slow link never
fails a read on `LEASE_EXPIRED` (`leased_reads.py`), as SGLang's batched reads of raw pages do
unless the master's lease is raised. A read fetches and
decodes several pages at once, one per codec process (`codec_worker.CodecPool`) and one more
fetching ahead, and writes them into the host pool in order. A page whose object is
missing, short, corrupted or foreign is a counted miss (`StoreStats`): the prefetch stops
there and the rest is prefilled. Only a corrupted page (a digest fails) is removed, to be
written again: servers of other configurations (dtype, compressor, page shape) share the
store's object names, and a page one of them wrote is another's foreign miss, left in place. A
plain read of another compressor's stream uses its exact KV and skips its codes
(`reloaded.py`). A put the store refuses (full: -200) is skipped and counted as
a write error; serving goes on. A store that dies while serving makes lookups fail (counted
read errors: the prefix is computed) and writes fail (counted, the rest of the batch skipped);
one that cannot be reached at startup is retried in the background (`reconnect.py`).

With `--vericache-early-drafting` a read answers SGLang's prefetch once the batch's drafting
levels are in and decoded: each page's coarse object, and its refinement where the measured
link allows (`link.py`). It fetches the rest behind, in order (`pending.py` keeps what waits
for it); a page whose exact part fails fails the batch's later pages at once, and the worker
recomputes the prefix from the first of them.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

from vericache_sglang.codec import StreamCorrupt, StreamError
from vericache_sglang.compress.quant import QuantTier
from vericache_sglang.config import served_config
from vericache_sglang.integration.internals import internal

from .codec_worker import CodecTimeout
from .leased_reads import LeasedReader
from .link import DraftingPlan
from .pages import PageCoder, PageWindow, fault_kind, store_reads_auto, vericache_compressor
from .reconnect import build_or_reconnect
from .state import StoreState, served_store_state

logger = logging.getLogger(__name__)

MOONCAKE_STORE = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store.MooncakeStore"
TAG_KEYS = internal(MOONCAKE_STORE, "_tag_keys", "private call", __name__)
"""SGLang's keys as its Mooncake backend names them (model and rank tags): a coded page's
objects are named beside them."""
BATCH_EXIST = internal(MOONCAKE_STORE, "_batch_exist", "private call", __name__)
"""One existence lookup for many objects, with the store's error codes."""

FULL = -200
"""Mooncake's put code for a store without room: a later page may fit once the master
evicts. Other codes (-800: the segment's holder is gone, -900: the master is) mean the store
cannot be reached, and the rest of the batch is not tried."""


class ExactPartLost(RuntimeError):
    """A page's exact part did not come: its object is missing, or an earlier page's failed."""


def master_unreachable(storage_config: HiCacheStorageConfig | None) -> str | None:
    """None when the Mooncake master named in SGLang's extra config (or `MOONCAKE_MASTER`)
    accepts a TCP connection within 2 s, else why not; None too when no address is given
    there (the backend finds its own, e.g. from a config file)."""
    extra = (storage_config.extra_config if storage_config else None) or {}
    address = extra.get("master_server_address") or os.environ.get("MOONCAKE_MASTER")
    if not address:
        return None
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except (OSError, ValueError) as error:
        return f"master {address}: {error}"
    return None


class MooncakeBackend(MooncakeStore):
    """What SGLang's factory builds for `mooncake`: VeriCache's store on a VeriCache server,
    SGLang's `MooncakeStore` itself on any other."""

    def __new__(cls, storage_config: HiCacheStorageConfig = None, mem_pool: Any = None):
        compressor = vericache_compressor()
        if compressor is None:
            return MooncakeStore(storage_config, mem_pool)
        state = served_store_state()  # on the scheduler thread: a retry builds in its own
        return build_or_reconnect(
            "mooncake",
            lambda: VeriCacheMooncakeStore(storage_config, mem_pool, state, compressor=compressor),
            lambda: master_unreachable(storage_config), state)


class VeriCacheMooncakeStore(MooncakeStore):
    """SGLang's Mooncake backend storing each page as one coded stream in three objects
    (coarse, refinement, exact: `_objects`)."""

    def __init__(self, storage_config: HiCacheStorageConfig, mem_pool: Any, state: StoreState,
                 compressor: str = "kivi:bits=4") -> None:
        super().__init__(storage_config, mem_pool)
        self.state = state
        """The server's store state: counts, the read-or-recompute choice, the link's rate,
        reloaded codes and pages waiting for their exact KV."""
        self.compressor = compressor
        self._coder: PageCoder | None = None
        self._window = PageWindow()
        self._reader: LeasedReader | None = None
        self._exact: ThreadPoolExecutor | None = None
        """With early drafting: fetches and decodes pages' exact parts behind their answer."""

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.state.admission.enabled = store_reads_auto()
        self.state.reloaded.bound_by(mem_pool_host)
        if self.is_mla_backend or self.should_split_heads:
            return
        self._coder = PageCoder.for_pool(mem_pool_host, self.compressor)
        if self._coder is None:
            logger.info("VeriCache Mooncake store: pages of %d token(s) stored raw, as SGLang "
                        "stores them (--page-size 64 codes them)", mem_pool_host.page_size)
            return
        self._window.start()
        self._reader = LeasedReader(self.store, self.state.link, sharing=self._window.in_flight)
        if served_config().vericache_early_drafting:
            self.state.pending.attach(mem_pool_host, self._coder.kv,
                                      deadline=served_config().vericache_store_timeout)
            self._exact = ThreadPoolExecutor(self._window.in_flight,
                                             thread_name_prefix="vericache-store-exact")
            logger.info("VeriCache Mooncake store: early drafting: a page answers SGLang's "
                        "prefetch once its drafting level is in; its exact part follows")
        logger.info("VeriCache Mooncake store: pages of %d tokens stored as CacheGen streams, "
                    "read %d at a time", mem_pool_host.page_size, self._window.in_flight)

    def _coded_keys(self, keys: list[str]) -> list[str]:
        """Each page's stream name; its objects are the name's `_d`, `_r` and `_x` forms
        (`_objects`)."""
        return [f"{key}_{self.mha_suffix}_c" for key in TAG_KEYS.call(self, keys)]

    @staticmethod
    def _objects(name: str) -> tuple[str, str, str]:
        """The coarse, refinement and exact objects of stream `name` (`PageCoder.split`)."""
        base = name.removesuffix("_c")
        return f"{base}_d", f"{base}_r", f"{base}_x"

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Stored pages at the front of `keys`, or none where recomputing them is measured to
        be faster (`--vericache-store-reads auto`)."""
        hits = (super().batch_exists(keys, extra_info) if self._coder is None
                else self._coded_hits(keys))
        return self.state.admission.pages_to_read(hits)

    def _coded_hits(self, keys: list[str]) -> int:
        names = self._coded_keys(keys)
        found = BATCH_EXIST.call(self, [self._objects(name)[2] for name in names])
        hits = next((i for i, f in enumerate(found) if f != 1), len(keys))
        if hits < len(keys) and found[hits] < 0:  # an error code: the store is unreachable
            self.state.stats.record("read_error", names[hits],
                                    f"lookup failed ({found[hits]})")
        return hits

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        if self._coder is None:
            return super().batch_set_v1(keys, host_indices, extra_info)
        page = self.mem_pool_host.page_size
        names = self._coded_keys(keys)
        stored = BATCH_EXIST.call(self, [self._objects(name)[2] for name in names])
        todo = [(name, host_indices[i * page].item()) for i, name in enumerate(names)
                if stored[i] != 1]
        coded = self._window.run(self._encode, todo)
        results = []
        for i, name in enumerate(names):
            if stored[i] == 1:
                results.append(True)
                continue
            try:
                blob, kv_bytes, seconds = next(coded).result()
            except CodecTimeout as e:  # the codec process hung (killed and replaced)
                self.state.stats.record("timeout", name, str(e))
                results.append(False)
                continue
            code = self._put(name, blob)
            if code != 0:
                self.state.stats.record("write_error", name,
                                        f"the store refused the page ({code})")
                results.append(False)
                if code != FULL:  # unreachable: the rest of the batch would wait just as long
                    results += [False] * (len(names) - len(results))
                    break
                continue
            self.state.stats.add("written", "coded", len(blob), kv_bytes, seconds)
            results.append(True)
        coded.close()
        return results

    def _put(self, name: str, blob: bytes) -> int:
        """Store stream `name` as its objects, the exact one last; Mooncake's code."""
        for obj, part in zip(self._objects(name), PageCoder.split(blob), strict=True):
            code = self.store.put(obj, part) if part else 0
            if code != 0:
                return code
        return 0

    def _get(self, obj: str) -> bytes | None:
        """Object `obj`, read in ranges that each fit the store's lease, however slow the
        link (`leased_reads.py`), and measured for the link (`link.py`)."""
        return self._reader.get(obj)

    def _encode(self, name: str, index: int) -> tuple[bytes, int, float]:
        """The stream of the host page at `index`, its KV bytes and the seconds coding took."""
        began = time.perf_counter()
        flat = self.mem_pool_host.get_data_page(index, flat=True)
        blob = self._coder.encode(flat, name)
        return blob, flat.numel() * flat.element_size(), time.perf_counter() - began

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        if self._coder is None:
            return super().batch_get_v1(keys, host_indices, extra_info)
        if self._exact is not None:
            return self._get_drafting(keys, host_indices)
        results = [False] * len(keys)
        for i, *_ in self._read_pages(keys, host_indices, self._read):
            results[i] = True
        return results

    def _read_pages(self, keys: list[str], host_indices: torch.Tensor,
                    read: Callable[[str, str], tuple[bytes | None, torch.Tensor | None, str]]
                    ) -> list[tuple[int, str, int, str, bytes]]:
        """`read(name, key)` of each page, several at once, written into its host page in
        order up to the first that fails (a counted fault; a corrupted stream is removed, to
        be written again by a later backup): (page, key, host index, name, bytes read) of
        each page written. A whole stream's read time feeds
        `--vericache-store-reads auto`."""
        page = self.mem_pool_host.page_size
        names = self._coded_keys(keys)
        done = []
        began = time.perf_counter()
        reads = self._window.run(read, list(zip(names, keys, strict=True)))
        for i, (name, key, future) in enumerate(zip(names, keys, reads, strict=True)):
            try:
                blob, target, form = future.result()
            except StreamError as e:
                self._fault(name, e)
                break
            except CodecTimeout as e:  # the codec process hung: the page may be fine
                self.state.stats.record("timeout", name, str(e))
                break
            if not blob:
                self.state.stats.record("missing", name, "the store has no such object")
                break
            index = host_indices[i * page].item()
            self.mem_pool_host.set_from_flat_data_page(index, target)
            now = time.perf_counter()
            seconds, began = now - began, now  # the page's share of the read: wall time
            self.state.stats.add("read", form, len(blob),
                                 target.numel() * target.element_size(), seconds)
            if form == "coded":
                self.state.admission.record_read(page, seconds)
            done.append((i, key, index, name, blob))
        reads.close()
        return done

    def _fault(self, name: str, error: StreamError) -> None:
        """Count stream `name`'s fault; remove its objects only where a digest failed (another
        configuration's page, or one cut short, stays)."""
        self.state.stats.record(fault_kind(error), name, str(error))
        if isinstance(error, StreamCorrupt):
            for part in self._objects(name):
                # Forced: this read's own get leased the objects, and Mooncake refuses to
                # remove a leased object (-706) until the lease runs out.
                self.store.remove(part, force=True)

    def _decode(self, blob: bytes, name: str, page_key: str | None,
                drafting: bool = False) -> tuple[torch.Tensor, list[QuantTier]]:
        """Stream `name`'s `blob` decoded (`PageCoder.decode`) into a new flat host page, and
        its pool-level codes; with `page_key` (the page's storage hash) they are offered for
        the page's reload (`reloaded.py`)."""
        target = self.mem_pool_host.get_dummy_flat_data_page()
        tiers = self._coder.decode(memoryview(blob), name, target, drafting=drafting)
        if page_key is not None:
            self.state.reloaded.decoded(page_key, tiers, self._coder.pool_level)
        return target, tiers

    def _read(self, name: str, page_key: str) -> tuple[bytes | None, torch.Tensor | None, str]:
        """Page `name`'s stream and its exact KV as a flat host page (None, None: an object
        is missing); raises `StreamError` for a stream that does not decode."""
        coarse, refinement, exact = self._objects(name)
        head = self._get(coarse)
        if not head:
            return None, None, "coded"
        parts = [head]
        if PageCoder.refinement_bytes(head):
            parts.append(self._get(refinement))
        parts.append(self._get(exact))
        if not all(parts):
            return None, None, "coded"
        blob = b"".join(parts)
        target, _ = self._decode(blob, name, page_key)
        return blob, target, "coded"

    def _get_drafting(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """Early drafting's read: answer each page once its drafting level is in and decoded
        (the host page gets the level's lossy reconstruction, the compressed pool its codes),
        and fetch the rest of its stream behind it (`pending.py`)."""
        results = [False] * len(keys)
        plan = DraftingPlan(len(keys), served_config().vericache_drafting_deadline,
                            self.state.link)
        answered = self._read_pages(
            keys, host_indices, lambda name, key: self._read_drafting(name, key, plan))
        for i, *_ in answered:
            results[i] = True
        if answered:
            logger.info("VeriCache store: %s", plan.report())
        # The exact parts follow once the batch's drafting parts are in: they would otherwise
        # share the link and the codec processes with them, and drafting would start later.
        broken = threading.Event()  # set by the batch's first page whose exact part failed
        for _, key, index, name, head in answered:
            self.state.pending.expect(
                key, index, self._exact.submit(self._read_exact, name, key, head, broken))
        return results

    def _read_drafting(self, name: str, page_key: str, plan: DraftingPlan
                       ) -> tuple[bytes | None, torch.Tensor | None, str]:
        """Page `name`'s coarse object, and its refinement where `plan` says the link allows,
        and the finer level's lossy reconstruction as a flat host page."""
        coarse, refinement, _ = self._objects(name)
        head = self._get(coarse)
        if not head:
            return None, None, "coarse"
        size = PageCoder.refinement_bytes(head)
        form = "coarse" if size else "drafting"  # one lossy level: the pool's
        if plan.refine(len(head), size):
            finer = self._get(refinement)
            if not finer:
                return None, None, "drafting"
            head, form = head + finer, "drafting"
        target, _ = self._decode(head, name, page_key, drafting=True)
        return head, target, form

    def _read_exact(self, name: str, page_key: str, head: bytes,
                    broken: threading.Event) -> tuple[torch.Tensor, list | None]:
        """Page `name`'s exact KV as a flat host page, from the rest of its stream after
        `head`, and its pool-level codes where `head` lacked the refinement (None otherwise;
        they are offered for the page's reload too). Raises when an object is missing or
        the stream does not decode (a counted fault), and for every later page of the batch
        without asking the store (`broken`): a store that died mid-stream costs one timeout,
        and the prefix is recomputed from that page on."""
        if broken.is_set():
            self.state.pending.poison()
            raise ExactPartLost("an earlier page's exact part failed")
        began = time.perf_counter()
        _, refinement, exact = self._objects(name)
        try:
            refine = PageCoder.refinement_bytes(head) > 0
            parts = [head, *([self._get(refinement)] if refine else []), self._get(exact)]
            if not all(parts):
                raise ExactPartLost("the store has no exact object")
            target, tiers = self._decode(b"".join(parts), name,
                                         page_key if refine else None)
        except Exception as e:
            broken.set()
            if isinstance(e, StreamError):
                self._fault(name, e)
            else:
                kind = ("missing" if isinstance(e, ExactPartLost)
                        else "timeout" if isinstance(e, CodecTimeout) else "read_error")
                self.state.stats.record(kind, name, str(e))
            self.state.pending.poison()
            raise
        seconds = time.perf_counter() - began
        if refine:
            self.state.stats.add("read", "refine", len(parts[1]), 0, 0.0)
        self.state.stats.add("read", "exact", len(parts[-1]), 0, seconds)
        return target, tiers if refine else None
