"""Torch implementations of the `sgl_kernel.kvcacheio` ops SGLang's HiCache calls for an MHA
model, served as `sgl_kernel.kvcacheio` on machines without a GPU.

HiCache copies KV rows between the device pool and its host pool: per layer when a prefix is
loaded back (the forward waits on that layer), all layers at once when a prefix is backed up.
The host side is a tensor; the device side arrives either as per-layer tensors or as a table of
per-layer base addresses (`k_data_ptrs`) whose rows are `item_size` bytes apart (SGLang checks
that before calling). Rows are token slots. Supported layouts: `layer_first` and `page_first`
with the `kernel` io backend, `layer_first` with `direct`. Any other op imports but raises,
naming itself.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from vericache_sglang.cpu.sgl_kernel_shim import missing_op


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A slot-major view of a pool buffer: one row per token slot."""
    return t.view(t.shape[0], -1)


def _raw_rows(address: int, rows: int, row_bytes: int) -> torch.Tensor:
    """`rows` rows of `row_bytes` bytes at a raw address, as a writable uint8 tensor view."""
    buffer = (ctypes.c_uint8 * (rows * row_bytes)).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(rows, row_bytes)


def _copy_rows(src: torch.Tensor, dst: torch.Tensor, src_indices: torch.Tensor,
               dst_indices: torch.Tensor) -> None:
    dst[dst_indices] = src[src_indices]


def _layer_rows(table: torch.Tensor, layer: int, indices: torch.Tensor,
                item_size: int) -> torch.Tensor:
    """Layer `layer` of a base-address table, as far as the highest row `indices` touch
    (`indices` is not empty)."""
    return _raw_rows(int(table[layer]), int(indices.max()) + 1, item_size)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return _rows(t).view(torch.uint8)


def transfer_kv_per_layer(src_k: torch.Tensor, dst_k: torch.Tensor, src_v: torch.Tensor,
                          dst_v: torch.Tensor, src_indices: torch.Tensor,
                          dst_indices: torch.Tensor, item_size: int, **_: object) -> None:
    """One layer, layer-first host pool -> device: rows src_indices -> dst_indices."""
    del item_size  # both sides are tensors whose rows are one token slot
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _copy_rows(_rows(src), _rows(dst), src_indices, dst_indices)


def transfer_kv_all_layer(src_k_layers: torch.Tensor, dst_k_layers: torch.Tensor,
                          src_v_layers: torch.Tensor, dst_v_layers: torch.Tensor,
                          src_indices: torch.Tensor, dst_indices: torch.Tensor,
                          item_size: int, num_layers: int, **_: object) -> None:
    """Every layer, between two base-address tables (device -> layer-first host pool)."""
    if src_indices.numel() == 0:
        return
    for src_table, dst_table in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
        for layer in range(num_layers):
            _copy_rows(_layer_rows(src_table, layer, src_indices, item_size),
                       _layer_rows(dst_table, layer, dst_indices, item_size),
                       src_indices, dst_indices)


def transfer_kv_per_layer_pf_lf(src_k: torch.Tensor, dst_k: torch.Tensor, src_v: torch.Tensor,
                                dst_v: torch.Tensor, src_indices: torch.Tensor,
                                dst_indices: torch.Tensor, layer_id: int, item_size: int,
                                src_layout_dim: int, **_: object) -> None:
    """One layer, page-first host pool ([slot, layer, ...]) -> device layer."""
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        slots = _as_bytes(src).view(-1, src_layout_dim)
        layer = slots[:, layer_id * item_size:(layer_id + 1) * item_size]
        _copy_rows(layer, _as_bytes(dst), src_indices, dst_indices)


def transfer_kv_all_layer_lf_pf(src_k_layers: torch.Tensor, dst_k: torch.Tensor,
                                src_v_layers: torch.Tensor, dst_v: torch.Tensor,
                                src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                item_size: int, dst_layout_dim: int, num_layers: int,
                                **_: object) -> None:
    """Every layer, device base-address table -> page-first host pool."""
    if src_indices.numel() == 0:
        return
    for src_table, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        slots = _as_bytes(dst).view(-1, dst_layout_dim)
        for layer in range(num_layers):
            _copy_rows(_layer_rows(src_table, layer, src_indices, item_size),
                       slots[:, layer * item_size:(layer + 1) * item_size],
                       src_indices, dst_indices)


def transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                       page_size: int) -> None:
    """Row copies between paired per-layer tensors (either direction)."""
    del page_size  # rows are copied one index at a time; pages need no special case
    if len(src_layers) != len(dst_layers):
        raise ValueError("transfer_kv_direct: source and destination layer counts differ")
    for src, dst in zip(src_layers, dst_layers, strict=True):
        _copy_rows(_rows(src), _rows(dst), src_indices, dst_indices)


IMPLEMENTED: dict[str, Callable] = {
    f.__name__: f
    for f in (transfer_kv_per_layer, transfer_kv_all_layer, transfer_kv_per_layer_pf_lf,
              transfer_kv_all_layer_lf_pf, transfer_kv_direct)
}


def __getattr__(name: str) -> Callable:
    if name.startswith("__"):
        raise AttributeError(name)
    op = missing_op(f"kvcacheio.{name}", IMPLEMENTED)
    globals()[name] = op
    return op
