"""`--vericache-store-reads auto`: read a stored prefix or recompute it, by measured rates, and
now and then read one the rates decline (a probe) so that a link that got faster is used again.
Every input is a given measurement or lookup: nothing here depends on timing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.support.host_pools import TOKEN_PAGE, HostPool, file_storage, token_page
from tests.support.servers import vericache_server_args
from vericache_sglang.config import VeriCacheConfig
from vericache_sglang.stores import pages
from vericache_sglang.stores.admission import PROBE_EVERY, ReadOrRecompute
from vericache_sglang.stores.state import StoreState
from vericache_sglang.tiers import disk

PAGE_TOKENS = 64
SLOW = 0.64  # a 64-token page read in 10 ms per token
FAST = 0.0064  # ... in 0.1 ms per token
PREFILL = (2000, 2.0)  # 1 ms per token


def _slow_link(probe_every: int = 4) -> ReadOrRecompute:
    """Auto, with a read measured ten times slower than prefill."""
    choice = ReadOrRecompute(enabled=True, probe_every=probe_every)
    choice.record_read(PAGE_TOKENS, SLOW)
    choice.record_prefill(*PREFILL)
    return choice


def test_reads_until_both_rates_are_measured_then_takes_the_faster():
    choice = ReadOrRecompute(enabled=True)
    assert choice.pages_to_read(5) == 5  # nothing measured: read, which measures
    choice.record_read(PAGE_TOKENS, SLOW)
    assert choice.pages_to_read(5) == 5  # no prefill rate yet
    choice.record_prefill(*PREFILL)  # recomputing is faster
    assert choice.pages_to_read(5) == 0
    assert choice.declined_pages == 5
    assert choice.pages_to_read(0) == 0 and choice.declined_pages == 5
    assert choice.snapshot() == {"enabled": True, "declined_pages": 5, "probes": 0,
                                 "read_seconds_per_token": SLOW / PAGE_TOKENS,
                                 "prefill_seconds_per_token": PREFILL[1] / PREFILL[0]}


def test_while_reads_measure_slow_every_nth_declined_lookup_is_read_as_a_probe():
    choice = _slow_link(probe_every=4)
    got = []
    for _ in range(3):  # three rounds: three declined lookups, then a probe that reads
        got += [choice.pages_to_read(5) for _ in range(4)]
        choice.record_read(PAGE_TOKENS, SLOW)  # the probe's page: still slow
    assert got == [0, 0, 0, 5] * 3
    assert (choice.probes, choice.declined_pages) == (3, 9 * 5)


def test_a_probe_that_measures_a_faster_link_brings_reads_back(caplog):
    choice = _slow_link(probe_every=4)
    for _ in range(9):  # a long slow spell: its rate is what the running sums hold
        choice.record_read(PAGE_TOKENS, SLOW)
    with caplog.at_level(logging.INFO, logger="vericache_sglang.stores.admission"):
        assert [choice.pages_to_read(3) for _ in range(4)] == [0, 0, 0, 3]
        choice.record_read(PAGE_TOKENS, FAST)  # the link got faster
        # The probe's read replaces the slow spell's: one page decides.
        assert choice.read.seconds_per_token == FAST / PAGE_TOKENS
        assert [choice.pages_to_read(3) for _ in range(8)] == [3] * 8
    assert (choice.probes, choice.declined_pages) == (1, 9)
    assert [r.message.split(":")[1].strip() for r in caplog.records] == [
        "3 stored pages recomputed instead of read", "reading stored pages again"]


def test_reads_after_a_probe_add_to_its_rate_and_a_later_slowdown_declines_afresh():
    choice = _slow_link(probe_every=2)
    assert [choice.pages_to_read(1) for _ in range(2)] == [0, 1]
    choice.record_read(PAGE_TOKENS, FAST)
    choice.record_read(PAGE_TOKENS, FAST / 2)  # the probe's second page: averaged in
    assert choice.read.seconds_per_token == pytest.approx(
        (0.7 * FAST + FAST / 2) / (1.7 * PAGE_TOKENS))
    assert choice.pages_to_read(1) == 1
    for _ in range(20):  # slow again: the running average follows the reads it makes
        choice.record_read(PAGE_TOKENS, SLOW)
    # The schedule starts over: the first lookup is declined, the second probes.
    assert [choice.pages_to_read(1) for _ in range(4)] == [0, 1, 0, 1]
    assert (choice.probes, choice.declined_pages) == (3, 3)


def test_always_reads_every_stored_page():
    choice = ReadOrRecompute()
    choice.record_read(PAGE_TOKENS, 10.0)
    choice.record_prefill(2000, 0.001)
    assert not choice.enabled and choice.pages_to_read(7) == 7
    assert choice.probes == choice.declined_pages == 0


def test_empty_or_instant_measurements_change_nothing():
    choice = ReadOrRecompute(enabled=True)
    choice.record_read(0, 1.0)
    choice.record_prefill(100, 0.0)
    assert choice.read.seconds_per_token is None and choice.prefill.seconds_per_token is None


def test_a_probe_schedule_below_one_is_refused():
    with pytest.raises(ValueError, match="probe_every must be at least 1"):
        ReadOrRecompute(probe_every=0)
    assert ReadOrRecompute().probe_every == PROBE_EVERY


@pytest.mark.parametrize("reads", ["auto", "always"])
def test_the_store_takes_the_choice_from_its_servers_flags(tmp_path: Path, monkeypatch, reads):
    """As a server's store starts (`register_mem_pool_host`), `--vericache-store-reads`
    turns the choice on or off; its lookups (`batch_exists`) and reads (`get`) then feed it."""
    choice = ReadOrRecompute(probe_every=2)
    config = VeriCacheConfig.build({"enable_vericache": True, "vericache_store_reads": reads})
    monkeypatch.setattr(pages, "served_config", lambda: config)
    storage = file_storage(tmp_path / "pages", StoreState(admission=choice))
    storage.register_mem_pool_host(HostPool("layer_first", torch.float32, page_size=1))
    assert choice.enabled == (reads == "auto")
    keys = [f"{i:064x}" for i in range(3)]
    for i, key in enumerate(keys):
        assert storage.set(key, token_page(50 + i))
    assert storage.batch_exists(keys) == 3  # no rate measured: read
    assert storage.get(keys[0], torch.empty(TOKEN_PAGE)) is not None
    assert choice.read.seconds_per_token is not None  # the read was measured
    choice.record_prefill(1, 1e-12)  # a prefill faster than any read
    expected = [0, 3] if reads == "auto" else [3, 3]  # declined, then a probe
    assert [storage.batch_exists(keys) for _ in range(2)] == expected


def test_auto_without_a_store_is_refused_at_startup():
    args = vericache_server_args({"vericache_store_reads": "auto",
                                  "vericache_full_tier": "device"},
                                 enable_hierarchical_cache=False, hicache_storage_backend=None)
    with pytest.raises(SystemExit, match="^vericache: error: --vericache-store-reads auto"):
        disk.configure(args)
