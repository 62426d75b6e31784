"""The servers the tests, demo and benchmarks start come up even when their port is taken
between choosing it and the server's bind (seen in CI: the server logged "address already in
use" and then waited for a shutdown that never came, until the start timed out); the tests'
servers are forked from a launcher that has imported SGLang where their environment allows,
and one that exits is reported with its status either way."""

from __future__ import annotations

import socket

import pytest
import requests

from tests.support.servers import SERVER_ARGS
from vericache_tools.forked_launch import ForkedServer
from vericache_tools.mooncake_service import MooncakeService
from vericache_tools.server_process import (
    HOST,
    PORTS,
    ServerProcess,
    ServerStartError,
    free_port,
)

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("no_idle_servers")]


def test_ports_are_drawn_below_the_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    assert PORTS.stop <= min(ephemeral_low, 22000)  # SGLang's internal ports: 22000-29999
    assert all(free_port() in PORTS for _ in range(20))


def test_a_port_taken_before_the_server_binds_is_chosen_again(demo_model):
    server = ServerProcess(demo_model, SERVER_ARGS)
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind((HOST, taken))
        squatter.listen()
        with server:
            assert server.port != taken
            assert requests.get(f"{server.url}/health", timeout=30).status_code == 200


def test_only_servers_of_the_launchers_environment_are_forked(demo_model, forked_launcher):
    assert ServerProcess.forked_launcher is forked_launcher
    assert ServerProcess(demo_model, SERVER_ARGS).forks()
    assert not ServerProcess(demo_model, SERVER_ARGS, env={"VERICACHE_UNSET": "1"}).forks()
    store = MooncakeService()  # not started: its client's variables only
    assert ServerProcess(demo_model, SERVER_ARGS, env=store.env()).forks()
    assert not ServerProcess(demo_model, SERVER_ARGS,
                             env={**store.env(), "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE":
                                  "1"}).forks()


def test_a_forked_server_that_exits_reports_its_status(demo_model, monkeypatch):
    """Under an environment changed since the last launcher started: a launcher of its own."""
    monkeypatch.setenv("VERICACHE_TEST_CHANGED", "1")
    server = ServerProcess(demo_model, [*SERVER_ARGS, "--enable-vericache",
                                        "--vericache-compressor", "nonesuch"])
    with pytest.raises(ServerStartError, match="exited with status [1-9]") as error:
        server.start()
    assert isinstance(server.proc, ForkedServer)
    assert server.proc._launcher.env["VERICACHE_TEST_CHANGED"] == "1"
    assert "nonesuch" in str(error.value)
