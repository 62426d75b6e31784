"""The torch stand-ins for the sgl_kernel ops SGLang's CPU engine calls, and the finder that
provides them only where no real sgl_kernel exists."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from vericache_sglang.cpu import sgl_kernel_shim as shim


def test_assign_req_to_token_pool_writes_each_segment():
    req_to_token = torch.zeros((4, 10), dtype=torch.int32)
    req_pool_indices = torch.tensor([2, 0])
    start = torch.tensor([3, 0])
    end = torch.tensor([5, 4])
    out_cache_loc = torch.tensor([11, 12, 21, 22, 23, 24])
    shim.assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start, end,
                                      out_cache_loc, req_to_token.shape[1])
    expected = torch.zeros((4, 10), dtype=torch.int32)
    expected[2, 3:5] = torch.tensor([11, 12])
    expected[0, 0:4] = torch.tensor([21, 22, 23, 24])
    assert torch.equal(req_to_token, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer(dtype):
    buffers = [torch.randn(16, 3, 8).to(dtype) for _ in range(3)]
    before = [b.clone() for b in buffers]
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b[0].nbytes for b in buffers], dtype=torch.int64)
    # Overlapping move, as after verification: rows 5,6,7 -> 4,5,6 (source 5 is also a target).
    tgt = torch.tensor([4, 5, 6])
    src = torch.tensor([5, 6, 7])
    shim.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)
    for b, old in zip(buffers, before, strict=True):
        expected = old.clone()
        expected[tgt] = old[src]
        assert torch.equal(b, expected)


def test_fill_accept_out_cache_loc_compacts_accepted_slots():
    accept_index = torch.tensor([0, 1, -1, 3, -1, 5])
    out_cache_loc = torch.tensor([100, 101, 102, 103, 104, 105])
    accept_out = torch.full((6,), -7)
    shim.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out)
    assert accept_out.tolist() == [100, 101, 103, 105, -7, -7]


def test_unimplemented_op_imports_but_fails_naming_itself():
    from sgl_kernel import build_tree_kernel_efficient_cpu

    with pytest.raises(NotImplementedError, match="sgl_kernel.build_tree_kernel_efficient_cpu"):
        build_tree_kernel_efficient_cpu()


def test_shim_serves_sgl_kernel_here():
    import sgl_kernel

    assert getattr(sgl_kernel, "IS_VERICACHE_CPU_SHIM", False)


def test_real_sgl_kernel_is_never_shadowed(tmp_path):
    """An installed sgl_kernel (here a stand-in package on sys.path) wins over the shim."""
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import sgl_kernel
        print(getattr(sgl_kernel, "REAL", False), hasattr(sgl_kernel, "IS_VERICACHE_CPU_SHIM"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


# HiCache's transfer ops (sgl_kernel.kvcacheio). A pool buffer holds one row per token slot;
# the device side of the all-layer ops is a table of per-layer base addresses.
LAYERS, SLOTS, HEADS, DIM = 3, 12, 2, 4
SRC = torch.tensor([1, 5, 6, 9])
DST = torch.tensor([7, 0, 3, 10])


def _layers() -> list[torch.Tensor]:
    return [torch.randn(SLOTS, HEADS, DIM) for _ in range(LAYERS)]


def _table(layers: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)


def test_kvcacheio_is_served_and_names_missing_ops():
    from sgl_kernel import kvcacheio

    kvcacheio.transfer_kv_direct  # noqa: B018 (resolves to the torch implementation)
    with pytest.raises(NotImplementedError, match="sgl_kernel.kvcacheio.transfer_kv_per_layer_mla"):
        kvcacheio.transfer_kv_per_layer_mla()


def test_per_layer_and_direct_copy_rows_between_layer_tensors():
    from sgl_kernel import kvcacheio

    src_k, src_v, dst_k, dst_v = (torch.randn(SLOTS, HEADS, DIM) for _ in range(4))
    want_k, want_v = dst_k.clone(), dst_v.clone()
    want_k[DST], want_v[DST] = src_k[SRC], src_v[SRC]
    kvcacheio.transfer_kv_per_layer(src_k=src_k, dst_k=dst_k, src_v=src_v, dst_v=dst_v,
                                    src_indices=SRC, dst_indices=DST, item_size=HEADS * DIM * 4)
    assert torch.equal(dst_k, want_k) and torch.equal(dst_v, want_v)
    src, dst = _layers(), _layers()
    want = [d.clone() for d in dst]
    for s, w in zip(src, want, strict=True):
        w[DST] = s[SRC]
    kvcacheio.transfer_kv_direct(src, dst, SRC, DST, page_size=1)
    assert all(torch.equal(d, w) for d, w in zip(dst, want, strict=True))


def test_all_layer_backup_to_a_layer_first_host_pool():
    from sgl_kernel import kvcacheio

    device_k, device_v, host_k, host_v = _layers(), _layers(), _layers(), _layers()
    want_k, want_v = [h.clone() for h in host_k], [h.clone() for h in host_v]
    for layer in range(LAYERS):
        want_k[layer][DST] = device_k[layer][SRC]
        want_v[layer][DST] = device_v[layer][SRC]
    kvcacheio.transfer_kv_all_layer(
        src_k_layers=_table(device_k), dst_k_layers=_table(host_k),
        src_v_layers=_table(device_v), dst_v_layers=_table(host_v), src_indices=SRC,
        dst_indices=DST, item_size=HEADS * DIM * 4, num_layers=LAYERS)
    assert all(torch.equal(h, w) for h, w in zip(host_k + host_v, want_k + want_v, strict=True))
    # No rows to move: nothing to view at the raw addresses, nothing changes.
    none = torch.empty(0, dtype=torch.int64)
    kvcacheio.transfer_kv_all_layer(
        src_k_layers=_table(device_k), dst_k_layers=_table(host_k),
        src_v_layers=_table(device_v), dst_v_layers=_table(host_v), src_indices=none,
        dst_indices=none, item_size=HEADS * DIM * 4, num_layers=LAYERS)
    assert all(torch.equal(h, w) for h, w in zip(host_k + host_v, want_k + want_v, strict=True))


def test_page_first_host_pool_round_trip():
    """Backup into a page-first host pool ([slot, layer, head, dim]) and load one layer back."""
    from sgl_kernel import kvcacheio

    device_k, device_v = _layers(), _layers()
    host_k, host_v = (torch.zeros(SLOTS, LAYERS, HEADS, DIM) for _ in range(2))
    item = HEADS * DIM * 4
    kvcacheio.transfer_kv_all_layer_lf_pf(
        src_k_layers=_table(device_k), dst_k=host_k, src_v_layers=_table(device_v),
        dst_v=host_v, src_indices=SRC, dst_indices=DST, item_size=item,
        dst_layout_dim=LAYERS * item, num_layers=LAYERS)
    for layer in range(LAYERS):
        assert torch.equal(host_k[DST, layer], device_k[layer][SRC])
        assert torch.equal(host_v[DST, layer], device_v[layer][SRC])
    loaded_k, loaded_v = torch.zeros(SLOTS, HEADS, DIM), torch.zeros(SLOTS, HEADS, DIM)
    kvcacheio.transfer_kv_per_layer_pf_lf(
        src_k=host_k, dst_k=loaded_k, src_v=host_v, dst_v=loaded_v, src_indices=DST,
        dst_indices=SRC, layer_id=1, item_size=item, src_layout_dim=LAYERS * item)
    assert torch.equal(loaded_k[SRC], device_k[1][SRC])
    assert torch.equal(loaded_v[SRC], device_v[1][SRC])
