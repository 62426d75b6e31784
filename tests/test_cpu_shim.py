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
