"""The staging area streams a forward's full KV from the host tier, one layer's units at a time,
through a bounded set of device buffers (tiers/staging.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vericache_sglang.tiers.staging import StagingArea, StagingTooSmall

LAYERS, HEADS, DIM, SLOTS = 3, 2, 8, 400


@pytest.fixture
def full_pool() -> SimpleNamespace:
    torch.manual_seed(0)
    return SimpleNamespace(
        layer_num=LAYERS, head_num=HEADS, head_dim=DIM,
        k_buffer=[torch.randn(SLOTS, HEADS, DIM) for _ in range(LAYERS)],
        v_buffer=[torch.randn(SLOTS, HEADS, DIM) for _ in range(LAYERS)],
    )


def _rows(*lengths: int) -> list[torch.Tensor]:
    perm = torch.randperm(SLOTS)
    out, at = [], 0
    for n in lengths:
        out.append(perm[at:at + n])
        at += n
    return out


def test_units_hold_each_requests_prefix_in_order(full_pool):
    staging = StagingArea(full_pool, unit_tokens=100, depth=2, device="cpu")
    rows = _rows(40, 70, 10)
    fetch = staging.start(staging.plan(rows, [5, 5, 5]))
    # 40 + 5 and 70 + 5 do not share a 100-row unit; 70 + 5 and 10 + 5 do.
    assert [u.requests for u in fetch.by_layer[0]] == [[0], [1, 2]]
    for layer in range(LAYERS):
        for unit in fetch.by_layer[layer]:
            staging.wait(unit)
            for j, i in enumerate(unit.requests):
                start = unit.starts[j]
                assert torch.equal(unit.k[start:start + len(rows[i])],
                                   full_pool.k_buffer[layer][rows[i]])
                assert torch.equal(unit.v[start:start + len(rows[i])],
                                   full_pool.v_buffer[layer][rows[i]])
            staging.release(unit)
    stats = staging.take_stats()
    row_bytes = HEADS * DIM * 4
    assert stats.bytes == 2 * LAYERS * 120 * row_bytes
    assert staging.allocated_bytes() == 2 * 2 * 100 * row_bytes
    # Each request's share, by batch row; a direct read (drafting windows) adds to it.
    staging.record_direct(2 * LAYERS * 9 * row_bytes, 0.0, [0, 9, 0])
    assert staging.take_request_bytes() == {i: 2 * LAYERS * n * row_bytes
                                            for i, n in enumerate([40, 79, 10])}
    assert staging.take_request_bytes() == {}
    staging.close()


def test_the_copier_runs_at_most_depth_units_ahead(full_pool):
    staging = StagingArea(full_pool, unit_tokens=64, depth=2, device="cpu")
    fetch = staging.start(staging.plan(_rows(50), [1]))
    # of 3 layers' units, the first two fill both buffers; the third waits for a release
    # however long it is given (no fixed sleep: a slow machine only makes this test slower)
    assert fetch.units[0].done.wait(30) and fetch.units[1].done.wait(30)
    assert not fetch.units[2].done.wait(0.5)
    staging.release(staging.wait(fetch.units[0]))
    staging.wait(fetch.units[2])  # the freed buffer takes the third
    staging.drain(fetch)
    # drained: the next forward's units are copied
    again = staging.start(staging.plan(_rows(20), [1]))
    for unit in again.units:
        staging.release(staging.wait(unit))
    staging.close()


def test_a_request_larger_than_a_unit_is_a_clear_error(full_pool):
    staging = StagingArea(full_pool, unit_tokens=32, depth=2, device="cpu")
    with pytest.raises(StagingTooSmall, match="--vericache-staging-budget"):
        staging.plan(_rows(30), [3])
    staging.close()


def test_a_failed_copy_surfaces_in_the_forward(full_pool):
    staging = StagingArea(full_pool, unit_tokens=64, depth=2, device="cpu")
    fetch = staging.start(staging.plan([torch.tensor([SLOTS + 5])], [1]))  # no such slot
    with pytest.raises(IndexError):
        staging.wait(fetch.units[0])
    staging.drain(fetch)
    staging.close()
