"""Make SGLang's CPU engine start on a machine without a GPU, in every Python process.

SGLang's scheduler and detokenizer are spawned processes that import `sgl_kernel` and read
`SGLANG_USE_CPU_ENGINE` at module import, before any plugin hook runs. So `setup.sh` installs a
`.pth` file (`python -m vericache_sglang.cpu install`) that calls `install()` at interpreter
start; the plugin calls it too. Both steps do nothing where an NVIDIA GPU is present.

The finder serves `vericache_sglang.cpu.sgl_kernel_shim` as `sgl_kernel` and
`vericache_sglang.cpu.kvcacheio_shim` as `sgl_kernel.kvcacheio` and
`vericache_sglang.cpu.speculative_shim` as `sgl_kernel.speculative`. It is appended to the
*end* of `sys.meta_path`, so an installed sgl_kernel is always found first and never shadowed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

# name SGLang imports -> the module that stands in for it
SHIMS = {"sgl_kernel": "vericache_sglang.cpu.sgl_kernel_shim",
         "sgl_kernel.kvcacheio": "vericache_sglang.cpu.kvcacheio_shim",
         "sgl_kernel.speculative": "vericache_sglang.cpu.speculative_shim"}


def nvidia_gpu_present() -> bool:
    """Cheap check (no torch import): the NVIDIA driver exposes its control device."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


class SglKernelCpuFinder(importlib.abc.MetaPathFinder):
    """Last-resort finder for `sgl_kernel` on machines without a GPU."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102
        shim = SHIMS.get(fullname)
        if shim is None:
            return None
        origin = importlib.util.find_spec(shim).origin
        loader = importlib.machinery.SourceFileLoader(fullname, origin)
        return importlib.util.spec_from_file_location(fullname, origin, loader=loader)


def install() -> None:
    """Select SGLang's CPU engine and append the finder, once, where there is no GPU."""
    if nvidia_gpu_present():
        return
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if not any(isinstance(f, SglKernelCpuFinder) for f in sys.meta_path):
        sys.meta_path.append(SglKernelCpuFinder())
