"""KIVI layout of packed K/V, shared by the quantizers and the decode-attention kernels.

Keys are quantized per channel over groups of `group` consecutive tokens (outlier channels get
their own scale), values per token over groups of `v_group` channels. For n = num_groups * group
tokens, H KV heads, head dim D and b bits (pb = 8 // b values per byte):

  k_codes [num_groups, H, D, group // pb] uint8   k_scale, k_zero [num_groups, H, D] fp16
  v_codes [n, H, D // pb] uint8                   v_scale, v_zero [n, H, D // v_group] fp16

Both grow along dim 0 as groups are appended. `PackedKV` adds a leading batch dim (padded to the
longest request). `PagedKV` is the form decode attention reads: a pool of pages, one key group
of `group` tokens each, that requests address through a page table, so one kernel serves a
serving engine's page pool and a padded batch alike (`PackedKV.as_paged`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Quantize = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""(x [R, L], group, bits) -> (codes, scale, zero): `quantize_pack` or its reference."""
Dequantize = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, int, torch.dtype], torch.Tensor
]
"""(codes, scale, zero, group, bits, dtype) -> x [R, L]: `dequantize_unpack` or its reference."""

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def key_rows(keys: torch.Tensor, group: int) -> torch.Tensor:
    """[n, H, D] -> [n/group * H * D, group]: one row per (token group, head, channel)."""
    n, heads, dim = keys.shape
    rows = n // group * heads * dim
    return keys.reshape(n // group, group, heads, dim).permute(0, 2, 3, 1).reshape(rows, group)


def rows_to_keys(rows: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Inverse of `key_rows`."""
    group = rows.shape[1]
    num_groups = rows.shape[0] // (heads * dim)
    keys = rows.reshape(num_groups, heads, dim, group).permute(0, 3, 1, 2)
    return keys.reshape(num_groups * group, heads, dim)


def quantize_keys(keys: torch.Tensor, group: int, bits: int, quantize: Quantize) -> QKV:
    """[n, H, D] (n a multiple of group) -> k_codes, k_scale, k_zero in the layout above."""
    n, heads, dim = keys.shape
    codes, scale, zero = quantize(key_rows(keys, group), group, bits)
    meta = (n // group, heads, dim)
    return codes.reshape(*meta, group * bits // 8), scale.reshape(meta), zero.reshape(meta)


def dequantize_keys(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    dtype: torch.dtype,
    dequantize: Dequantize,
) -> torch.Tensor:
    """k_codes [NG, H, D, group/pb] -> keys [NG * group, H, D]."""
    _, heads, dim, width = codes.shape
    group = width * (8 // bits)
    rows = codes.shape[0] * heads * dim
    rows = dequantize(
        codes.reshape(rows, width), scale.reshape(rows, 1), zero.reshape(rows, 1), group, bits,
        dtype,
    )
    return rows_to_keys(rows, heads, dim)


def quantize_values(values: torch.Tensor, v_group: int, bits: int, quantize: Quantize) -> QKV:
    """[n, H, D] -> v_codes, v_scale, v_zero in the layout above."""
    n, heads, dim = values.shape
    codes, scale, zero = quantize(values.reshape(n * heads, dim), v_group, bits)
    meta = (n, heads, dim // v_group)
    return codes.reshape(n, heads, dim * bits // 8), scale.reshape(meta), zero.reshape(meta)


def dequantize_values(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    dtype: torch.dtype,
    dequantize: Dequantize,
) -> torch.Tensor:
    """v_codes [n, H, D/pb] -> values [n, H, D]."""
    n, heads, width = codes.shape
    dim = width * (8 // bits)
    rows = dequantize(
        codes.reshape(n * heads, width),
        scale.reshape(n * heads, scale.shape[-1]),
        zero.reshape(n * heads, zero.shape[-1]),
        dim // scale.shape[-1],
        bits,
        dtype,
    )
    return rows.reshape(n, heads, dim)


@dataclass(frozen=True)
class PackedKV:
    """A batch of packed K/V in the layout above, with a leading batch dim on every tensor."""

    k_codes: torch.Tensor
    """[B, NG, H, D, group // pb] uint8."""
    k_scale: torch.Tensor
    """[B, NG, H, D] fp16."""
    k_zero: torch.Tensor
    """[B, NG, H, D] fp16."""
    v_codes: torch.Tensor
    """[B, NG * group, H, D // pb] uint8."""
    v_scale: torch.Tensor
    """[B, NG * group, H, D // v_group] fp16."""
    v_zero: torch.Tensor
    """[B, NG * group, H, D // v_group] fp16."""
    lengths: torch.Tensor
    """[B] int32: quantized tokens per request, a multiple of `group`."""
    bits: int
    """Bits per code."""
    group: int
    """Tokens per key group."""
    v_group: int
    """Channels per value group."""

    def as_paged(self) -> PagedKV:
        """The same K/V as pages (views, for contiguous tensors): batch and groups flattened,
        request b owning pages b*NG .. b*NG + NG - 1."""
        batch, groups = self.k_codes.shape[:2]

        def pages(values: torch.Tensor) -> torch.Tensor:
            return values.reshape(batch * groups, self.group, *values.shape[2:])

        table = torch.arange(batch * groups, dtype=torch.int32, device=self.k_codes.device)
        return PagedKV(
            self.k_codes.flatten(0, 1), self.k_scale.flatten(0, 1), self.k_zero.flatten(0, 1),
            pages(self.v_codes), pages(self.v_scale), pages(self.v_zero),
            page_table=table.reshape(batch, groups), lengths=self.lengths, bits=self.bits,
            group=self.group, v_group=self.v_group,
        )


@dataclass(frozen=True)
class PagedKV:
    """Packed K/V of one layer as a pool of pages (one key group each) read via a page table."""

    k_codes: torch.Tensor
    """[P, H, D, group // pb] uint8: the key layout above, one page per group."""
    k_scale: torch.Tensor
    """[P, H, D] fp16."""
    k_zero: torch.Tensor
    """[P, H, D] fp16."""
    v_codes: torch.Tensor
    """[P, group, H, D // pb] uint8: the value layout above, cut into pages."""
    v_scale: torch.Tensor
    """[P, group, H, D // v_group] fp16."""
    v_zero: torch.Tensor
    """[P, group, H, D // v_group] fp16."""
    page_table: torch.Tensor
    """[B, max_pages] int32: each request's page ids in token order; entries past its
    lengths[b] // group pages are never read (any value, -1 included)."""
    lengths: torch.Tensor
    """[B] int32: quantized tokens per request, a multiple of `group`."""
    bits: int
    """Bits per code."""
    group: int
    """Tokens per key group, i.e. per page."""
    v_group: int
    """Channels per value group."""
