"""The torch stand-ins for the sgl_kernel ops SGLang's CPU engine calls, and the finder that
provides them only where no real sgl_kernel exists.

The stand-ins for SGLang's NGRAM speculative decoding are compared with SGLang's own Triton
kernels for the same contracts, run by Triton's interpreter on CPU tensors. Triton fixes
interpreted vs compiled execution when each kernel is decorated, i.e. at import, so
TRITON_INTERPRET=1 must be set before triton is first imported: a normal run re-runs this file
in a subprocess with it set, and only there do the interpreter tests run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import ModuleType

import pytest
import torch

from tests.support.interpreter import interpreter_only, rerun_under_interpreter
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


def test_speculative_module_is_served_and_names_missing_ops() -> None:
    """In a fresh process (as in SGLang's scheduler), `import sgl_kernel.speculative` finds the
    stand-in through the finder, with the torch reconstruct op, and an op it lacks raises with
    its full name rather than failing somewhere downstream."""
    code = textwrap.dedent("""
        import sgl_kernel.speculative as spec
        from sgl_kernel import speculative
        print(spec is speculative, spec.__file__.endswith("speculative_shim.py"))
        print(spec.reconstruct_indices_from_tree_mask.__module__)
        try:
            spec.build_tree_kernel_efficient()
        except NotImplementedError as e:
            print(e)
        else:
            print("no error")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["True", "True"]
    assert lines[1] == "sgl_kernel.speculative"
    assert lines[2].startswith("sgl_kernel.speculative.build_tree_kernel_efficient has no CPU")

# NGRAM speculative decoding's ops, against SGLang's Triton kernels under the interpreter.
def test_speculative_ops_equal_sglang_triton_kernels_under_the_interpreter() -> None:
    rerun_under_interpreter(__file__)


@pytest.fixture(scope="module")
def sglang_spec() -> tuple[ModuleType, ModuleType, ModuleType]:
    """SGLang's speculative op modules, their kernels interpreted and their CPU paths bound to
    the stand-ins (which is what SGLang's NGRAM worker calls on CPU)."""
    pytest.importorskip("triton")
    import sgl_kernel
    from sglang.kernels.ops.speculative import cache_locs, reconstruct_tree, spec_tree
    from triton.runtime.interpreter import InterpretedFunction

    for kernel in (reconstruct_tree._reconstruct_tree_mask_kernel,
                   spec_tree.verify_tree_greedy_kernel_triton, cache_locs.assign_extend_cache_locs):
        assert isinstance(kernel, InterpretedFunction)
    assert spec_tree._is_cpu and cache_locs._is_cpu
    assert reconstruct_tree.reconstruct_indices_from_tree_mask is (
        sgl_kernel.speculative.reconstruct_indices_from_tree_mask)
    assert spec_tree.sgl_verify_tree_greedy_cpu is sgl_kernel.verify_tree_greedy_cpu
    assert cache_locs.assign_extend_cache_locs_cpu is sgl_kernel.assign_extend_cache_locs_cpu
    return reconstruct_tree, spec_tree, cache_locs


# (batch size, draft_token_num): one node only, a BLOCK_N above n (5, 6, 12), several requests.
TREE_CASES = [(1, 1), (1, 8), (2, 5), (3, 8), (4, 6), (4, 12)]


def _ngram_tree_masks(gen: torch.Generator, bs: int, n: int, deep: bool = False) -> torch.Tensor:
    """Flat [bs * n * n] bool masks shaped as SGLang's n-gram corpus writes them
    (kernels/jit/csrc/ngram_corpus/result.cpp): node 0 is the last verified token, each other
    node's parent is an earlier node (one of the last two if `deep`), row i copies its parent's
    row and marks i itself; nodes past a request's match are padding, children of the root."""
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    for b in range(bs):
        matched = int(torch.randint(1, n + 1, (1,), generator=gen))
        mask[b, 0, 0] = True
        for i in range(1, n):
            low = max(i - 2, 0) if deep else 0
            parent = int(torch.randint(low, i, (1,), generator=gen)) if i < matched else 0
            mask[b, i] = mask[b, parent]
            mask[b, i, i] = True
    return mask.flatten()


def _tree_metadata(reconstruct, mask: torch.Tensor, seq_lens: torch.Tensor, bs: int,
                   n: int) -> list[torch.Tensor]:
    """Run a reconstruct op on the [:bs] slices of buffers sized for one more request, as the
    NGRAM worker does; the spare row (filled with -7) shows nothing is written past bs."""
    positions = torch.full(((bs + 1) * n,), -7, dtype=torch.int64)
    index, next_token, next_sibling = (torch.full((bs + 1, n), -7, dtype=torch.int64)
                                       for _ in range(3))
    reconstruct(mask, seq_lens, positions[: bs * n], index[:bs], next_token[:bs],
                next_sibling[:bs], bs, n)
    return [positions, index, next_token, next_sibling]


@interpreter_only
@pytest.mark.parametrize("noise", [False, True], ids=["ngram", "flipped-bits"])
@pytest.mark.parametrize(("bs", "n"), TREE_CASES)
def test_reconstruct_indices_equal_triton(sglang_spec, bs: int, n: int, noise: bool) -> None:
    """Positions and traversal links from a tree mask equal SGLang's Triton kernel. With noise,
    random bits of the mask are flipped: bits on and above the diagonal (which the contract
    ignores) and ancestors dropped, so that nodes other than 0 become roots."""
    reconstruct_tree, _, _ = sglang_spec
    gen = torch.Generator().manual_seed(bs * 100 + n + 1000 * noise)
    mask = _ngram_tree_masks(gen, bs, n)
    if noise:
        mask ^= (torch.rand(bs * n * n, generator=gen) < 0.3)
    seq_lens = torch.randint(1, 500, (bs,), generator=gen)
    want = _tree_metadata(reconstruct_tree.reconstruct_indices_from_tree_mask_triton, mask,
                          seq_lens, bs, n)
    got = _tree_metadata(reconstruct_tree.reconstruct_indices_from_tree_mask_func, mask,
                         seq_lens, bs, n)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g, w)
    if n > 1:  # the cases hold real trees: some node has a child and some a sibling
        assert (want[2][:bs] >= 0).any() and (want[3][:bs] >= 0).any()


@interpreter_only
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("deep", [False, True], ids=["bushy", "deep"])
@pytest.mark.parametrize(("bs", "n"), TREE_CASES)
def test_verify_tree_greedy_equals_triton(sglang_spec, bs: int, n: int, deep: bool,
                                          seed: int) -> None:
    """Greedy verification of n-gram trees (metadata from their masks) equals SGLang's Triton
    kernel. Drafts come from a 3-token vocabulary and the target usually predicts one of a
    node's children, so requests accept paths of different lengths, through siblings too."""
    reconstruct_tree, spec_tree, _ = sglang_spec
    gen = torch.Generator().manual_seed(seed * 1000 + bs * 100 + n + 10_000 * deep)
    mask = _ngram_tree_masks(gen, bs, n, deep)
    seq_lens = torch.randint(1, 500, (bs,), generator=gen)
    _, index, next_token, next_sibling = (t[:bs] for t in _tree_metadata(
        reconstruct_tree.reconstruct_indices_from_tree_mask_triton, mask, seq_lens, bs, n))
    candidates = torch.randint(0, 3, (bs, n), generator=gen)
    target = torch.randint(0, 3, (bs, n), generator=gen)
    node = torch.arange(n)
    ancestors = mask.view(bs, n, n) & (node < node[:, None])
    parent = torch.where(ancestors, node, -1).amax(-1)
    children = parent[:, None, :] == node[None, :, None]  # [b, t, k]: k is a child of t
    for b, t in (children.any(-1) & (torch.rand(bs, n, generator=gen) < 0.8)).nonzero().tolist():
        kids = children[b, t].nonzero().flatten()
        pick = kids[torch.randint(0, len(kids), (1,), generator=gen)]
        target[b, t] = candidates[b, pick]

    def verify(fn) -> list[torch.Tensor]:
        predicts = torch.zeros(bs * n, dtype=torch.int32)
        accept_index = torch.full((bs, n), -1, dtype=torch.int32)
        accept_num = torch.full((bs,), -7, dtype=torch.int32)
        fn(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
           candidates=candidates, retrieve_index=index, retrieve_next_token=next_token,
           retrieve_next_sibling=next_sibling, target_predict=target)
        return [predicts, accept_index, accept_num]

    want = verify(spec_tree.verify_tree_greedy_triton)
    got = verify(spec_tree.verify_tree_greedy_func)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g, w)


@interpreter_only
@pytest.mark.parametrize("bs", [1, 2, 3, 4])
def test_assign_extend_cache_locs_equals_triton(sglang_spec, bs: int) -> None:
    """Gathering each request's KV slots req_to_token[row, start:end] into one flat array
    equals SGLang's Triton kernel, for requests of different lengths (none, and over the
    kernel's 32-slot block); slots past the total stay untouched."""
    from sglang.srt.utils import next_power_of_2

    _, _, cache_locs = sglang_spec
    gen = torch.Generator().manual_seed(bs)
    req_to_token = torch.randint(0, 10_000, (6, 80), generator=gen, dtype=torch.int32)
    rows = torch.randperm(6, generator=gen)[:bs]
    start = torch.randint(0, 40, (bs,), generator=gen)
    end = start + torch.tensor([37, 0, 5, 12])[:bs][torch.randperm(bs, generator=gen)]
    total = int((end - start).sum())

    def gather(fn, *extra) -> torch.Tensor:
        out = torch.full((total + 3,), -7, dtype=torch.int64)
        fn(rows, req_to_token, start, end, out, req_to_token.shape[1], *extra)
        return out

    want = gather(cache_locs.assign_extend_cache_locs[(bs,)], next_power_of_2(bs))
    got = gather(cache_locs.assign_extend_cache_locs_cpu)
    assert torch.equal(got, want), (got, want)
    assert (want[:total] >= 0).all() and (want[total:] == -7).all()


@interpreter_only
@pytest.mark.parametrize("rows", [1, 5])
def test_murmur_hash32_equals_triton(rows: int) -> None:
    """The hash behind SGLang's seeded sampler (`multinomial_with_seed`) equals SGLang's Triton
    kernel bit for bit: seeds over 32 bits and up to 2**63 - 1, positions up to 2**31 - 1,
    columns past the kernel's 1,024-wide block."""
    pytest.importorskip("triton")
    import sgl_kernel
    import triton
    from sglang.kernels.ops.sampling import murmur_hash

    gen = torch.Generator().manual_seed(rows)
    seed = torch.tensor([0, 1, 42, 2**40 + 7, 2**63 - 1][:rows], dtype=torch.int64)
    positions = torch.randint(0, 2**31 - 1, (rows,), generator=gen)
    columns = torch.arange(2500)
    want = torch.empty((rows, len(columns)), dtype=torch.uint32)
    murmur_hash.murmur_hash32_kernel[(rows, triton.cdiv(len(columns), 1024))](
        seed, positions, columns, want, rows, len(columns), BLOCK_SIZE=1024)
    got = murmur_hash.murmur_hash32(seed, positions, columns)  # the CPU path: the shim's op
    assert got.dtype == torch.uint32
    assert torch.equal(got.to(torch.int64), want.to(torch.int64))
    assert torch.equal(got, sgl_kernel.murmur_hash32_cpu(seed, positions, columns))
