"""Token droppers on real KV: they keep exactly the tokens they claim, the ones their rule picks,
and attention over them is exact attention restricted to them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.support.compressor_oracles import (
    HELD_OUT,
    attention,
    budget,
    compress_prefix,
    prefix_scores,
)
from vericache_sglang.compress import DroppedKV, TokenDropper, param, parse_compressor_spec
from vericache_sglang.compress.attention_probs import causal_attention_probs

SPECS = [
    "streaming:sink=4,ratio=0.25", "streaming:sink=16,ratio=0.02", "snapkv:ratio=0.25",
    "snapkv:ratio=0.1,window=16,kernel=5,pooling=avg", "h2o:ratio=0.2", "h2o:ratio=0.5,recent=0",
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("layer", [0, 14, 29])
def test_kept_tokens_are_exact(real_kv, spec: str, layer: int) -> None:
    block = compress_prefix(real_kv, layer, spec)
    kv = real_kv.layers[layer]
    n = kv.keys.shape[0] - HELD_OUT
    c = parse_compressor_spec(spec)
    assert len(block) == budget(c.ratio, n, c.min_keep())
    positions = block.positions()
    assert positions.shape == (kv.keys.shape[1], len(block))
    assert torch.all(positions[:, 1:] > positions[:, :-1]), "ascending, no duplicates"
    heads = torch.arange(kv.keys.shape[1])[:, None]
    keys, values = block.dense()
    assert torch.equal(keys.transpose(0, 1), kv.keys[positions, heads])
    assert torch.equal(values.transpose(0, 1), kv.values[positions, heads])


@pytest.mark.parametrize("sink", [0, 4, 16])
def test_streaming_keeps_sinks_and_newest(real_kv, sink: int) -> None:
    block = compress_prefix(real_kv, 0, f"streaming:sink={sink},ratio=0.1")
    n = real_kv.layers[0].keys.shape[0] - HELD_OUT
    kept = budget(0.1, n, sink)
    expected = list(range(sink)) + list(range(n - (kept - sink), n))
    assert block.positions().tolist() == [expected] * block.num_kv_heads


def _assert_top_k(score: torch.Tensor, positions: torch.Tensor, protected: torch.Tensor) -> None:
    """Every kept unprotected token scores at least as high as every dropped token, per head."""
    for h in range(score.shape[0]):
        kept = torch.zeros(score.shape[1], dtype=torch.bool)
        kept[positions[h]] = True
        assert torch.all(kept[protected])
        free = kept & ~protected
        if free.any() and (~kept).any():
            assert score[h][free].min() >= score[h][~kept].max()


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("layer", [0, 14, 29])
def test_snapkv_keeps_window_and_top_pooled(real_kv, layer: int, pooling: str) -> None:
    window, kernel = 32, 7
    block = compress_prefix(real_kv, layer, f"snapkv:ratio=0.2,window={window},kernel={kernel},"
                                             f"pooling={pooling}")
    window_scores, _ = prefix_scores(real_kv, layer, window)
    q_heads, _, n = window_scores.shape
    per_kv = window_scores.sum(1).reshape(block.num_kv_heads, -1, n).sum(1)
    padded = F.pad(per_kv[:, : n - window], (kernel // 2, kernel // 2),
                   value=float("-inf") if pooling == "max" else float("nan"))
    windows = padded.unfold(1, kernel, 1)
    pooled = windows.amax(-1) if pooling == "max" else windows.nanmean(-1)
    score = torch.cat([pooled, per_kv[:, n - window:]], dim=1)
    protected = torch.arange(n) >= n - window
    _assert_top_k(score, block.positions(), protected)


@pytest.mark.parametrize("recent", [0.0, 0.5])
def test_h2o_keeps_heavy_hitters_and_recent(real_kv, recent: float) -> None:
    block = compress_prefix(real_kv, 14, f"h2o:ratio=0.2,recent={recent}")
    _, total = prefix_scores(real_kv, 14, 32)
    n = total.shape[2]
    acc = total[:, 0].reshape(block.num_kv_heads, -1, n).sum(1)
    n_recent = int(recent * len(block) + 0.5)
    _assert_top_k(acc, block.positions(), torch.arange(n) >= n - n_recent)
    heads = torch.arange(block.num_kv_heads)[:, None]
    assert torch.allclose(block.acc, acc[heads, block.positions()])


@pytest.mark.parametrize("spec", SPECS)
def test_attention_is_exact_attention_restricted(real_kv, spec: str) -> None:
    """o_full = (1 - m) o_kept + m o_dropped, with m the dropped attention mass, per query head."""
    layer = real_kv.layers[29]
    block = compress_prefix(real_kv, 29, spec)
    n = layer.keys.shape[0] - HELD_OUT
    q = layer.queries[n]
    group = q.shape[0] // block.num_kv_heads
    probs = causal_attention_probs(q[None], layer.keys[:n], n, real_kv.scaling)
    kept = torch.zeros(block.num_kv_heads, n, dtype=torch.bool)
    kept.scatter_(1, block.positions(), True)
    kept_q = kept.repeat_interleave(group, 0)
    mass = (probs[:, 0] * ~kept_q).sum(-1, keepdim=True)
    full = attention(q, layer.keys[:n], layer.values[:n], real_kv.scaling)
    o_kept = block.attend(q, real_kv.scaling)
    assert torch.allclose(o_kept, attention(q, *block.dense(), real_kv.scaling), atol=1e-5)
    dropped_probs = (probs[:, 0] * ~kept_q) / mass.clamp_min(1e-30)
    values = layer.values[:n].repeat_interleave(group, 1)
    o_dropped = torch.einsum("hn,nhd->hd", dropped_probs, values)
    assert torch.allclose(o_kept - full, mass * (o_kept - o_dropped), atol=1e-5)


@dataclasses.dataclass(frozen=True)
class RandomDrop(TokenDropper):
    """Baseline: a uniformly random subset of the same size."""

    ratio: float = param(0.25, gt=0.0, le=1.0)
    """Kept fraction."""

    def score(self, keys, values, acc):
        gen = torch.Generator().manual_seed(0)
        return torch.rand(keys.shape[1], keys.shape[0], generator=gen)


def _retained(probs: torch.Tensor, block: DroppedKV) -> float:
    """Mean attention mass [Hq, m, n] that the queries put on the block's kept tokens."""
    kept = torch.zeros(block.num_kv_heads, probs.shape[2])
    kept.scatter_(1, block.positions(), 1.0)
    group = probs.shape[0] // block.num_kv_heads
    return float((probs * kept.repeat_interleave(group, 0)[:, None]).sum(-1).mean())


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.25", "h2o:ratio=0.25", "streaming:ratio=0.25"])
def test_attention_aware_drops_beat_random(real_kv, spec: str) -> None:
    """Held-out queries (the next tokens) keep more attention mass than with a random subset."""
    for index in real_kv.layers:
        layer = real_kv.layers[index]
        n = layer.keys.shape[0] - HELD_OUT
        chosen = compress_prefix(real_kv, index, spec)
        rand = RandomDrop(ratio=0.25).compress(layer.keys[:n], layer.values[:n], torch.arange(n))
        probs = causal_attention_probs(layer.queries[n:], layer.keys[:n], n, real_kv.scaling)
        assert _retained(probs, chosen) > _retained(probs, rand) + 0.1


def test_streaming_appends_equal_one_shot(real_kv) -> None:
    kv = real_kv.layers[14]
    c = parse_compressor_spec("streaming:sink=4,ratio=0.3")
    total = kv.keys.shape[0]
    block = c.compress(kv.keys[:100], kv.values[:100], torch.arange(100))
    for i in range(100, total, 3):
        c.append(block, kv.keys[i:i + 3], kv.values[i:i + 3], torch.arange(i, min(i + 3, total)))
        assert len(block) == budget(0.3, min(i + 3, total), 4)
    one_shot = c.compress(kv.keys, kv.values, torch.arange(total))
    assert torch.equal(block.positions(), one_shot.positions())
    assert torch.equal(block.dense()[0], one_shot.dense()[0])


def test_h2o_append_accumulates_and_evicts(real_kv) -> None:
    """Each decode step adds the new query's attention to the kept slots' accumulators, keeps
    the newest token (recent window) and evicts back to the budget."""
    kv = real_kv.layers[14]
    c = parse_compressor_spec("h2o:ratio=0.25,recent=0.25")
    n = kv.keys.shape[0] - HELD_OUT
    block = compress_prefix(real_kv, 14, c.spec())
    heads = block.num_kv_heads
    for i in range(n, n + HELD_OUT):
        keys = torch.cat([block.dense()[0], kv.keys[i:i + 1]])
        probs = causal_attention_probs(kv.queries[i][None], keys, keys.shape[0],
                                       real_kv.scaling)
        gained = probs[:, 0].reshape(heads, -1, keys.shape[0]).sum(1)
        expected = [
            dict(zip(pos.tolist() + [i], (acc + gained[h, :-1]).tolist() + [gained[h, -1].item()],
                     strict=True))
            for h, (pos, acc) in enumerate(zip(block.positions(), block.acc, strict=True))
        ]
        c.append(block, kv.keys[i:i + 1], kv.values[i:i + 1], torch.tensor([i]), probs)
        assert len(block) == budget(0.25, i + 1)
        assert block.positions()[:, -1].tolist() == [i] * heads, "the newest token is kept"
        for h in range(heads):
            kept = block.positions()[h].tolist()
            assert block.acc[h].tolist() == pytest.approx([expected[h][p] for p in kept])
            evicted = set(expected[h]) - set(kept)
            recent = int(0.25 * len(block) + 0.5)
            heavy = [expected[h][p] for p in kept[: len(kept) - recent]]
            assert all(expected[h][p] <= min(heavy) + 1e-6 for p in evicted)


def test_snapkv_appends_without_evicting(real_kv) -> None:
    kv = real_kv.layers[0]
    c = parse_compressor_spec("snapkv:ratio=0.1")
    block = compress_prefix(real_kv, 0, c.spec())
    kept = len(block)
    n = kv.keys.shape[0] - HELD_OUT
    c.append(block, kv.keys[n:], kv.values[n:], torch.arange(n, n + HELD_OUT))
    assert len(block) == kept + HELD_OUT
    assert block.positions()[:, -HELD_OUT:].tolist() == [list(range(n, n + HELD_OUT))] * 3
