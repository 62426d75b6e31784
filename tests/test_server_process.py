"""The servers the tests, demo and benchmarks start come up even when their port is taken
between choosing it and the server's bind (seen in CI: the server logged "address already in
use" and then waited for a shutdown that never came, until the start timed out)."""

from __future__ import annotations

import socket

import pytest
import requests

from tests.support.servers import SERVER_ARGS
from vericache_tools.server_process import HOST, PORTS, ServerProcess, free_port

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
