"""Torch reference for packed asymmetric quantization: the CPU path and the Triton kernels' oracle.

Format (shared with `quant_triton`): a matrix x [rows, length] is cut along `length` into groups
of `group` elements. Each (row, group) stores an fp16 `zero` = min and an fp16 `scale` =
(max - min) / (2**bits - 1); codes are round((x - zero) / scale) clamped to [0, 2**bits - 1],
computed with the fp16-rounded scale and zero so that dequantization uses exactly what was
stored. Codes are packed 8 // bits per uint8, element j of a byte at bit offset j * bits.
Rounding is floor(y + 0.5) in float32 in both implementations so they agree bit for bit.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (2, 4, 8)


def check_packing(length: int, group: int, bits: int) -> None:
    """Reject shapes the packed format cannot hold, before any kernel sees them."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    per_byte = 8 // bits
    if group <= 0 or length % group or group % per_byte:
        raise ValueError(
            f"cannot pack rows of {length} into groups of {group} at {bits} bits: the group must "
            f"divide the row and be a multiple of {per_byte}"
        )


def quantize_pack_ref(
    x: torch.Tensor, group: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, L] -> (codes uint8 [R, L*bits/8], scale fp16 [R, L/group], zero fp16 [R, L/group])."""
    rows, length = x.shape
    check_packing(length, group, bits)
    qmax = (1 << bits) - 1
    xf = x.float().reshape(rows, length // group, group)
    lo, hi = xf.amin(-1), xf.amax(-1)
    scale = ((hi - lo) / qmax).half()
    zero = lo.half()
    step = scale.float()
    step = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.floor((xf - zero.float()[..., None]) / step[..., None] + 0.5).clamp_(0, qmax)
    return pack_codes(codes.to(torch.int32).reshape(rows, length), bits), scale, zero


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes [..., L] in [0, 2**bits) -> packed uint8 [..., L*bits/8] (the layout above)."""
    per_byte = 8 // bits
    lanes = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    # one shift-or per lane: a sum over a last dimension of 1-4 lanes is a slow reduction
    packed = lanes[..., 0].clone()
    for lane in range(1, per_byte):
        packed |= lanes[..., lane] << (lane * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: packed uint8 [..., W] -> uint8 codes [..., W * 8 // bits]."""
    lanes = [(packed >> (lane * bits)) & ((1 << bits) - 1) for lane in range(8 // bits)]
    return torch.stack(lanes, -1).reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


def dequantize_unpack_ref(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: int,
    bits: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of `quantize_pack_ref`: codes [R, L*bits/8] -> x [R, L] in `dtype`."""
    per_byte = 8 // bits
    rows, length = codes.shape[0], codes.shape[1] * per_byte
    check_packing(length, group, bits)
    # Decode attention dequantizes every chunk of context per step with this, so: one float32
    # buffer, each lane unpacked straight into it, scaled in place (same float32 ops as Triton).
    out = torch.empty(rows, codes.shape[1], per_byte, dtype=torch.float32, device=codes.device)
    for lane in range(per_byte):
        out[..., lane] = (codes >> (lane * bits)) & ((1 << bits) - 1)
    out = out.reshape(rows, length // group, group)
    out.mul_(scale.float()[..., None]).add_(zero.float()[..., None])
    return out.reshape(rows, length).to(dtype)
