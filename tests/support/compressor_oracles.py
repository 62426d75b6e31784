"""Independent oracles for the compressor tests: attention, expected bytes, error bounds."""

from __future__ import annotations

import math

import torch

from vericache_sglang.compress import CompressedKV, parse_compressor_spec
from vericache_sglang.compress.attention_probs import causal_attention_probs

HELD_OUT = 16
"""Prompt tokens held out of compression; their real queries probe the compressed prefix."""

MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """Plain softmax attention of q [Hq, D] over keys/values [n, H, D] (GQA), float32; with a
    cap, logits are cap * tanh(logits / cap) (Gemma 2's softcapping)."""
    group = q.shape[0] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    logits = torch.einsum("hd,nhd->hn", q.float(), k) * scaling
    if logit_cap > 0:
        logits = logit_cap * torch.tanh(logits / logit_cap)
    probs = logits.softmax(-1)
    return torch.einsum("hn,nhd->hd", probs, v)


def quant_error_bound(x: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Largest error of asymmetric min/max quantization of groups x [..., G] (any leading
    dims), derived from the format: codes use the fp16-rounded scale s16 and zero z16, so
    |x - deq| <= s16/2 + |z16 - min| + qmax * |s16 - s|, plus float32 arithmetic and the rounding
    of the result to `dtype`. Returned per element, broadcast over the group."""
    qmax = (1 << bits) - 1
    x = x.float()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s = (hi - lo) / qmax
    s16, z16 = s.half().float(), lo.half().float()
    bound = s16 / 2 + (z16 - lo).abs() + qmax * (s16 - s).abs()
    magnitude = x.abs().amax(-1, keepdim=True) + qmax * s16 + bound
    arithmetic = 8 * 2.0**-24 * magnitude
    output = 2.0 ** -(MANTISSA_BITS[dtype] + 1) * magnitude
    return (bound + arithmetic + output).expand_as(x)


def key_groups(keys: torch.Tensor, group: int) -> torch.Tensor:
    """[n, H, D] (n a multiple of group) -> [n/group, H, D, group]: one key group per row."""
    n, heads, dim = keys.shape
    return keys.reshape(n // group, group, heads, dim).permute(0, 2, 3, 1)


def value_groups(values: torch.Tensor, group: int) -> torch.Tensor:
    """[n, H, D] -> [n, H, D/v_group, v_group] with v_group = gcd(group, D)."""
    n, heads, dim = values.shape
    v_group = math.gcd(group, dim)
    return values.reshape(n, heads, dim // v_group, v_group)


def budget(ratio: float, seen: int, floor: int = 0) -> int:
    """Documented dropper budget: round(ratio * seen) half up, at least 1 and `floor`."""
    return 0 if seen == 0 else min(seen, max(1, int(ratio * seen + 0.5), floor))


def kivi_bytes(tokens: int, heads: int, dim: int, bits: int, group: int, residual: int,
               dtype_bytes: int) -> int:
    """Bytes of plain KIVI storage computed from the shapes alone."""
    quantized = max(tokens - residual, 0) // group * group
    codes = 2 * quantized * heads * dim * bits // 8
    key_meta = 2 * 2 * (quantized // group) * heads * dim
    value_meta = 2 * 2 * quantized * heads * (dim // math.gcd(group, dim))
    full = 2 * (tokens - quantized) * heads * dim * dtype_bytes
    return codes + key_meta + value_meta + full


def prefix_scores(real_kv, layer: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(window scores [Hq, window, n], summed scores [Hq, 1, n]) of the prompt minus HELD_OUT."""
    kv = real_kv.layers[layer]
    n = kv.keys.shape[0] - HELD_OUT
    q, k = kv.queries[:n], kv.keys[:n]
    window_scores = causal_attention_probs(q[n - window:], k, n - window, real_kv.scaling)
    total = causal_attention_probs(q, k, 0, real_kv.scaling, summed=True)
    return window_scores, total


def compress_prefix(real_kv, layer: int, spec: str) -> CompressedKV:
    """Compress the prompt minus HELD_OUT tokens with the scores its method asks for."""
    c = parse_compressor_spec(spec)
    kv = real_kv.layers[layer]
    n = kv.keys.shape[0] - HELD_OUT
    scores = None
    if c.needs_scores:
        window = c.score_window()
        window_scores, total = prefix_scores(real_kv, layer, window or 1)
        scores = total if window is None else window_scores
    return c.compress(kv.keys[:n], kv.values[:n], torch.arange(n), scores, layer=layer)
