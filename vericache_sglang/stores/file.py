"""SGLang's `file` storage backend as VeriCache stores pages: coded, and proving their integrity.

The plugin registers `FileBackend` under SGLang's own name `file`
(`StorageBackendFactory.register_backend`), so `--hicache-storage-backend file` beside
`--enable-vericache` (and `--vericache-full-tier disk`, which turns it on) gets it with SGLang's
own flags and `--hicache-storage-backend-extra-config`; a server without VeriCache gets SGLang's
`HiCacheFile` itself.

A page is stored in one of two forms, chosen once from the host pool:

- **coded**: pages of a multiple of the codec's group (`--page-size 64`; SGLang's storage
  deployments use 32-64) are one CacheGen stream each (`vericache_sglang.codec`): the KIVI
  levels of the compressed pool, then the exact K/V bits, bound to the page's key by the
  stream's digests. The file is the page's exact KV in about 1.4 bytes per bf16 element (3.5 per
  float32) instead of 2 (4);
- **raw**: other page sizes (SGLang's default 1 token: too short for the codec's 32-token key
  groups) are the host pool's bytes followed by a digest keyed by the page's key.

SGLang's `HiCacheFile` stores raw bytes: a file that was truncated is an error, and one whose
bytes changed would be loaded as KV, silently changing the output. Here a page that is missing
(deleted behind the server's back), short, corrupted, another configuration's (a stream of
another dtype or page shape: file names do not say), unreadable, or that cannot be written
(full or read-only disk) is a miss: SGLang stops the prefetch at that page and the rest of the
prompt is prefilled, so the output is the same. Only a corrupted file (its digest fails) is
removed, to be written again; the others stay, whoever wrote them. Each kind of fault is
logged once and counted (the server's `StoreStats`, `vericache:disk_faults` on `/metrics`),
with the bytes and codec time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from vericache_sglang.codec import StreamError
from vericache_sglang.integration.internals import internal

from .codec_worker import CodecTimeout
from .pages import PageCoder, PageWindow, fault_kind, store_reads_auto, vericache_compressor
from .state import StoreState, served_store_state

logger = logging.getLogger(__name__)

EVICTOR = internal("sglang.srt.mem_cache.hicache_storage.HiCacheFile", "_evictor",
                   "private attribute", __name__, on_instances=True)
ON_EVICT = internal("sglang.srt.mem_cache.storage.file.lru_file_evictor.LRUFileEvictor",
                    "_on_evict", "instance wrap", __name__, on_instances=True)
"""The file backend's eviction callback: a page its size cap evicts is counted as evicted, not
lost (no eviction listener exists)."""

DIGEST_BYTES = 16


class FileBackend(HiCacheFile):
    """What SGLang's factory builds for `file`: VeriCache's store on a VeriCache server,
    SGLang's `HiCacheFile` itself on any other."""

    def __new__(cls, storage_config: HiCacheStorageConfig, *args: Any, **kwargs: Any):
        compressor = vericache_compressor()
        if compressor is None:
            return HiCacheFile(storage_config, *args, **kwargs)
        return VeriCacheFileStorage(storage_config, served_store_state(), compressor=compressor)


class VeriCacheFileStorage(HiCacheFile):
    """SGLang's file backend storing each page coded (or raw with a keyed digest), checking
    every read."""

    def __init__(self, storage_config: HiCacheStorageConfig, state: StoreState,
                 compressor: str = "kivi:bits=4"):
        super().__init__(storage_config)
        self.state = state
        """The server's store state: counts, the read-or-recompute choice, reloaded codes."""
        self.compressor = compressor
        self._coder: PageCoder | None = None
        self._window = PageWindow()
        self._page_tokens = 1
        self._written: set[str] = set()
        self._written_lock = threading.Lock()
        # A page the size cap evicted is gone on purpose, not lost.
        ON_EVICT.wrap(EVICTOR.get(self),
                      lambda on_evict: lambda suffixed: self._evicted(suffixed, on_evict))

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._coder = PageCoder.for_pool(mem_pool_host, self.compressor)
        page_size = getattr(mem_pool_host, "page_size", 1)
        self._page_tokens = page_size
        self.state.admission.enabled = store_reads_auto()
        self.state.reloaded.bound_by(mem_pool_host)
        if self._coder is not None:
            logger.info("VeriCache store: pages of %d tokens are stored as CacheGen streams "
                        "(levels %s bits, then the exact KV), coded by %d process(es)",
                        page_size, [sorted(set(level)) for level in self._coder.spec.levels],
                        self._window.start())
        else:
            logger.info("VeriCache store: pages of %d token(s) are stored raw with a digest; "
                        "--page-size 64 stores each page as one CacheGen stream", page_size)

    def _evicted(self, suffixed: str, then: Callable[[str], None] | None) -> None:
        with self._written_lock:
            self._written.discard(suffixed.removesuffix(self.config_suffix))
        if then is not None:
            then(suffixed)

    @staticmethod
    def _digest(key: str, payload: memoryview) -> bytes:
        return hashlib.blake2b(payload, digest_size=DIGEST_BYTES,
                               key=key.encode()[:64]).digest()

    def _path(self, key: str) -> str:
        return os.path.join(self.file_path, f"{self._get_suffixed_key(key)}.bin")

    def _discard(self, key: str) -> None:
        """Forget a bad page so that a later write stores it afresh."""
        with self._written_lock:
            self._written.discard(key)
        if self.metadata_cache is not None:
            self.metadata_cache.remove(self._get_suffixed_key(key))
        try:
            os.remove(self._path(key))
        except OSError:
            pass

    def _fault(self, kind: str, key: str, detail: str) -> None:
        """Count page `key`'s fault; forget a page that is gone, and remove a corrupted one
        (only a failed digest proves the bytes are not what their writer stored)."""
        self.state.stats.record(kind, key, detail)
        if kind in ("missing", "corrupt"):
            self._discard(key)

    def exists(self, key: str) -> bool:
        found = super().exists(key)
        if not found:
            with self._written_lock:
                lost = key in self._written
                self._written.discard(key)
            if lost:
                self.state.stats.record("missing", key, "its file is gone")
        return found

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Stored pages at the front of `keys`, or none where recomputing them is measured to
        be faster (`--vericache-store-reads auto`)."""
        return self.state.admission.pages_to_read(super().batch_exists(keys, extra_info))

    def _read(self, key: str, limit: int) -> bytearray | None:
        """The page file's bytes (at most `limit`), or None (a counted fault)."""
        record = bytearray(limit)
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                size = f.readinto(record)
        except FileNotFoundError:
            self._fault("missing", key, "its file is gone")
            return None
        except OSError as e:
            self._fault("read_error", key, str(e))
            return None
        del record[size:]
        return record

    def get(self, key: str, target_location: torch.Tensor,
            target_sizes: Any = None) -> torch.Tensor | None:
        began = time.perf_counter()
        loaded = self._load(key, target_location)
        if loaded is None:
            return None
        self._count_read(loaded, target_location, time.perf_counter() - began)
        return target_location

    def batch_get(self, keys: list[str], target_locations: list[torch.Tensor] | None = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Coded pages read and decoded side by side (`PageWindow`), in order up to the first
        that fails: SGLang's prefetch stops there, so the pages after it are not counted."""
        if self._coder is None or target_locations is None:
            return super().batch_get(keys, target_locations, target_sizes)
        results: list[torch.Tensor | None] = [None] * len(keys)
        began = time.perf_counter()
        loads = self._window.run(self._load, list(zip(keys, target_locations, strict=True)))
        for i, load in enumerate(loads):
            loaded = load.result()
            if loaded is None:
                break
            now = time.perf_counter()
            seconds, began = now - began, now  # the page's share of the batch: wall time
            self._count_read(loaded, target_locations[i], seconds)
            results[i] = target_locations[i]
        loads.close()
        return results

    def _count_read(self, loaded: tuple[str, int], target: torch.Tensor,
                    seconds: float) -> None:
        form, stored = loaded
        self.state.stats.add("read", form, stored, target.numel() * target.element_size(),
                             seconds)
        self.state.admission.record_read(self._page_tokens, seconds)

    def _load(self, key: str, target_location: torch.Tensor) -> tuple[str, int] | None:
        """Page `key` checked and written into `target_location`: its form and stored bytes,
        or None (a counted fault)."""
        expected = target_location.numel() * target_location.element_size()
        if self._coder is not None:
            # A stream is smaller than the raw page, bar a few header bytes on noise.
            record = self._read(key, 2 * expected + 4096)
            if record is None:
                return None
            try:
                tiers = self._coder.decode(memoryview(record), self._get_suffixed_key(key),
                                           target_location)
            except StreamError as e:
                self._fault(fault_kind(e), key, str(e))
                return None
            except CodecTimeout as e:  # the codec process hung: the file may be fine
                self.state.stats.record("timeout", key, str(e))
                return None
            self.state.reloaded.decoded(key, tiers, self._coder.pool_level)
            form = "coded"
        else:
            record = self._read(key, expected + DIGEST_BYTES + 1)
            if record is None:
                return None
            if len(record) != expected + DIGEST_BYTES:
                self._fault("short", key, f"{len(record)} bytes, expected "
                            f"{expected + DIGEST_BYTES}")
                return None
            payload = memoryview(record)[:expected]
            if self._digest(key, payload) != bytes(record[expected:]):
                self._fault("corrupt", key, "digest mismatch")
                return None
            target_location.view(torch.uint8).reshape(-1).copy_(
                torch.frombuffer(record, dtype=torch.uint8, count=expected))
            form = "raw"
        self._evictor.touch(self._get_suffixed_key(key), self._path(key))
        return form, len(record)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        if super().exists(key):  # SGLang's own fast path: the page is stored already
            return super().set(key, value)
        began = time.perf_counter()
        kv_bytes = value.numel() * value.element_size()
        if self._coder is not None:
            try:
                blob = self._coder.encode(value.contiguous(), self._get_suffixed_key(key))
            except CodecTimeout as e:
                self.state.stats.record("timeout", key, str(e))
                return False
            record, form = torch.frombuffer(bytearray(blob), dtype=torch.uint8), "coded"
        else:
            payload = value.contiguous().view(torch.uint8).reshape(-1)
            digest = self._digest(key, memoryview(payload.numpy()))
            record = torch.cat([payload, torch.frombuffer(bytearray(digest), dtype=torch.uint8)])
            form = "raw"
        seconds = time.perf_counter() - began
        if not super().set(key, record):
            if not super().exists(key):
                self.state.stats.record("write_error", key,
                                        f"could not write under {self.file_path}")
            return False
        with self._written_lock:
            self._written.add(key)
        self.state.stats.add("written", form, record.numel(), kv_bytes, seconds)
        return True

