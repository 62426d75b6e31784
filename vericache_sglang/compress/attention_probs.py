"""Causal attention probabilities: what token-selecting compressors (SnapKV, H2O) score by.

One helper for every place that needs them (the prompt's observation window while serving, a
single query standing in for a missing window, and the offline harness), so they all score
the same way.
"""

from __future__ import annotations

import torch

# Queries per step: bounds the [Hq, chunk, T] logits a long prompt's scoring holds at once.
SCORE_CHUNK = 256


def causal_attention_probs(
    queries: torch.Tensor,
    keys: torch.Tensor,
    first_position: int,
    scale: float,
    *,
    summed: bool = False,
) -> torch.Tensor:
    """Softmax attention of queries [W, Hq, D] at positions first_position.. over the causally
    visible keys [T, H, D] (GQA: query head j reads KV head j // (Hq // H)), in float32.

    Returns [Hq, W, T], or [Hq, 1, T] summed over the queries when `summed` (a whole prompt's
    accumulated attention, computed in chunks so it never holds [Hq, W, T]).
    """
    kv_heads = keys.shape[1]
    k = keys.float().permute(1, 2, 0)  # [H, D, T]
    key_pos = torch.arange(keys.shape[0], device=keys.device)
    parts = []
    for begin in range(0, queries.shape[0], SCORE_CHUNK):
        chunk = queries[begin : begin + SCORE_CHUNK].float()
        w, q_heads, dim = chunk.shape
        grouped = chunk.permute(1, 0, 2).reshape(kv_heads, -1, dim)  # [H, Hq/H * w, D]
        logits = torch.matmul(grouped, k).reshape(q_heads, w, -1) * scale
        pos = first_position + begin + torch.arange(w, device=keys.device)
        logits.masked_fill_(key_pos[None, None, :] > pos[None, :, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        parts.append(probs.sum(dim=1, keepdim=True) if summed else probs)
    if summed:
        return torch.stack(parts).sum(dim=0)
    return torch.cat(parts, dim=1)
