"""The KV pool on a CPU server, zeroed lazily: memory is taken as pages are written.

On a GPU the KV pool is device memory. On a CPU server it is host memory, and SGLang allocates
it with `torch.zeros`, which writes every byte: with VeriCache's host placement the full KV
pool covers what the compressed pool covers (273,239 tokens, 12.6 GB for the demo model in
float32), so starting took 10-20 s of memset and the server's resident memory was the whole
pool from the first second. Here the pool's buffers are anonymous memory maps instead, which
the kernel hands out zero-filled page by page as they are first written: the same zeros, the
same tensors, resident memory that grows with the KV actually held.

An AROUND hook on `MHATokenToKVPool._create_buffers_normal` (no allocator seam reaches a CPU
pool) runs SGLang's own code under a `TorchFunctionMode` that turns its CPU `torch.zeros`
calls of `MIN_BYTES` or more into such maps, on VeriCache servers only.
"""

from __future__ import annotations

import math
import mmap
from typing import Any

import torch
from sglang.srt.plugins.hook_registry import HookType
from torch.overrides import TorchFunctionMode

from vericache_sglang.config import served_config
from vericache_sglang.integration.hooks import hook

TARGET = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal"
MIN_BYTES = 1 << 24


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor over an anonymous map: no byte is touched until written."""
    nbytes = math.prod(shape) * dtype.itemsize
    # torch.frombuffer keeps the map alive as long as the tensor's storage.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class _LazyZeros(TorchFunctionMode):
    """Serve large CPU `torch.zeros(shape, dtype=..., device=...)` calls with `lazy_zeros`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and set(kwargs) <= {"dtype", "device"}:
            shape = tuple(args[0]) if len(args) == 1 and not isinstance(args[0], int) else args
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            device = torch.device(kwargs.get("device") or "cpu")
            if (device.type == "cpu" and all(isinstance(n, int) for n in shape)
                    and math.prod(shape) * dtype.itemsize >= MIN_BYTES):
                return lazy_zeros(shape, dtype)
        return func(*args, **kwargs)


def _lazily_zeroed(original, pool: Any, *args: Any, **kwargs: Any):
    if str(pool.device) != "cpu" or not served_config().enable_vericache:
        return original(pool, *args, **kwargs)
    with _LazyZeros():
        return original(pool, *args, **kwargs)


def register() -> None:
    """Register the hook (the plugin calls this only when SGLang's CPU engine is selected)."""
    hook(TARGET, _lazily_zeroed, HookType.AROUND)
