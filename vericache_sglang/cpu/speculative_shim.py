"""Torch implementations of the `sgl_kernel.speculative` ops SGLang's NGRAM speculative decoding
calls, served as `sgl_kernel.speculative` on machines without a GPU.

`sglang/kernels/ops/speculative/reconstruct_tree.py` imports
`reconstruct_indices_from_tree_mask` from here on CPU; it turns the n-gram corpus's tree of
draft tokens (an ancestor mask) into the positions and the traversal links verification
reads. Any other op imports but raises, naming itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vericache_sglang.cpu.sgl_kernel_shim import missing_op


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """NGRAM verify metadata from a tree mask, in place: the contract documented (and
    implemented in Triton) in `sglang/kernels/ops/speculative/reconstruct_tree.py`.

    With ``n = draft_token_num``, ``tree_mask[b, i, j]`` (flat, row-major) marks node j an
    ancestor of node i; only ``j < i`` counts. Per request b and node t:
    ``positions[b*n + t]`` = its number of ancestors + ``verified_seq_len[b]``;
    ``retrieve_index[b, t] = b*n + t``; ``retrieve_next_token[b, t]`` = the smallest k > t that
    has t as an ancestor (its first child), else -1; ``retrieve_next_sibling[b, t]`` = the
    smallest k > t with the same parent (parent = the largest ancestor), else -1, and -1 for
    a root.
    """
    bs, n = batch_size, draft_token_num
    if bs == 0:
        return
    device = tree_mask.device
    node = torch.arange(n, device=device)
    lower = node[None, :] < node[:, None]  # [i, j]: j < i
    ancestors = tree_mask[: bs * n * n].view(bs, n, n).bool() & lower
    depth = ancestors.sum(-1)
    positions[: bs * n] = (depth + verified_seq_len[:bs, None].to(depth.dtype)).flatten().to(
        positions.dtype)
    retrieve_index[:bs] = (torch.arange(bs, device=device)[:, None] * n + node).to(
        retrieve_index.dtype)
    parent = torch.where(ancestors, node, -1).amax(-1)  # [b, i]
    rows = node[None, :, None].expand(bs, n, n)  # [b, k, t] -> k
    child = torch.where(ancestors, rows, n).amin(1)  # [b, t]: smallest k with t in k's ancestors
    retrieve_next_token[:bs] = torch.where(child < n, child, -1).to(retrieve_next_token.dtype)
    same_parent = (parent[:, :, None] == parent[:, None, :]) & lower  # [b, k, t], k > t
    sibling = torch.where(same_parent, rows, n).amin(1)
    has_sibling = (parent >= 0) & (sibling < n)
    retrieve_next_sibling[:bs] = torch.where(has_sibling, sibling, -1).to(
        retrieve_next_sibling.dtype)


IMPLEMENTED: dict[str, Callable] = {
    f.__name__: f for f in (reconstruct_indices_from_tree_mask,)
}


def __getattr__(name: str) -> Callable:
    if name.startswith("__"):
        raise AttributeError(name)
    op = missing_op(f"speculative.{name}", IMPLEMENTED)
    globals()[name] = op
    return op
