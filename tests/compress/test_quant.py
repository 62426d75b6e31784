"""KIVI quantizers on real KV: derived error bounds, the packed format, the residual window,
appends and bit allocation."""

from __future__ import annotations

import pytest
import torch

from tests.support.compressor_oracles import key_groups, quant_error_bound, value_groups
from vericache_sglang.compress import QuantizedKV, parse_compressor_spec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GROUP = 32


def _compress(spec: str, keys: torch.Tensor, values: torch.Tensor, layer: int = 0) -> QuantizedKV:
    block = parse_compressor_spec(spec).compress(keys, values, torch.arange(keys.shape[0]),
                                                 layer=layer)
    assert isinstance(block, QuantizedKV)
    return block


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_within_derived_bound(real_kv, bits: int, dtype: torch.dtype) -> None:
    for layer in real_kv.layers.values():
        keys, values = layer.keys.to(dtype), layer.values.to(dtype)
        block = _compress(f"kivi:bits={bits},group={GROUP},residual=0", keys, values)
        n = keys.shape[0] // GROUP * GROUP
        deq_k, deq_v = block.dense()
        assert deq_k.dtype == dtype and deq_k.shape == keys.shape
        k_err = (key_groups(deq_k[:n], GROUP).float() - key_groups(keys[:n], GROUP).float()).abs()
        v_err = (value_groups(deq_v, GROUP).float() - value_groups(values, GROUP).float()).abs()
        assert torch.all(k_err <= quant_error_bound(key_groups(keys[:n], GROUP), bits, dtype))
        assert torch.all(v_err <= quant_error_bound(value_groups(values, GROUP), bits, dtype))
        # the tail that does not fill a group stays exact
        assert torch.equal(deq_k[n:], keys[n:]) and torch.equal(deq_v[n:], values[n:])


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_packed_codes_follow_the_format(real_kv, bits: int) -> None:
    """Codes recomputed from the documented format equal the stored, bit-packed ones."""
    values = real_kv.layers[14].values
    block = _compress(f"kivi:bits={bits},group={GROUP},residual=0", values, values)
    tier = block.old
    per_byte, qmax = 8 // bits, (1 << bits) - 1
    assert tier.v_codes.dtype == torch.uint8
    assert tier.v_codes.shape == (values.shape[0], values.shape[1], values.shape[2] // per_byte)
    groups = value_groups(values, GROUP)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale, zero = ((hi - lo) / qmax).half(), lo.half()
    assert torch.equal(tier.v_scale, scale[..., 0]) and torch.equal(tier.v_zero, zero[..., 0])
    codes = torch.floor((groups - zero.float()) / scale.float() + 0.5).clamp(0, qmax)
    codes = codes.reshape(values.shape).to(torch.int32)
    stored = tier.v_codes.to(torch.int32)
    unpacked = torch.stack([(stored >> (j * bits)) & qmax for j in range(per_byte)], dim=-1)
    assert torch.equal(unpacked.reshape(values.shape), codes)


@pytest.mark.parametrize(
    ("residual", "group"), [(128, 32), (129, 32), (100, 32), (0, 64), (1000, 32)]
)
def test_residual_window(real_kv, residual: int, group: int) -> None:
    keys, values = real_kv.layers[0].keys, real_kv.layers[0].values
    total = keys.shape[0]
    block = _compress(f"kivi:bits=4,group={group},residual={residual}", keys, values)
    quantized = max(total - residual, 0) // group * group
    assert len(block.old) == quantized and len(block.recent) == 0
    assert block.k_res.shape[0] == total - quantized
    assert residual <= block.k_res.shape[0] < residual + group or quantized == 0
    assert torch.equal(block.k_res, keys[quantized:])
    assert torch.equal(block.v_res, values[quantized:])


def test_appends_equal_one_shot(real_kv) -> None:
    """Group boundaries do not depend on how the tokens arrived, so neither do the codes."""
    keys, values = real_kv.layers[29].keys, real_kv.layers[29].values
    c = parse_compressor_spec("kivi:bits=2,group=32,residual=64")
    positions = torch.arange(keys.shape[0])
    gen = torch.Generator().manual_seed(1)
    start = 150
    block = c.compress(keys[:start], values[:start], positions[:start])
    while start < keys.shape[0]:
        stop = min(start + int(torch.randint(1, 40, (1,), generator=gen)), keys.shape[0])
        c.append(block, keys[start:stop], values[start:stop], positions[start:stop])
        assert 64 <= block.k_res.shape[0] < 64 + 32
        assert torch.equal(block.k_res[-(stop - start):], keys[start:stop])
        start = stop
    one_shot = c.compress(keys, values, positions)
    for a, b in zip(block.dense(), one_shot.dense(), strict=True):
        assert torch.equal(a, b)
    assert block.nbytes() == one_shot.nbytes()


def test_heads_are_quantized_independently(real_kv) -> None:
    """GQA: every KV head has its own scales, so an outlier head does not hurt the others."""
    keys, values = real_kv.layers[0].keys.clone(), real_kv.layers[0].values.clone()
    base = _compress("kivi:bits=2,residual=0", keys, values).dense()
    keys[:, 0] *= 1000
    values[:, 0] *= 1000
    scaled = _compress("kivi:bits=2,residual=0", keys, values).dense()
    for a, b in zip(base, scaled, strict=True):
        assert torch.equal(a[:, 1:], b[:, 1:])
        assert not torch.equal(a[:, :1], b[:, :1])


MIXED = "kivi_mixed:bits_early=8,bits_late=2,early_layers=2,recent_bits=4,recent=128," \
        "group=32,residual=32"


@pytest.mark.parametrize(("layer", "old_bits"), [(0, 8), (1, 8), (2, 2), (29, 2)])
def test_mixed_bits_by_layer_and_age(real_kv, layer: int, old_bits: int) -> None:
    keys, values = real_kv.layers[14].keys, real_kv.layers[14].values
    block = _compress(MIXED, keys, values, layer=layer)
    recent_bits = max(4, old_bits)
    assert (block.old.bits, block.recent.bits) == (old_bits, recent_bits)
    quantized = (keys.shape[0] - 32) // 32 * 32
    assert len(block.recent) == 128 and len(block.old) == quantized - 128
    deq_k, _ = block.dense()
    for lo, hi, bits in ((0, quantized - 128, old_bits), (quantized - 128, quantized, recent_bits)):
        groups = key_groups(keys[lo:hi], 32)
        err = (key_groups(deq_k[lo:hi], 32) - groups).abs()
        assert torch.all(err <= quant_error_bound(groups, bits, torch.float32))


def test_mixed_aging_requantizes_within_summed_bounds(real_kv) -> None:
    """Groups leaving the recent tier are requantized from 4 to 2 bits: the two rounding errors
    add (and the range may grow by the first error, which adds it once more)."""
    keys, values = real_kv.layers[14].keys, real_kv.layers[14].values
    c = parse_compressor_spec(MIXED)
    start = 300
    block = c.compress(keys[:start], values[:start], torch.arange(start), layer=5)
    one_shot_old = len(block.old)
    for i in range(start, keys.shape[0]):
        c.append(block, keys[i:i + 1], values[i:i + 1], torch.tensor([i]))
        assert len(block.recent) <= 128
    assert len(block.old) > one_shot_old, "some groups aged"
    deq_k, deq_v = block.dense()
    aged = slice(one_shot_old, len(block.old))
    groups = key_groups(keys[aged], 32)
    err = (key_groups(deq_k[aged], 32) - groups).abs()
    bound = 2 * quant_error_bound(groups, 4, torch.float32) + quant_error_bound(groups, 2,
                                                                               torch.float32)
    assert torch.all(err <= bound)
    direct = quant_error_bound(groups, 2, torch.float32)
    assert (err > direct).any(), "requantization really happened (the one-step bound is exceeded)"
    assert len(block) == keys.shape[0]
