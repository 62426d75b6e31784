"""Triton quantize+pack and unpack+dequantize kernels; format and rounding as in `quant_ref`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_ref import check_packing

BLOCK_ROWS = 16


@triton.jit
def unpack_codes(packed, shift, BITS: tl.constexpr):
    """Codes at bit offset `shift` of int32 bytes; shared with the decode-attention kernel."""
    return (packed >> shift) & ((1 << BITS) - 1)


@triton.jit
def _quantize_pack_kernel(
    x_ptr, codes_ptr, scale_ptr, zero_ptr, n_rows, row_len,
    GROUP: tl.constexpr, BITS: tl.constexpr, PER_BYTE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
):
    # One program: BLOCK_R rows x one group, seen as [rows, bytes of the group, lanes of a byte].
    group_id = tl.program_id(1)
    # int64: a layer's keys of a long batch pass 2**31 elements
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    byte = tl.arange(0, BLOCK_B)
    lane = tl.arange(0, PER_BYTE)
    within = byte[:, None] * PER_BYTE + lane[None, :]
    row_ok = rows < n_rows
    mask = row_ok[:, None, None] & (within < GROUP)[None, :, :]
    offs = rows[:, None, None] * row_len + group_id * GROUP + within[None, :, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    hi = tl.max(tl.max(tl.where(mask, x, float("-inf")), 2), 1)
    lo = tl.min(tl.min(tl.where(mask, x, float("inf")), 2), 1)
    hi = tl.where(row_ok, hi, 0.0)
    lo = tl.where(row_ok, lo, 0.0)
    qmax = (1 << BITS) - 1
    # div_rn: IEEE division as torch does; `/` compiles to an approximate one on a GPU, which
    # moved a few codes per million across a rounding boundary (device check, H200)
    scale = tl.div_rn(hi - lo, tl.full([BLOCK_R], qmax, tl.float32)).to(tl.float16)
    zero = lo.to(tl.float16)
    step = scale.to(tl.float32)
    step = tl.where(step > 0, step, 1.0)
    q = tl.floor(tl.div_rn(x - zero.to(tl.float32)[:, None, None], step[:, None, None]) + 0.5)
    q = tl.minimum(tl.maximum(q, 0.0), qmax).to(tl.int32)
    packed = tl.sum(q << (lane * BITS)[None, None, :], 2)
    bytes_per_group = GROUP // PER_BYTE
    out = rows[:, None] * (row_len // PER_BYTE) + group_id * bytes_per_group + byte[None, :]
    out_mask = row_ok[:, None] & (byte < bytes_per_group)[None, :]
    tl.store(codes_ptr + out, packed.to(tl.uint8), mask=out_mask)
    meta = rows * (row_len // GROUP) + group_id
    tl.store(scale_ptr + meta, scale, mask=row_ok)
    tl.store(zero_ptr + meta, zero, mask=row_ok)


@triton.jit
def _dequantize_kernel(
    codes_ptr, scale_ptr, zero_ptr, out_ptr, n_rows, row_len,
    GROUP: tl.constexpr, BITS: tl.constexpr, PER_BYTE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, OUT_BF16: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    byte = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    lane = tl.arange(0, PER_BYTE)
    n_bytes = row_len // PER_BYTE
    byte_mask = (rows < n_rows)[:, None] & (byte < n_bytes)[None, :]
    packed = tl.load(codes_ptr + rows[:, None] * n_bytes + byte[None, :], mask=byte_mask, other=0)
    q = unpack_codes(packed.to(tl.int32)[:, :, None], (lane * BITS)[None, None, :], BITS)
    col = (byte[:, None] * PER_BYTE + lane[None, :])[None, :, :]
    mask = byte_mask[:, :, None] & (lane < PER_BYTE)[None, None, :]
    meta = rows[:, None, None] * (row_len // GROUP) + col // GROUP
    scale = tl.load(scale_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    out = q.to(tl.float32) * scale + zero
    offs = rows[:, None, None] * row_len + col
    if OUT_BF16:
        # Round to nearest even with integer ops, as torch does; the interpreter's float cast
        # truncates instead, and this keeps GPU, interpreter and reference bit-identical.
        bits = out.to(tl.int32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        tl.store(out_ptr + offs, (bits >> 16).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_pack_triton(
    x: torch.Tensor, group: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `quant_ref.quantize_pack_ref`."""
    rows, length = x.shape
    check_packing(length, group, bits)
    x = x.contiguous()
    codes = torch.empty(rows, length * bits // 8, dtype=torch.uint8, device=x.device)
    scale = torch.empty(rows, length // group, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    if rows:
        per_byte = 8 // bits
        grid = (triton.cdiv(rows, BLOCK_ROWS), length // group)
        _quantize_pack_kernel[grid](
            x, codes, scale, zero, rows, length,
            GROUP=group, BITS=bits, PER_BYTE=per_byte, BLOCK_R=BLOCK_ROWS,
            BLOCK_B=triton.next_power_of_2(group // per_byte),
        )
    return codes, scale, zero


def dequantize_unpack_triton(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: int,
    bits: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Same contract as `quant_ref.dequantize_unpack_ref`."""
    per_byte = 8 // bits
    rows, length = codes.shape[0], codes.shape[1] * per_byte
    check_packing(length, group, bits)
    out = torch.empty(rows, length, dtype=dtype, device=codes.device)
    if rows:
        block_b = min(64, triton.next_power_of_2(codes.shape[1]))
        grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(codes.shape[1], block_b))
        bf16 = dtype == torch.bfloat16
        _dequantize_kernel[grid](
            codes.contiguous(), scale.contiguous(), zero.contiguous(),
            out.view(torch.int16) if bf16 else out, rows, length,
            GROUP=group, BITS=bits, PER_BYTE=per_byte, BLOCK_R=BLOCK_ROWS, BLOCK_B=block_b,
            OUT_BF16=bf16,
        )
    return out
