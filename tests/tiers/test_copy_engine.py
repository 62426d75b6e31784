"""The copy engine moves full-KV rows from host memory into reusable device buffers, one key
(layer or staging unit) at a time, and refuses out-of-order use (tiers/copy_engine.py). The CPU
path runs here; the CUDA test runs where a GPU is."""

from __future__ import annotations

import time

import pytest
import torch

from vericache_sglang.tiers.copy_engine import (
    CopyEngine,
    CopyOrderError,
    PinnedBuffers,
    measure_copy,
    pinned_empty,
)

LAYERS, SLOTS, HEADS, DIM = 3, 64, 2, 4


def _pool(dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return [(torch.randn(SLOTS, HEADS, DIM).to(dtype), torch.randn(SLOTS, HEADS, DIM).to(dtype))
            for _ in range(LAYERS)]


def _buffers(rows: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((rows, HEADS, DIM), -1.0, device=device),
             torch.full((rows, HEADS, DIM), -1.0, device=device)) for _ in range(2)]


def test_rows_land_in_order_in_their_segments_of_reused_buffers():
    pool, buffers = _pool(), _buffers(16)
    pointers = [(k.data_ptr(), v.data_ptr()) for k, v in buffers]
    engine = CopyEngine("cpu")
    for _ in range(2):  # two rounds through the same two buffers
        for layer in range(LAYERS):
            rows = torch.randperm(SLOTS)[:9]
            k, v = buffers[layer % 2]
            # two requests: 5 rows at 0, 4 rows at 8 (rows 5..7 are left for new tokens)
            engine.issue(layer, [(pool[layer][0], k), (pool[layer][1], v)], rows,
                         segments=[(0, 5), (8, 4)])
            engine.wait(layer)
            assert torch.equal(k[:5], pool[layer][0][rows[:5]])
            assert torch.equal(k[8:12], pool[layer][0][rows[5:]])
            assert torch.equal(v[:5], pool[layer][1][rows[:5]])
            assert torch.equal(v[8:12], pool[layer][1][rows[5:]])
            assert (k[5:8] == -1).all() and (k[12:] == -1).all()
            engine.release(layer)
    assert [(k.data_ptr(), v.data_ptr()) for k, v in buffers] == pointers


def test_pinned_buffers_are_reused_and_grow_only_when_too_small():
    pinned = PinnedBuffers(2)
    first, a = pinned.take(100)
    second, b = pinned.take(100)
    assert first != second and a.data_ptr() != b.data_ptr()
    assert pinned.take(80) == (first, a)  # round robin, large enough: the same storage
    _, grown = pinned.take(400)  # second buffer, too small: replaced
    assert grown.numel() >= 400 and grown.data_ptr() != b.data_ptr()
    assert pinned.take(10)[1].data_ptr() == a.data_ptr()
    assert pinned.take(400)[1].data_ptr() == grown.data_ptr()
    with pytest.raises(ValueError, match="at least two"):
        PinnedBuffers(1)


def test_out_of_order_use_is_an_error():
    pool, buffers = _pool(), _buffers(8)
    engine = CopyEngine("cpu")
    pair = [(pool[0][0], buffers[0][0])]
    with pytest.raises(CopyOrderError, match="never issued"):
        engine.wait(0)
    with pytest.raises(CopyOrderError, match="never issued"):
        engine.release(0)
    engine.issue(0, pair, torch.arange(4))
    with pytest.raises(CopyOrderError, match="before it was released"):
        engine.issue(0, pair, torch.arange(4))
    engine.wait(0)
    with pytest.raises(CopyOrderError, match="twice"):
        engine.wait(0)
    engine.release(0)
    with pytest.raises(CopyOrderError, match="after its buffer was released"):
        engine.wait(0)
    with pytest.raises(CopyOrderError, match="released twice"):
        engine.release(0)
    with pytest.raises(CopyOrderError, match="never issued"):
        engine.wait(1)  # a layer never issued
    engine.issue(0, pair, torch.arange(4))  # released: the key may be issued again
    engine.release(0)  # released unread (a drained forward)


def test_a_copy_that_does_not_fit_is_refused():
    pool, buffers = _pool(), _buffers(8)
    engine = CopyEngine("cpu")
    k = buffers[0][0]
    with pytest.raises(ValueError, match="do not fit a destination of 8 rows"):
        engine.issue(0, [(pool[0][0], k)], torch.arange(9))
    with pytest.raises(ValueError, match="do not fit a destination of 8 rows"):
        engine.issue(0, [(pool[0][0], k)], torch.arange(4), segments=[(6, 4)])
    with pytest.raises(ValueError, match="segments hold 3 rows"):
        engine.issue(0, [(pool[0][0], k)], torch.arange(4), segments=[(0, 3)])
    with pytest.raises(ValueError, match="do not fit a destination"):
        engine.issue(0, [(pool[0][0], k.to(torch.float16))], torch.arange(4))
    with pytest.raises(IndexError):  # a source row out of range
        engine.issue(0, [(pool[0][0], k)], torch.tensor([SLOTS]))
    with pytest.raises(CopyOrderError, match="never issued"):  # nothing refused was issued
        engine.wait(0)


def test_stats_count_the_bytes_copied():
    pool = _pool(torch.bfloat16)
    k, v = (torch.empty(16, HEADS, DIM, dtype=torch.bfloat16) for _ in range(2))
    engine = CopyEngine("cpu")
    expected = 0
    for layer, n in enumerate([5, 16, 0]):
        rows = torch.randperm(SLOTS)[:n]
        engine.issue(layer, [(pool[layer][0], k), (pool[layer][1], v)], rows)
        expected += k[:n].nbytes + v[:n].nbytes
        engine.wait(layer)
        engine.release(layer)
    stats = engine.take_stats()
    assert stats.bytes == expected
    assert stats.copy_s > 0
    assert engine.take_stats().bytes == 0


def test_measure_copy_runs_on_a_cpu():
    def compute(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        torch.einsum("nhd,mhd->hnm", k, v).softmax(-1)

    result = measure_copy(2, 32, 2, 8, torch.float32, "cpu", compute, repeats=1)
    assert result["bytes"] == 2 * 2 * 32 * 2 * 8 * 4
    assert result["copy_gbps"] > 0 and result["h2d_gbps"] > 0
    assert 0 <= result["hidden_fraction"] <= 1
    assert "hidden_fraction" not in measure_copy(1, 8, 1, 4, torch.float32, "cpu", repeats=1)


def test_pinned_empty_is_host_memory():
    t = pinned_empty((4, 2), torch.float16)
    assert t.device.type == "cpu" and t.shape == (4, 2)
    assert t.is_pinned() == torch.cuda.is_available()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_land_and_wait_does_not_block_the_host():
    pool = _pool(torch.bfloat16)
    buffers = [(torch.zeros(16, HEADS, DIM, dtype=torch.bfloat16, device="cuda"),
                torch.zeros(16, HEADS, DIM, dtype=torch.bfloat16, device="cuda"))
               for _ in range(2)]
    engine = CopyEngine("cuda")
    expected = 0
    for layer in range(LAYERS):
        rows = torch.randperm(SLOTS)[:12]
        k, v = buffers[layer % 2]
        if layer == LAYERS - 1:  # keep the copy stream busy: the copy lands ~1 s later
            with torch.cuda.stream(engine.stream):
                torch.cuda._sleep(2_000_000_000)
        ticket = engine.issue(layer, [(pool[layer][0], k), (pool[layer][1], v)], rows,
                              segments=[(0, 7), (9, 5)])
        began = time.perf_counter()
        engine.wait(layer)
        waited = time.perf_counter() - began
        got_k, got_v = k.clone(), v.clone()  # on the current stream, after the wait
        expected += got_k[:12].nbytes + got_v[:12].nbytes
        if layer == LAYERS - 1:
            assert waited < 0.05 and not ticket.done.query()
        engine.release(layer)
        torch.cuda.synchronize()
        assert torch.equal(got_k[:7].cpu(), pool[layer][0][rows[:7]])
        assert torch.equal(got_k[9:14].cpu(), pool[layer][0][rows[7:]])
        assert torch.equal(got_v[:7].cpu(), pool[layer][1][rows[:7]])
        assert torch.equal(got_v[9:14].cpu(), pool[layer][1][rows[7:]])
    stats = engine.take_stats()
    assert stats.bytes == expected and stats.copy_s > 0
    assert pinned_empty((1,), torch.uint8).is_pinned()
