"""Attention-output error of every compressor against full attention on real KV and queries.

The prompt stops HELD_OUT tokens early; it is compressed with the scores its method needs, and
the held-out tokens' real queries attend over it plus their own exact (uncompressed) K/V.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.compressor_oracles import (
    HELD_OUT,
    attention,
    compress_prefix,
    key_groups,
    quant_error_bound,
)
from vericache_sglang.compress import ComposedKV, QuantizedKV


def _held_out_error(real_kv, spec: str) -> float:
    """Relative error ||o - o_full|| / ||o_full||, averaged over layers and held-out queries."""
    errors = []
    for index, kv in real_kv.layers.items():
        keys, values = compress_prefix(real_kv, index, spec).dense()
        n = kv.keys.shape[0] - HELD_OUT
        for j in range(HELD_OUT):
            tail = slice(n, n + j + 1)
            q = kv.queries[n + j]
            full = attention(q, kv.keys[: n + j + 1], kv.values[: n + j + 1], real_kv.scaling)
            lossy = attention(q, torch.cat([keys, kv.keys[tail]]),
                              torch.cat([values, kv.values[tail]]), real_kv.scaling)
            errors.append(float((lossy - full).norm() / full.norm()))
    return sum(errors) / len(errors)


@pytest.fixture(scope="module")
def errors(real_kv) -> dict[str, float]:
    specs = [
        "kivi:bits=8", "kivi:bits=4", "kivi:bits=2",
        "kivi_mixed:bits_early=4,bits_late=2,early_layers=1,recent_bits=4,recent=256",
        "snapkv:ratio=0.5", "snapkv:ratio=0.1", "h2o:ratio=0.5", "h2o:ratio=0.1",
        "streaming:ratio=0.5", "streaming:ratio=0.1",
        "snapkv:ratio=0.5+kivi:bits=8", "snapkv:ratio=0.5+kivi:bits=2",
    ]
    return {spec: _held_out_error(real_kv, spec) for spec in specs}


def test_quantizer_error_orders_by_bits(errors) -> None:
    assert 0 < errors["kivi:bits=8"] < errors["kivi:bits=4"] < errors["kivi:bits=2"]
    assert errors["kivi:bits=8"] < 0.01 and errors["kivi:bits=2"] < 1.0


def test_mixed_bits_sit_between(errors) -> None:
    mixed = errors["kivi_mixed:bits_early=4,bits_late=2,early_layers=1,recent_bits=4,recent=256"]
    assert errors["kivi:bits=4"] < mixed < errors["kivi:bits=2"]


@pytest.mark.parametrize("method", ["snapkv", "h2o", "streaming"])
def test_dropper_error_falls_with_ratio(errors, method: str) -> None:
    assert errors[f"{method}:ratio=0.5"] < errors[f"{method}:ratio=0.1"]


def test_composition_adds_quantization_error(errors) -> None:
    dropped = errors["snapkv:ratio=0.5"]
    assert abs(errors["snapkv:ratio=0.5+kivi:bits=8"] - dropped) < 0.1 * dropped
    assert errors["snapkv:ratio=0.5+kivi:bits=2"] > errors["snapkv:ratio=0.5+kivi:bits=8"]


def test_composition_quantizes_exactly_the_kept_tokens(real_kv) -> None:
    dropped = compress_prefix(real_kv, 14, "snapkv:ratio=0.5")
    composed = compress_prefix(real_kv, 14, "snapkv:ratio=0.5+kivi:bits=4,residual=0")
    assert isinstance(composed, ComposedKV) and isinstance(composed.inner, QuantizedKV)
    assert torch.equal(composed.positions(), dropped.positions())
    kept_keys, _ = dropped.dense()
    n = len(dropped) // 32 * 32
    groups = key_groups(kept_keys[:n], 32)
    err = (key_groups(composed.dense()[0][:n], 32) - groups).abs()
    assert torch.all(err <= quant_error_bound(groups, 4, torch.float32))


@pytest.mark.parametrize("spec", ["kivi:bits=4", "kivi:bits=2,residual=40",
                                  "kivi_mixed:recent=128,residual=16", "h2o:ratio=0.3",
                                  "streaming:ratio=0.3+kivi_mixed:recent=64"])
def test_attend_reads_packed_like_dense(real_kv, spec: str) -> None:
    """block.attend (the kernel path, reading packed codes) equals attention over dense()."""
    for index, kv in real_kv.layers.items():
        block = compress_prefix(real_kv, index, spec)
        q = kv.queries[-1]
        expected = attention(q, *block.dense(), real_kv.scaling)
        assert torch.allclose(block.attend(q, real_kv.scaling), expected, atol=1e-5, rtol=1e-4)
