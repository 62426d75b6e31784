"""The disk tier: SGLang's hierarchical cache over its `file` storage backend.

`--vericache-full-tier disk` keeps the host placement (the full KV pool in host memory, the
compressed pool on the device) and turns on SGLang's hierarchical cache with its file backend
below it: pages the radix tree evicts from the full KV pool are written through SGLang's own
`HiCacheStorage` interface, keyed by SGLang's chained page hashes, and a request whose prefix
is on disk gets it back through SGLang's prefetch and load-back, fewer tokens to prefill.
On a VeriCache server SGLang's `file` backend is VeriCache's (`stores/file.py`): pages coded
as CacheGen streams or raw with a digest, every read checked. The compressed pages of a
reloaded prefix are rebuilt from its reloaded full KV the first round a request drafts over it
(the compressed pool is keyed by full-pool slots, and a reload lands in new slots).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from vericache_sglang import startup
from vericache_sglang.config import get_config

logger = logging.getLogger(__name__)


def configure(server_args: Any) -> None:
    """With `--vericache-full-tier disk`, turn on SGLang's hierarchical cache over its `file`
    backend (VeriCache's on this server, see `stores/file.py`), in `--vericache-disk-dir`."""
    config = get_config(server_args)
    if not config.enable_vericache:
        return
    if (config.vericache_store_reads != "always" and config.vericache_full_tier != "disk"
            and not (server_args.enable_hierarchical_cache
                     and server_args.hicache_storage_backend is not None)):
        raise startup.error(
            f"--vericache-store-reads {config.vericache_store_reads} chooses between reading "
            "a KV store and recomputing: give one (--enable-hierarchical-cache "
            "--hicache-storage-backend file|mooncake, or --vericache-full-tier disk)")
    if (server_args.enable_hierarchical_cache and config.vericache_full_tier == "host"
            and server_args.hicache_storage_backend is not None):
        # One host pool: the full KV already lives in host memory (VeriCache's host tier); a
        # second copy in SGLang's host pool would double it (and with both at their defaults
        # SGLang finds no memory left for its pool).
        server_args.hicache_host_memory_mode = "buffer_only"
        logger.info("VeriCache with SGLang's hierarchical cache: the full KV lives in "
                    "VeriCache's host tier, SGLang's host memory only stages pages to and from "
                    "%s storage (--hicache-host-memory-mode buffer_only)",
                    server_args.hicache_storage_backend)
    if config.vericache_full_tier != "disk":
        return
    if server_args.hicache_storage_backend not in (None, "file"):
        raise startup.error(
            "--vericache-full-tier disk stores pages in files; do not "
            f"also pass --hicache-storage-backend {server_args.hicache_storage_backend}")
    # SGLang's host pool below ours is only a staging buffer between it and the files.
    server_args.enable_hierarchical_cache = True
    server_args.hicache_host_memory_mode = "buffer_only"
    server_args.hicache_storage_backend = "file"
    extra = _extra_config(server_args.hicache_storage_backend_extra_config)
    if config.vericache_disk_dir:
        server_args.hicache_storage_backend_extra_config = json.dumps(
            {**extra, "file_storage_path": config.vericache_disk_dir})
    logger.info("VeriCache disk tier: SGLang's hierarchical cache stores evicted pages in %s",
                config.vericache_disk_dir or extra.get("file_storage_path")
                or "SGLang's file-backend directory")


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
