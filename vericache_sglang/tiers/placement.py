"""`--vericache-full-tier auto` (the default): where the full KV lives, chosen at startup.

- **A GPU (or any device but a CPU): `device`.** The host tier's copy engine (pinned gather
  buffers, a copy stream, one event per layer; `tiers/copy_engine.py`) passed the device check
  on an H200, but no server has streamed the full KV through it on a GPU yet, and the
  performance model (docs/perfmodel.md) predicts a host link slower than HBM wherever the full
  KV fits the device: the full KV stays in SGLang's own device pool beside the compressed pool.
- **SGLang's hierarchical cache with a storage backend: `host`.** The full KV then lives in
  one host pool, VeriCache's host tier, and SGLang's host memory only stages pages to and from
  the store (`tiers/disk.py`); with `device`, SGLang's own host pool would hold a second copy
  (at the defaults it finds no memory left for it).
- **Otherwise, on a CPU: `device`.** There "device" and "host" are the same memory: the host
  tier saves none of it, and streaming the full KV through a staging area costs every verify
  forward a copy. Measured by `python -m bench.placement` (docs/memory.md, "placement").
- **`--vericache-full-tier-budget` or `--vericache-staging-budget` given: `host`**, the
  placement they size.

The startup log says which placement runs and why; `/server_info` shows it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from sglang.srt.runtime_context import get_platform

from vericache_sglang import startup
from vericache_sglang.config import VeriCacheConfigError, attach_config, get_config

logger = logging.getLogger(__name__)


def choose(server_args: Any) -> tuple[str, str]:
    """The placement `auto` stands for on this server, and why."""
    config = get_config(server_args)
    device = server_args.device or ("cuda" if get_platform().is_cuda else "cpu")
    if device != "cpu":
        return "device", (f"on {device} no server has streamed the full KV from the host tier "
                          "yet, so it stays in SGLang's device pool")
    if config.vericache_full_tier_budget is not None or config.vericache_staging_budget is not None:
        return "host", "--vericache-full-tier-budget or --vericache-staging-budget sizes it"
    if server_args.enable_hierarchical_cache and server_args.hicache_storage_backend is not None:
        return "host", ("with HiCache storage the full KV lives in one host pool (VeriCache's "
                        "host tier; SGLang's host memory only stages pages)")
    return "device", ("on a CPU device and host memory are the same RAM: the host tier would "
                      "save none and copy the full KV every verification")


def resolve(server_args: Any) -> None:
    """Replace `auto` in the server's VeriCache settings by the placement it stands for."""
    config = get_config(server_args)
    if not config.enable_vericache or config.vericache_full_tier != "auto":
        return
    placement, why = choose(server_args)
    try:
        config = dataclasses.replace(config, vericache_full_tier=placement)
    except VeriCacheConfigError as e:
        raise startup.error(f"{e} (--vericache-full-tier auto chose {placement}: {why})") from None
    attach_config(server_args, config)
    logger.info("VeriCache full tier: %s (--vericache-full-tier auto: %s)", placement, why)
