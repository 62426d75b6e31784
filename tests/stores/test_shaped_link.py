"""The emulated link (stores/shaped_link.py): its port filters match exactly the shaped ports,
TCP through a shaped port moves at the set rate and other ports at loopback speed, and closing
it kills what ran inside and deletes the namespace. Skips, saying why, where no network
namespace can be made."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from vericache_tools.shaped_link import (
    MOONCAKE_DATA_PORTS,
    ShapedLink,
    port_masks,
    shaping_unavailable_reason,
)

RATE_MBIT = 20

# Inside the namespace: a receiver on PORT, a sender of NBYTES to it; prints MB/s (megabits).
PROBE = """
import json, socket, sys, threading, time
port, nbytes = int(sys.argv[1]), int(sys.argv[2])
listener = socket.create_server(("127.0.0.1", port))
def drain():
    conn, _ = listener.accept()
    while conn.recv(1 << 20):
        pass
    conn.close()
receiver = threading.Thread(target=drain)
receiver.start()
sender = socket.create_connection(("127.0.0.1", port))
began = time.perf_counter()
sender.sendall(b"x" * nbytes)
sender.close()
receiver.join()
print(json.dumps(nbytes * 8 / 1e6 / (time.perf_counter() - began)))
"""


@pytest.mark.parametrize("ports", [MOONCAKE_DATA_PORTS, range(0, 65536), range(1, 2),
                                   range(30000, 30999), range(8, 9)])
def test_port_masks_match_exactly_the_range(ports):
    every = np.arange(1 << 16)
    matched = np.zeros(1 << 16, dtype=bool)
    for value, mask in port_masks(ports):
        assert value & ~mask & 0xFFFF == 0
        hit = (every & mask) == value
        assert not (matched & hit).any()  # blocks do not overlap
        matched |= hit
    assert matched.nonzero()[0].tolist() == list(ports)


def test_a_port_range_with_a_step_is_refused():
    with pytest.raises(ValueError, match="step-1 range"):
        port_masks(range(0, 10, 2))


@pytest.fixture(scope="module")
def link():
    reason = shaping_unavailable_reason()
    if reason:
        pytest.skip(f"no emulated link here: {reason}")
    with ShapedLink(RATE_MBIT) as shaped:
        yield shaped


def _mbit_per_s(link: ShapedLink, port: int, nbytes: int) -> float:
    done = subprocess.run(link.command([sys.executable, "-c", PROBE, str(port), str(nbytes)]),
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_shaped_ports_move_at_the_set_rate_and_others_do_not(link):
    shaped = _mbit_per_s(link, MOONCAKE_DATA_PORTS.start + 100, 2 << 20)
    other = _mbit_per_s(link, MOONCAKE_DATA_PORTS.start - 100, 20 << 20)
    print(f"\n  set {RATE_MBIT} Mbit/s: shaped port {shaped:.1f}, other port {other:.0f}")
    assert 0.75 * RATE_MBIT <= shaped <= 1.1 * RATE_MBIT
    assert other > 5 * RATE_MBIT  # loopback, slowed only by a busy CPU


def test_closing_kills_what_runs_inside_and_deletes_the_namespace():
    reason = shaping_unavailable_reason()
    if reason:
        pytest.skip(f"no emulated link here: {reason}")
    with ShapedLink(RATE_MBIT) as shaped:
        sleeper = subprocess.Popen(shaped.command(["sleep", "600"]))
        name = shaped.name
        assert name in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                      text=True).stdout
    assert sleeper.wait(timeout=10) != 0
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                      text=True).stdout
