"""KV-compression kernels: Triton on CUDA tensors, the torch reference everywhere else (and,
for decode attention on CPU tensors, a C++ kernel built on first use).

Callers (the compressors) use only the functions here, so one code path serves GPU serving and
CPU tests; the Triton modules are imported on first CUDA use, never on a CPU-only run.
"""

from __future__ import annotations

import torch

from . import layout
from .attention_cpu import decode_attention_cpu
from .attention_ref import (
    decode_attention_ref,
    dense_attention,
    merge_attention,
    soft_cap,
    tail_attention_ref,
)
from .layout import PackedKV, PagedKV
from .quant_ref import (
    SUPPORTED_BITS,
    dequantize_unpack_ref,
    pack_codes,
    quantize_pack_ref,
    unpack_codes,
)

__all__ = [
    "SUPPORTED_BITS",
    "PackedKV",
    "PagedKV",
    "decode_attention",
    "dense_attention",
    "dequantize_keys",
    "dequantize_unpack",
    "dequantize_values",
    "merge_attention",
    "pack_codes",
    "quantize_keys",
    "quantize_pack",
    "quantize_values",
    "soft_cap",
    "unpack_codes",
]


def quantize_pack(
    x: torch.Tensor, group: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, L] -> (codes uint8 [R, L*bits/8], scale fp16, zero fp16 [R, L/group])."""
    if x.is_cuda:
        from .quant_triton import quantize_pack_triton

        return quantize_pack_triton(x, group, bits)
    return quantize_pack_ref(x, group, bits)


def dequantize_unpack(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: int,
    bits: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of `quantize_pack`: codes [R, L*bits/8] -> x [R, L] in `dtype`."""
    if codes.is_cuda:
        from .quant_triton import dequantize_unpack_triton

        return dequantize_unpack_triton(codes, scale, zero, group, bits, dtype)
    return dequantize_unpack_ref(codes, scale, zero, group, bits, dtype)


def quantize_keys(keys: torch.Tensor, group: int, bits: int) -> layout.QKV:
    """Keys [n, H, D] per channel over token groups -> (codes, scale, zero); see `layout`."""
    return layout.quantize_keys(keys, group, bits, quantize_pack)


def quantize_values(values: torch.Tensor, v_group: int, bits: int) -> layout.QKV:
    """Values [n, H, D] per token over channel groups -> (codes, scale, zero); see `layout`."""
    return layout.quantize_values(values, v_group, bits, quantize_pack)


def dequantize_keys(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of `quantize_keys`."""
    return layout.dequantize_keys(codes, scale, zero, bits, dtype, dequantize_unpack)


def dequantize_values(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of `quantize_values`."""
    return layout.dequantize_values(codes, scale, zero, bits, dtype, dequantize_unpack)


def decode_attention(
    q: torch.Tensor,
    packed: PackedKV | PagedKV | None,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    res_lengths: torch.Tensor,
    sm_scale: float,
    tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query per request over packed K/V plus fp residual: (out, lse), float32.

    q [B, Hq, D]; packed: `PagedKV`, `PackedKV` (read as its pages) or None; k_res/v_res
    [B, R, H, D]; res_lengths [B]. `tail`: (k, v [B, T, H, D], head_lengths [B, Hq]), tokens
    after the residual of which query head j of request b sees the first head_lengths[b, j]
    (a round's drafts, each draft row seeing those up to its own). CUDA (Triton) and CPU (C++)
    kernels take all three parts in one call; without either, the reference's are merged.
    `logit_cap` > 0 softcaps the logits (Gemma 2): the reference serves it on every device (the
    Triton and C++ kernels take no cap yet).
    """
    paged = packed.as_paged() if isinstance(packed, PackedKV) else packed
    if logit_cap > 0:
        result = decode_attention_ref(q, paged, k_res, v_res, res_lengths, sm_scale, logit_cap)
        if tail is None:
            return result
        return merge_attention([result, tail_attention_ref(q, *tail, sm_scale, logit_cap)])
    if q.device.type == "cpu":
        result = decode_attention_cpu(q, paged, k_res, v_res, res_lengths, sm_scale, tail)
        if result is not None:
            return result
    if q.is_cuda:
        from .attention_triton import decode_attention_triton

        return decode_attention_triton(q, paged, k_res, v_res, res_lengths, sm_scale, tail)
    result = decode_attention_ref(q, paged, k_res, v_res, res_lengths, sm_scale)
    if tail is None:
        return result
    return merge_attention([result, tail_attention_ref(q, *tail, sm_scale)])
