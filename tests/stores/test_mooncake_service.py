"""The Mooncake store tests and benchmarks start (vericache_tools.mooncake_service):
it holds what fits its segment, refuses a put into a full store with -200 (Mooncake's
NO_AVAILABLE_HANDLE) and then evicts its oldest objects in the background (past the master's
90% high watermark), and it stops or dies whole, by process group."""

from __future__ import annotations

import time

import pytest

from vericache_tools.mooncake_service import (
    MIN_SEGMENT_SIZE,
    PARTS,
    MooncakeService,
    mooncake_unavailable_reason,
)

OBJECT = 4 << 20
NO_AVAILABLE_HANDLE = -200


@pytest.fixture(scope="module", autouse=True)
def _mooncake_runs_here() -> None:
    reason = mooncake_unavailable_reason()
    if reason:
        pytest.skip(reason)


def test_a_full_store_refuses_puts_then_evicts_its_oldest_objects():
    with MooncakeService(segment_size=4 * OBJECT) as store:
        client = store.connect()
        results = [client.put(f"object-{i}", bytes([i]) * OBJECT) for i in range(6)]
        # Four fit; eviction runs behind the refusals, so which later put it lets in varies.
        assert results[:4] == [0] * 4 and NO_AVAILABLE_HANDLE in results[4:], results
        assert store.metrics()["master_put_start_failures_total"] >= 1
        deadline = time.monotonic() + 10
        while store.key_count() == 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.key_count() < 4
        assert client.put("later", b"z" * OBJECT) == 0
        assert client.get("later") == b"z" * OBJECT
        assert not client.is_exist("object-0")
        assert store.stored_bytes() <= 4 * OBJECT


def test_a_killed_store_is_gone_and_stop_is_still_safe():
    with pytest.raises(ValueError, match="at least"):
        MooncakeService(segment_size=MIN_SEGMENT_SIZE - 1)
    store = MooncakeService(segment_size=MIN_SEGMENT_SIZE).start()
    try:
        assert store.alive()
        store.kill("master")
        assert not store.alive("master") and store.alive("segment")
        store.kill()
        assert not any(store.alive(part) for part in PARTS)
    finally:
        store.stop()
