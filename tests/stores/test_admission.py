"""`--vericache-store-reads auto`: read a stored prefix or recompute it, by measured rates."""

from __future__ import annotations

import pytest

from tests.conftest import vericache_server_args
from vericache_sglang.stores.admission import ReadOrRecompute
from vericache_sglang.tiers import disk


def test_reads_until_both_rates_are_measured_then_takes_the_faster():
    choice = ReadOrRecompute()
    choice.enabled = True
    assert choice.pages_to_read(5) == 5  # nothing measured: read, which measures
    choice.record_read(64, 0.64)  # 10 ms per token
    assert choice.pages_to_read(5) == 5  # no prefill rate yet
    choice.record_prefill(2000, 2.0)  # 1 ms per token: recomputing is faster
    assert choice.pages_to_read(5) == 0
    assert choice.declined_pages == 5
    assert choice.pages_to_read(0) == 0 and choice.declined_pages == 5
    for _ in range(20):  # reads get fast (a warm store): the running average follows
        choice.record_read(64, 0.0064)
    assert choice.pages_to_read(3) == 3
    assert choice.snapshot()["declined_pages"] == 5


def test_always_reads_every_stored_page():
    choice = ReadOrRecompute()
    choice.record_read(64, 10.0)
    choice.record_prefill(2000, 0.001)
    assert not choice.enabled and choice.pages_to_read(7) == 7


def test_empty_or_instant_measurements_change_nothing():
    choice = ReadOrRecompute()
    choice.record_read(0, 1.0)
    choice.record_prefill(100, 0.0)
    assert choice.read.seconds_per_token is None and choice.prefill.seconds_per_token is None


def test_auto_without_a_store_is_refused_at_startup():
    args = vericache_server_args({"vericache_store_reads": "auto",
                                  "vericache_full_tier": "device"},
                                 enable_hierarchical_cache=False, hicache_storage_backend=None)
    with pytest.raises(SystemExit, match="^vericache: error: --vericache-store-reads auto"):
        disk.configure(args)
