"""Torch reference for decode attention over packed K/V plus a full-precision residual.

One query token per request, GQA: query head j reads KV head j // (Hq // H). Returns the output
and the log-sum-exp of the logits so that attention over several parts (say two quantized tiers
with different bit widths) can be merged exactly with `merge_attention`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import PackedKV, dequantize_keys, dequantize_values
from .quant_ref import dequantize_unpack_ref


def _request_kv(
    packed: PackedKV | None, k_res: torch.Tensor, v_res: torch.Tensor, res_len: int, b: int
) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = [k_res[b, :res_len].float()], [v_res[b, :res_len].float()]
    if packed is not None:
        n = int(packed.lengths[b])
        ng = n // packed.group
        deq = (packed.bits, torch.float32, dequantize_unpack_ref)
        keys.insert(0, dequantize_keys(
            packed.k_codes[b, :ng], packed.k_scale[b, :ng], packed.k_zero[b, :ng], *deq
        ))
        values.insert(0, dequantize_values(
            packed.v_codes[b, :n], packed.v_scale[b, :n], packed.v_zero[b, :n], *deq
        ))
    return torch.cat(keys), torch.cat(values)


def decode_attention_ref(
    q: torch.Tensor,
    packed: PackedKV | None,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    res_lengths: torch.Tensor,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D]; k_res/v_res [B, R, H, D] -> (out [B, Hq, D], lse [B, Hq]), both float32.

    A request with no tokens at all gets out = 0 and lse = -inf (it carries no weight in a merge).
    """
    batch, q_heads, _ = q.shape
    group_size = q_heads // k_res.shape[2]
    outs, lses = [], []
    for b in range(batch):
        keys, values = _request_kv(packed, k_res, v_res, int(res_lengths[b]), b)
        keys = keys.repeat_interleave(group_size, dim=1)
        values = values.repeat_interleave(group_size, dim=1)
        logits = torch.einsum("hd,nhd->hn", q[b].float(), keys) * sm_scale
        lse = torch.logsumexp(logits, dim=-1)
        probs = torch.exp(logits - lse[:, None])
        outs.append(torch.einsum("hn,nhd->hd", probs, values))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def merge_attention(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine (out, lse) of attention over disjoint key sets into attention over their union."""
    lse = torch.stack([part_lse for _, part_lse in parts])
    total = torch.logsumexp(lse, dim=0)
    weights = torch.exp(lse - total).nan_to_num(0.0)  # -inf - -inf: an empty part weighs 0
    out = sum(w[..., None] * part_out for w, (part_out, _) in zip(weights, parts, strict=True))
    return out, total
