"""Torch implementations of the `sgl_kernel` names SGLang's CPU engine imports.

No CPU build of sgl-kernel is on PyPI, yet SGLang's CPU engine imports a handful of its ops at
module level. This module stands in for the package on machines without a GPU (see
`vericache_sglang.cpu.finder`): ops our code paths call are implemented in torch; every other
name resolves to a callable that raises, naming the op, so nothing fails silently.
`sgl_kernel.kvcacheio` is `vericache_sglang.cpu.kvcacheio_shim`, `sgl_kernel.speculative`
`vericache_sglang.cpu.speculative_shim`.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Callable

import torch

__version__ = "0.0.0+vericache.cpu"
IS_VERICACHE_CPU_SHIM = True
# A package, so that `sgl_kernel.kvcacheio` (HiCache's transfer ops) can be found beneath it.
__path__: list[str] = []
SUBMODULES = ("kvcacheio", "speculative")


class MissingCpuKernelError(NotImplementedError):
    """An sgl_kernel op was called that has no CPU implementation here."""


def _segment_offsets(start_offset: torch.Tensor, end_offset: torch.Tensor) -> list[int]:
    lengths = (end_offset - start_offset).tolist()
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the req->token map."""
    del pool_len  # rows are addressed through req_to_token itself
    offsets = _segment_offsets(start_offset, end_offset)
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    for i, row in enumerate(rows):
        req_to_token[row, starts[i] : ends[i]] = out_cache_loc[offsets[i] : offsets[i + 1]].to(
            req_to_token.dtype
        )


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV rows src->tgt in every buffer, given raw base pointers and row strides in bytes.

    All source rows of a buffer are read before any target is written, as in the GPU kernel,
    so overlapping moves (compaction after speculative verification) are safe.
    """
    src = src_loc.tolist()
    tgt = tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows, strict=True):
            ctypes.memmove(base + t * stride, row, stride)


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    """Compact the KV slots of accepted draft tokens (accept_index == -1 marks rejected)."""
    kept = accept_index[accept_index != -1]
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept]


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Gather each request's KV slots `req_to_token[row, start:end]` into `out_cache_loc`,
    request after request: the Triton `assign_extend_cache_locs` of
    `sglang/kernels/ops/speculative/cache_locs.py` (request i's slots start at the sum of the
    earlier requests' `end - start`)."""
    del pool_len  # rows are addressed through req_to_token itself
    offsets = _segment_offsets(start_offset, end_offset)
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    for i, row in enumerate(rows):
        out_cache_loc[offsets[i] : offsets[i + 1]] = req_to_token[row, starts[i] : ends[i]].to(
            out_cache_loc.dtype
        )


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy verification of a draft tree, in place: `verify_tree_greedy_kernel_triton` of
    `sglang/kernels/ops/speculative/spec_tree.py`.

    Per request b, from the root (`retrive_index[b, 0]`, the first entry of `accept_index[b]`):
    for up to `accept_index.shape[1] - 1` levels, walk the current node's children (first
    child, then next siblings, at most n of them) for the draft token equal to the target's
    argmax after the last accepted node; on a match write that argmax to `predicts` at the last
    accepted node's flat index, append the child's `retrive_index` to `accept_index[b]` and
    descend, else stop. `accept_token_num[b]` = drafts accepted; `predicts` at the last
    accepted node gets the target's token there (the bonus token).
    """
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand, index = candidates.tolist(), retrive_index.tolist()
    next_token, next_sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    out, accepted_idx, counts = predicts.tolist(), accept_index.tolist(), accept_token_num.tolist()
    for b in range(bs):
        last = index[b][0]
        accepted_idx[b][0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = next_token[b][cur]
            want = target[last]
            match = None
            for _ in range(n):
                if cur == -1:
                    break
                if cand[b][cur] == want:
                    match = cur
                    break
                cur = next_sibling[b][cur]
            if match is None:
                break
            out[last] = want
            accepted += 1
            last = index[b][match]
            accepted_idx[b][accepted] = last
        counts[b] = accepted
        out[last] = target[last]
    predicts.copy_(torch.tensor(out, dtype=predicts.dtype))
    accept_index.copy_(torch.tensor(accepted_idx, dtype=accept_index.dtype))
    accept_token_num.copy_(torch.tensor(counts, dtype=accept_token_num.dtype))


_U32 = 0xFFFFFFFF


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _U32


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _rotl32((k * 0xCC9E2D51) & _U32, 15)
    k = (k * 0x1B873593) & _U32
    return (_rotl32(h ^ k, 13) * 5 + 0xE6546B64) & _U32


def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor,
                      col_indices: torch.Tensor) -> torch.Tensor:
    """uint32 [n, m]: `murmur_hash32_kernel` of `sglang/kernels/ops/sampling/murmur_hash.py`,
    the hash behind SGLang's seeded sampler (`multinomial_with_seed`, deterministic
    inference), in int64 arithmetic masked to 32 bits: the seed's low and high words, the
    row's position and the column mixed in that order, then the 16-byte finalizer."""
    seed = seed.to(torch.int64)  # uint64 -> int64 keeps the bits
    h = torch.zeros(seed.shape, dtype=torch.int64)
    for word in (seed & _U32, (seed >> 32) & _U32, positions.to(torch.int64) & _U32):
        h = _murmur3_mix(h, word)
    h = _murmur3_mix(h[:, None], (col_indices.to(torch.int64) & _U32)[None, :]) ^ 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _U32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _U32
    h ^= h >> 16
    return h.to(torch.uint32)


def _register_torch_ops() -> None:
    """Ops SGLang calls through `torch.ops.sgl_kernel` rather than as module attributes."""
    if hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"):
        return
    library = torch.library.Library("sgl_kernel", "FRAGMENT")
    library.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) "
                   "-> Tensor")
    library.impl("murmur_hash32_cpu", murmur_hash32_cpu, "CPU")
    _LIBRARIES.append(library)  # a Library deregisters its ops when collected


_LIBRARIES: list[torch.library.Library] = []
_register_torch_ops()


IMPLEMENTED: dict[str, Callable] = {
    f.__name__: f
    for f in (
        assign_req_to_token_pool_cpu,
        assign_extend_cache_locs_cpu,
        copy_all_layer_kv_cache_cpu,
        fill_accept_out_cache_loc_cpu,
        murmur_hash32_cpu,
        verify_tree_greedy_cpu,
    )
}


def missing_op(name: str, implemented: dict[str, Callable]) -> Callable:
    """A stand-in for an op with no CPU implementation: it imports, and raises when called."""
    def op(*args, **kwargs):
        raise MissingCpuKernelError(
            f"sgl_kernel.{name} has no CPU implementation (vericache-sglang provides "
            f"it on machines without a GPU only for: {', '.join(sorted(implemented))})"
        )

    op.__name__ = name.rsplit(".", 1)[-1]
    op.__qualname__ = op.__name__
    return op


def __getattr__(name: str) -> Callable:
    # Module-level imports of unimplemented ops must succeed (SGLang imports many it never
    # calls on CPU); calling one raises with its name.
    if name.startswith("__"):
        raise AttributeError(name)
    if name in SUBMODULES:  # `from sgl_kernel import kvcacheio` asks for the attribute first
        return importlib.import_module(f"{__name__}.{name}")
    op = missing_op(name, IMPLEMENTED)
    globals()[name] = op
    return op
