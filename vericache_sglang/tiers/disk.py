"""The disk tier: SGLang's HiCache storage layer with pages that prove their own integrity.

`--vericache-full-tier disk` keeps the host placement (the full KV pool in host memory, the
compressed pool on the device) and turns on SGLang's hierarchical cache with its file backend
below it: pages the radix tree evicts from the full KV pool are written through SGLang's own
`HiCacheStorage` interface, keyed by SGLang's chained page hashes, and a request whose prefix
is on disk gets it back through SGLang's prefetch and load-back, fewer tokens to prefill.
The compressed pages of a reloaded prefix are rebuilt from its reloaded full KV the first
round a request drafts over it (the compressed pool is keyed by full-pool slots, and a reload
lands in new slots), so the disk holds one form, the one verification needs.

SGLang's `HiCacheFile` stores raw bytes: a page file that was truncated is an error, and one
whose bytes changed would be loaded as KV, silently changing the output. `VerifiedFileStorage`
appends a digest of the page (keyed by the page's hash key, so a file copied over another
fails too) and checks it on every read. A page that is missing (deleted behind the server's
back), short, corrupted, or that cannot be written (full or read-only disk) is a miss: SGLang
stops the prefetch at that page and the rest of the prompt is prefilled, so the output is the
same. Each kind of fault is logged once and counted (`DISK_FAULTS`, `/metrics`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from vericache_sglang import startup
from vericache_sglang.config import get_config

logger = logging.getLogger(__name__)

DIGEST_BYTES = 16
FAULT_KINDS = ("missing", "short", "corrupt", "read_error", "write_error")


class DiskFaults:
    """Counts of disk-tier faults in this process, each kind logged the first time only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def record(self, kind: str, key: str, detail: str) -> None:
        with self._lock:
            first = self.counts[kind] == 0
            self.counts[kind] += 1
        if first:
            logger.warning("VeriCache disk tier: %s page %s (%s); that prefix is recomputed "
                           "from here on (logged once per kind, counted in "
                           "vericache:disk_faults)", kind, key[:16], detail)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {kind: self.counts[kind] for kind in FAULT_KINDS}


DISK_FAULTS = DiskFaults()


class VerifiedFileStorage(HiCacheFile):
    """SGLang's file backend, each page followed by a keyed digest that every read checks."""

    def __init__(self, storage_config: HiCacheStorageConfig, _kwargs: Any = None) -> None:
        super().__init__(storage_config)
        self._written: set[str] = set()
        self._written_lock = threading.Lock()
        # A page the size cap evicted is gone on purpose, not lost.
        on_evict = self._evictor._on_evict
        self._evictor._on_evict = lambda suffixed: self._evicted(suffixed, on_evict)

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

    def exists(self, key: str) -> bool:
        found = super().exists(key)
        if not found:
            with self._written_lock:
                lost = key in self._written
                self._written.discard(key)
            if lost:
                DISK_FAULTS.record("missing", key, "its file is gone")
        return found

    def get(self, key: str, target_location: torch.Tensor,
            target_sizes: Any = None) -> torch.Tensor | None:
        expected = target_location.numel() * target_location.element_size()
        record = bytearray(expected + DIGEST_BYTES + 1)
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                size = f.readinto(record)
        except FileNotFoundError:
            DISK_FAULTS.record("missing", key, "its file is gone")
            self._discard(key)
            return None
        except OSError as e:
            DISK_FAULTS.record("read_error", key, str(e))
            self._discard(key)
            return None
        if size != expected + DIGEST_BYTES:
            DISK_FAULTS.record("short", key, f"{size} bytes, expected {expected + DIGEST_BYTES}")
            self._discard(key)
            return None
        payload = memoryview(record)[:expected]
        if self._digest(key, payload) != bytes(record[expected:size]):
            DISK_FAULTS.record("corrupt", key, "digest mismatch")
            self._discard(key)
            return None
        target_location.view(torch.uint8).reshape(-1).copy_(
            torch.frombuffer(record, dtype=torch.uint8, count=expected))
        self._evictor.touch(self._get_suffixed_key(key), self._path(key))
        return target_location

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        payload = value.contiguous().view(torch.uint8).reshape(-1)
        digest = self._digest(key, memoryview(payload.numpy()))
        record = torch.cat([payload, torch.frombuffer(bytearray(digest), dtype=torch.uint8)])
        if not super().set(key, record):
            if not super().exists(key):
                DISK_FAULTS.record("write_error", key, f"could not write under {self.file_path}")
            return False
        with self._written_lock:
            self._written.add(key)
        return True


STORAGE_BACKEND = "dynamic"
"""How SGLang loads a backend it does not ship: by module and class from the extra config."""


def storage_extra_config(directory: str | None) -> dict[str, Any]:
    """`--hicache-storage-backend-extra-config` that makes SGLang load `VerifiedFileStorage`."""
    extra: dict[str, Any] = {"backend_name": "vericache_file", "module_path": __name__,
                             "class_name": VerifiedFileStorage.__name__}
    if directory:
        extra["file_storage_path"] = directory
    return extra


def configure(server_args: Any) -> None:
    """With `--vericache-full-tier disk`, turn on SGLang's hierarchical cache over the verified
    file store; with the host placement and SGLang's plain `file` backend, verify its pages too.
    """
    config = get_config(server_args)
    if not config.enable_vericache:
        return
    if server_args.enable_hierarchical_cache and config.vericache_full_tier != "disk":
        logger.info("VeriCache runs with SGLang's hierarchical cache: its host pool (and "
                    "storage, if given) sits below the full KV pool, and prefixes it reloads "
                    "get their compressed pages rebuilt the first round that drafts over them")
    if config.vericache_full_tier == "disk":
        if server_args.hicache_storage_backend not in (None, "file"):
            raise startup.error(
                "--vericache-full-tier disk stores pages in files; do not "
                f"also pass --hicache-storage-backend {server_args.hicache_storage_backend}")
        # SGLang's host pool below ours is only a staging buffer between it and the files.
        server_args.enable_hierarchical_cache = True
        server_args.hicache_host_memory_mode = "buffer_only"
    elif server_args.hicache_storage_backend != "file":
        return
    extra = _extra_config(server_args.hicache_storage_backend_extra_config)
    directory = config.vericache_disk_dir or extra.get("file_storage_path")
    server_args.hicache_storage_backend = STORAGE_BACKEND
    server_args.hicache_storage_backend_extra_config = json.dumps(
        {**extra, **storage_extra_config(directory)})
    logger.info("VeriCache disk tier: SGLang's hierarchical cache stores evicted pages in %s "
                "through VerifiedFileStorage (each page carries a digest checked on read)",
                directory or "SGLang's file-backend directory")


def _extra_config(raw: str | None) -> dict[str, Any]:
    if not raw:
        return {}
    if raw.startswith("@"):
        raise startup.error("give the disk tier's --hicache-storage-backend-extra-config as "
                            "inline JSON")
    try:
        extra = json.loads(raw)
    except json.JSONDecodeError as e:
        raise startup.error(f"--hicache-storage-backend-extra-config: {e}") from None
    if not isinstance(extra, dict):
        raise startup.error("--hicache-storage-backend-extra-config must be a JSON object")
    return extra
