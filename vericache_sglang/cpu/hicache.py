"""SGLang's hierarchical cache (`--enable-hierarchical-cache`) on a machine without a GPU.

HiCache is plain SGLang's own host tier, the peer VeriCache is measured against. Two things
stop it without CUDA, both reached by plugin hooks (nothing of SGLang's is edited):

- its host pool registers its buffer with `cudaHostRegister`, and makes pinned scratch pages
  for storage reads; with no device to pin for, both are ordinary memory;
- its MHA host pool imports the `sgl_kernel.kvcacheio` transfer ops only on CUDA/ROCm; on CPU
  they are bound to the torch implementations in `kvcacheio_shim` before the pool is built.
"""

from __future__ import annotations

import sys
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from vericache_sglang.cpu import kvcacheio_shim
from vericache_sglang.integration.hooks import hook
from vericache_sglang.integration.internals import internal

ALLOC_TARGET = "sglang.srt.mem_cache.pool_host.common.alloc_with_host_register"
HOST_POOL_INIT = "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost.__init__"
TRANSFER_OPS = [internal("sglang.srt.mem_cache.pool_host.mha", name, "module attribute", __name__)
                for name in kvcacheio_shim.IMPLEMENTED]
"""The `sgl_kernel.kvcacheio` ops the MHA host pool's module imports only on CUDA/ROCm."""


def _unpinned(original, *args: Any, **kwargs: Any):
    """Nothing to pin host memory for without a GPU: allocate it as ordinary memory."""
    return original(*args, **{**kwargs, "pin_memory": False})


def _bind_transfer_ops(pool, *args: Any, **kwargs: Any) -> None:
    """Give the host pool's module the transfer ops it imports only on CUDA/ROCm."""
    module = sys.modules[type(pool).__module__]
    for touch in TRANSFER_OPS:
        touch.provide(module, kvcacheio_shim.IMPLEMENTED[touch.name])


def _record_unpinned(result: None, pool, *args: Any, **kwargs: Any) -> None:
    """The pool's buffer was allocated unpinned; its scratch pages (storage reads) must be too."""
    pool.pin_memory = False


def register() -> None:
    """Register the hooks (the plugin calls this only when SGLang's CPU engine is selected)."""
    hook(ALLOC_TARGET, _unpinned, HookType.AROUND)
    hook(HOST_POOL_INIT, _bind_transfer_ops, HookType.BEFORE)
    hook(HOST_POOL_INIT, _record_unpinned, HookType.AFTER)
