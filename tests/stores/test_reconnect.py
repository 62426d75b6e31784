"""A store that fails to build (`stores/reconnect.py`): an outage is retried, a configuration or
programming error stops startup with one line. The store is a real TCP port on 127.0.0.1,
probed by the Mooncake backend's own probe (`master_unreachable`): closed, the store is down;
listening, it answers, and a later attempt builds SGLang's file backend in its place."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from vericache_sglang import startup
from vericache_sglang.stores.mooncake import master_unreachable
from vericache_sglang.stores.reconnect import RETRY_ENV, ReconnectingStore, build_or_reconnect
from vericache_sglang.stores.state import StoreState
from vericache_tools.server_process import HOST, free_port

RETRY_SECONDS = 0.2
PATIENCE = 60.0
"""Seconds a test waits for a background attempt before failing: generous, the machine may be
busy."""


@pytest.fixture
def port(monkeypatch) -> int:
    """A closed port on 127.0.0.1 (the store's master, down), with attempts every 0.2 s."""
    monkeypatch.setenv(RETRY_ENV, str(RETRY_SECONDS))
    return free_port()


@pytest.fixture
def answering(port) -> Iterator[Callable[[], None]]:
    """Call to make the store answer: a listener on `port`, closed after the test."""
    listeners = []

    def listen() -> None:
        listener = socket.create_server((HOST, port))
        listeners.append(listener)

    yield listen
    for listener in listeners:
        listener.close()


@pytest.fixture
def startup_line() -> Iterator[Path]:
    """Where `startup.scheduler_error` leaves its line for the launcher (this process's
    parent here), removed after the test."""
    path = Path(startup._error_file(os.getppid()))
    path.unlink(missing_ok=True)
    yield path
    path.unlink(missing_ok=True)


def _probe(port: int) -> Callable[[], str | None]:
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="demo", extra_config={"master_server_address": f"{HOST}:{port}"})
    return lambda: master_unreachable(config)


def _file_backend(path: Path) -> Callable[[], HiCacheFile]:
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="demo", extra_config={"file_storage_path": str(path)})
    return lambda: HiCacheFile(config)


def _raises(error: Exception) -> Callable[[], HiCacheFile]:
    def build() -> HiCacheFile:
        raise error
    return build


def _until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not done():
        assert time.monotonic() < deadline, f"no {what} within {PATIENCE:.0f} s"
        time.sleep(RETRY_SECONDS / 4)


@pytest.mark.parametrize("error", [
    ValueError("Either master_server_address or client_server_address is required in "
               "extra_config"),
    TypeError("setup() got an unexpected keyword argument 'tenant_id'"),
    KeyError("protocol"),
    NotImplementedError("layout page_first_direct"),
], ids=lambda e: type(e).__name__)
def test_a_build_that_fails_while_the_store_answers_stops_startup_with_one_line(
        port, answering, startup_line, error):
    answering()
    with pytest.raises(SystemExit) as stop:
        build_or_reconnect("mooncake", _raises(error), _probe(port), StoreState())
    assert stop.value.code == 1
    line = startup_line.read_text()
    assert line == ("vericache: error: the mooncake store (--hicache-storage-backend "
                    f"mooncake) cannot be used: {type(error).__name__}: {error}")
    assert "\n" not in line


@pytest.mark.parametrize("error", [
    RuntimeError("Failed to setup Mooncake store, error code: -1"),
    ConnectionRefusedError(111, "Connection refused"),
    TimeoutError("timed out"),
], ids=["setup failed", "refused", "timed out"])
def test_a_build_that_cannot_reach_the_store_is_retried(port, answering, error):
    answering()
    store = build_or_reconnect("mooncake", _raises(error), _probe(port), StoreState())
    assert isinstance(store, ReconnectingStore)
    assert store.batch_exists(["page"]) == 0


def test_a_build_that_fails_as_the_store_goes_down_is_retried(port):
    """Any error counts as an outage when the store stopped answering during the build (here
    Mooncake's server check, which raises `ValueError` when the master does not come up)."""
    listener = socket.create_server((HOST, port))

    def build() -> HiCacheFile:
        listener.close()
        raise ValueError("Launch mooncake store server timeout")

    store = build_or_reconnect("mooncake", build, _probe(port), StoreState())
    assert isinstance(store, ReconnectingStore)


def test_an_unreachable_store_serves_misses_and_is_reached_once_it_answers(
        port, answering, tmp_path, caplog, monkeypatch):
    """Down: every lookup a miss and every write refused, each counted as `unavailable`; each
    attempt fails, counted and logged at WARNING. Up: the next attempt builds the backend and
    calls go to it."""
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    caplog.set_level(logging.INFO, logger="vericache_sglang.stores.reconnect")
    page = torch.arange(16, dtype=torch.float32)
    state = StoreState()
    store = build_or_reconnect("mooncake", _file_backend(tmp_path), _probe(port), state)
    assert isinstance(store, ReconnectingStore)
    assert store.batch_exists(["page"]) == 0
    assert store.set("page", page) is False
    assert store.batch_get_v1(["page"], torch.zeros(1, dtype=torch.int64)) == [False]
    assert state.stats.snapshot()["faults"]["unavailable"] >= 3
    _until(lambda: store.batch_exists(["page"]) == 0 and state.reconnects.failures > 0,
           "failed attempt counted")
    assert any(r.levelno == logging.WARNING and "still unreachable" in r.getMessage()
               and f"{HOST}:{port}" in r.getMessage() for r in caplog.records)
    attempts = state.reconnects.attempts
    answering()
    _until(lambda: store.set("page", page), "write through the reconnected store")
    assert store.exists("page") and list(tmp_path.glob("page*.bin"))
    assert state.reconnects.attempts > attempts
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_a_store_that_answers_but_cannot_be_built_ends_the_attempts(port, answering, caplog):
    """Down at startup, then up, but its build fails with a configuration error: logged at
    ERROR with the cause, and no further attempt (a retry would not mend it)."""
    caplog.set_level(logging.WARNING, logger="vericache_sglang.stores.reconnect")
    builds = []

    def build() -> HiCacheFile:
        builds.append(1)
        raise ValueError("Invalid global_segment_size: missing number before 'gb'")

    state = StoreState()
    store = build_or_reconnect("mooncake", build, _probe(port), state)
    assert isinstance(store, ReconnectingStore) and not builds
    answering()

    def refused() -> bool:
        store.batch_exists(["page"])
        return any(r.levelno == logging.ERROR and "cannot be used: ValueError: Invalid "
                   "global_segment_size" in r.getMessage() for r in caplog.records)

    _until(refused, "ERROR line for the build")
    attempts = state.reconnects.attempts
    for _ in range(5):  # several intervals: none starts another attempt
        time.sleep(2 * RETRY_SECONDS)
        assert store.batch_exists(["page"]) == 0
    assert builds == [1] and state.reconnects.attempts == attempts
