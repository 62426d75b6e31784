"""Decode attention on CPU tensors: a C++ kernel (`csrc/decode_attention_cpu.cpp`) that
dequantizes each page on read, built on first use by torch's extension loader.

Why: on a CPU the torch reference dequantizes every chunk of context into float32 buffers and
makes about ten passes over them per layer and draft step, so a forward over the 4-bit tier
cost about twice a plain decode step. The kernel reads the codes once. Contract as in
`attention_ref.decode_attention_ref`, which stays the oracle its tests compare against. If the
kernel cannot be built here (no compiler, say), the reference serves, with one warning:
slower, same contract.
setup.sh builds it, so that no server waits for the compiler.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

from .layout import PagedKV

SOURCE = Path(__file__).parent / "csrc" / "decode_attention_cpu.cpp"
logger = logging.getLogger(__name__)


def _vector_flags() -> tuple[str, list[str]]:
    """AVX2 and FMA where this CPU has them (read at run time, so a build never uses an
    instruction the machine lacks); the variant names the build."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "base", []


def _build_directory(name: str) -> Path:
    """Torch's extension folder ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions)."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(base) / "vericache" / name


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernel, or None with a warning when it cannot be built.

    A build is named by a digest of the source, flags, torch and Python versions. An existing
    build is imported directly: torch's loader takes a lock file and runs ninja on every load,
    and a server killed inside that window would leave every later one waiting on the lock."""
    variant, flags = _vector_flags()
    cflags = ["-O3", *flags]
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), *cflags, torch.__version__,
                                        sys.version]).encode()).hexdigest()[:16]
    name = f"vericache_decode_attention_cpu_{variant}_{digest}"
    directory = _build_directory(name)
    built = directory / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    try:
        if built.is_file():
            spec = importlib.util.spec_from_file_location(name, built)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(name, [str(SOURCE)], extra_cflags=cflags,
                                  build_directory=str(directory), verbose=False)
    except Exception as error:  # a missing compiler or headers: fall back, do not fail serving
        logger.warning("vericache: the CPU attention kernel could not be built (%s); using "
                       "the torch reference", str(error).splitlines()[0] if str(error) else error)
        return None


def decode_attention_cpu(
    q: torch.Tensor,
    paged: PagedKV | None,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    res_lengths: torch.Tensor,
    sm_scale: float,
    tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`vericache_kernels.decode_attention`'s result from the kernel, in one call, or None if
    the kernel is not available."""
    kernel = load()
    if kernel is None:
        return None
    pages = [] if paged is None else [
        t.contiguous() for t in (paged.k_codes, paged.k_scale, paged.k_zero, paged.v_codes,
                                 paged.v_scale, paged.v_zero,
                                 paged.page_table.to(torch.int32), paged.lengths.to(torch.int32))
    ]
    bits, group, v_group = (0, 0, 0) if paged is None else (paged.bits, paged.group,
                                                           paged.v_group)
    tail_parts = [] if tail is None else [tail[0].float().contiguous(),
                                          tail[1].float().contiguous(),
                                          tail[2].to(torch.int32).contiguous()]
    out, lse = kernel.decode_attention(
        q.float().contiguous(), pages, bits, group, v_group, k_res.float().contiguous(),
        v_res.float().contiguous(), res_lengths.to(torch.int32).contiguous(), float(sm_scale),
        tail_parts)
    return out, lse
