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
(deleted behind the server's back), short, corrupted, undecodable, or that cannot be written
(full or read-only disk) is a miss: SGLang stops the prefetch at that page and the rest of the
prompt is prefilled, so the output is the same. Each kind of fault is logged once and counted
(`STORE_STATS`, `vericache:disk_faults` on `/metrics`), with the bytes and codec time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from vericache_sglang.codec import CodecSpec, StreamError, decode_chunk, encode_chunk
from vericache_sglang.codec.exact import FORMATS
from vericache_sglang.compress.kivi import Kivi
from vericache_sglang.compress.quant import KiviQuantizer
from vericache_sglang.compress.registry import parse_compressor_spec
from vericache_sglang.config import get_config

logger = logging.getLogger(__name__)

DIGEST_BYTES = 16
FAULT_KINDS = ("missing", "short", "corrupt", "read_error", "write_error")
CODED_LAYOUTS = ("layer_first", "page_first")
"""Host pool layouts whose flat page the coded form reads as [2, L, page, H, D] (or with page
and layer swapped)."""


class StoreStats:
    """This process's storage counts: faults by kind (each logged the first time only), and
    pages, bytes and codec seconds by direction and form."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.faults: Counter[str] = Counter()
        self.io: Counter[str] = Counter()

    def record(self, kind: str, key: str, detail: str) -> None:
        with self._lock:
            first = self.faults[kind] == 0
            self.faults[kind] += 1
        if first:
            logger.warning("VeriCache store: %s page %s (%s); that prefix is recomputed "
                           "from here on (logged once per kind, counted in "
                           "vericache:disk_faults)", kind, key[:16], detail)

    def add(self, direction: str, form: str, stored: int, kv: int, seconds: float) -> None:
        """One page `direction` ('written' or 'read') in `form`: `stored` bytes in the store
        for `kv` bytes of KV in the host pool."""
        with self._lock:
            self.io[f"{direction}_{form}_pages"] += 1
            self.io[f"{direction}_{form}_bytes"] += stored
            self.io[f"{direction}_kv_bytes"] += kv
            self.io[f"{direction}_codec_seconds"] += seconds

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"faults": {kind: self.faults[kind] for kind in FAULT_KINDS},
                    "io": dict(self.io)}


STORE_STATS = StoreStats()


class PageCoder:
    """The coded form of a host pool's pages: flat page (host layout) <-> codec stream."""

    def __init__(self, host_pool: Any, spec: CodecSpec) -> None:
        self.spec = spec
        self.dtype = host_pool.dtype
        self.page_first = host_pool.layout == "page_first"
        rows = (host_pool.page_size, host_pool.layer_num)
        self.shape = (2, *(rows if self.page_first else rows[::-1]),
                      host_pool.head_num, host_pool.head_dim)

    @classmethod
    def for_pool(cls, host_pool: Any, compressor_spec: str) -> PageCoder | None:
        """The coder for `host_pool`'s pages, or None where they are stored raw. The stream's
        lossy levels are the compressor's pool pages when it is a prefix-stable KIVI
        quantizer; otherwise (token droppers, mixed windows) 4-bit KIVI bins serve only as the
        exact part's predictor."""
        if (getattr(host_pool, "layout", None) not in CODED_LAYOUTS
                or not hasattr(host_pool, "head_num")
                or str(host_pool.dtype).removeprefix("torch.") not in FORMATS):
            return None
        compressor = parse_compressor_spec(compressor_spec)
        if not (isinstance(compressor, KiviQuantizer) and compressor.prefix_stable):
            compressor = Kivi(bits=4)
        spec = CodecSpec.for_compressor(compressor, host_pool.layer_num)
        if host_pool.page_size % spec.group:
            return None
        return cls(host_pool, spec)

    def _kv(self, flat: torch.Tensor) -> torch.Tensor:
        """[2, L, page, H, D] view of a flat page."""
        kv = flat.view(self.dtype).reshape(self.shape)
        return kv.transpose(1, 2) if self.page_first else kv

    def encode(self, flat: torch.Tensor, key: str) -> bytes:
        kv = self._kv(flat)
        return encode_chunk(kv[0], kv[1], self.spec, key.encode())

    def decode(self, blob: bytes | memoryview, key: str, target: torch.Tensor) -> None:
        """Decode the exact KV of `blob` into the flat page `target`."""
        chunk = decode_chunk(blob, key=key.encode())
        kv = self._kv(target)
        if chunk.keys.shape != kv.shape[1:] or chunk.keys.dtype != self.dtype:
            raise StreamError(f"the stream holds {tuple(chunk.keys.shape)} {chunk.keys.dtype}, "
                              f"the page is {tuple(kv.shape[1:])} {self.dtype}")
        kv[0].copy_(chunk.keys)
        kv[1].copy_(chunk.values)


def _vericache_compressor() -> str | None:
    """The compressor spec of the server this process runs, or None without VeriCache."""
    try:
        from sglang.srt.runtime_context import get_server_args

        config = get_config(get_server_args())
    except ValueError:  # "Global server args is not set yet!": not a server process
        return None
    return config.vericache_compressor if config.enable_vericache else None


class FileBackend(HiCacheFile):
    """What SGLang's factory builds for `file`: VeriCache's store on a VeriCache server,
    SGLang's `HiCacheFile` itself on any other."""

    def __new__(cls, storage_config: HiCacheStorageConfig, *args: Any, **kwargs: Any):
        compressor = _vericache_compressor()
        if compressor is None:
            return HiCacheFile(storage_config, *args, **kwargs)
        return VeriCacheFileStorage(storage_config, compressor=compressor)


class VeriCacheFileStorage(HiCacheFile):
    """SGLang's file backend storing each page coded (or raw with a keyed digest), checking
    every read."""

    def __init__(self, storage_config: HiCacheStorageConfig, compressor: str = "kivi:bits=4"):
        super().__init__(storage_config)
        self.compressor = compressor
        self._coder: PageCoder | None = None
        self._written: set[str] = set()
        self._written_lock = threading.Lock()
        # A page the size cap evicted is gone on purpose, not lost.
        on_evict = self._evictor._on_evict
        self._evictor._on_evict = lambda suffixed: self._evicted(suffixed, on_evict)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._coder = PageCoder.for_pool(mem_pool_host, self.compressor)
        page_size = getattr(mem_pool_host, "page_size", 1)
        if self._coder is not None:
            logger.info("VeriCache store: pages of %d tokens are stored as CacheGen streams "
                        "(levels %s bits, then the exact KV)", page_size,
                        [sorted(set(level)) for level in self._coder.spec.levels])
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
        STORE_STATS.record(kind, key, detail)
        self._discard(key)

    def exists(self, key: str) -> bool:
        found = super().exists(key)
        if not found:
            with self._written_lock:
                lost = key in self._written
                self._written.discard(key)
            if lost:
                STORE_STATS.record("missing", key, "its file is gone")
        return found

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
        expected = target_location.numel() * target_location.element_size()
        began = time.perf_counter()
        if self._coder is not None:
            # A stream is smaller than the raw page, bar a few header bytes on noise.
            record = self._read(key, 2 * expected + 4096)
            if record is None:
                return None
            try:
                self._coder.decode(memoryview(record), self._get_suffixed_key(key),
                                   target_location)
            except StreamError as e:
                self._fault("short" if "truncated" in str(e) else "corrupt", key, str(e))
                return None
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
        STORE_STATS.add("read", form, len(record), expected, time.perf_counter() - began)
        return target_location

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        if super().exists(key):  # SGLang's own fast path: the page is stored already
            return super().set(key, value)
        began = time.perf_counter()
        kv_bytes = value.numel() * value.element_size()
        if self._coder is not None:
            blob = self._coder.encode(value.contiguous(), self._get_suffixed_key(key))
            record, form = torch.frombuffer(bytearray(blob), dtype=torch.uint8), "coded"
        else:
            payload = value.contiguous().view(torch.uint8).reshape(-1)
            digest = self._digest(key, memoryview(payload.numpy()))
            record = torch.cat([payload, torch.frombuffer(bytearray(digest), dtype=torch.uint8)])
            form = "raw"
        seconds = time.perf_counter() - began
        if not super().set(key, record):
            if not super().exists(key):
                STORE_STATS.record("write_error", key,
                                   f"could not write under {self.file_path}")
            return False
        with self._written_lock:
            self._written.add(key)
        STORE_STATS.add("written", form, record.numel(), kv_bytes, seconds)
        return True


def register() -> None:
    """Have SGLang's storage factory build `file` through `FileBackend` (the plugin calls this
    in every process; SGLang logs that the name is overwritten)."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    StorageBackendFactory.register_backend("file", __name__, FileBackend.__name__)
