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
import logging
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


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernel (built once per machine, then loaded from torch's extension
    cache), or None with a warning when it cannot be built."""
    from torch.utils import cpp_extension

    variant, flags = _vector_flags()
    try:
        return cpp_extension.load(f"vericache_decode_attention_cpu_{variant}", [str(SOURCE)],
                                  extra_cflags=["-O3", *flags], verbose=False)
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
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`decode_attention_ref`'s result from the kernel, or None if it is not available."""
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
    out, lse = kernel.decode_attention(
        q.float().contiguous(), pages, bits, group, v_group, k_res.float().contiguous(),
        v_res.float().contiguous(), res_lengths.to(torch.int32).contiguous(), float(sm_scale))
    return out, lse
