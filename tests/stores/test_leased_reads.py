"""A Mooncake object read through a link too slow for the store's read lease: one `get` fails on
`LEASE_EXPIRED`, VeriCache's `LeasedReader` reads the same bytes in lease-sized ranges.

A real Mooncake store with a 1 s lease and a client, inside a network namespace whose loopback
caps the store's data ports at 8 Mbit/s (`stores/shaped_link.py`; emulation): a 3 MiB object
takes about 3 s to cross. This module runs itself as a script inside the namespace. Skips,
saying why, where no namespace can be made or Mooncake cannot run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vericache_sglang.stores.leased_reads import FIRST_RANGE_BYTES, LeasedReader
from vericache_sglang.stores.link import LinkMeter
from vericache_tools.mooncake_service import MooncakeService, mooncake_unavailable_reason
from vericache_tools.shaped_link import ShapedLink, shaping_unavailable_reason

pytestmark = pytest.mark.timeout(300)

RATE_MBIT = 8
LEASE_MS = 1000
OBJECT_BYTES = 3 << 20


def drive() -> dict:
    """Inside the namespace: one object put, read with a plain get and with the reader."""
    data = os.urandom(OBJECT_BYTES)
    with MooncakeService(master_args=[f"--default_kv_lease_ttl={LEASE_MS}"]) as store:
        client = store.connect(local_buffer_size=2 * OBJECT_BYTES)
        assert client.put("page", data) == 0
        plain = client.get("page")
        reader = LeasedReader(client, LinkMeter())
        read = reader.get("page")
        return {"plain_bytes": len(plain), "read_equal": read == data,
                "ranges": reader.ranges, "missing": reader.get("no-such-page")}


@pytest.fixture(scope="module")
def outcome() -> dict:
    reason = shaping_unavailable_reason() or mooncake_unavailable_reason()
    if reason:
        pytest.skip(f"no emulated link and store here: {reason}")
    with ShapedLink(RATE_MBIT) as link:
        done = subprocess.run(link.command([sys.executable, "-m", __name__]),
                              capture_output=True, text=True, timeout=240,
                              cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    return json.loads(found[-1][len("RESULTS "):])


def test_one_get_outlasts_the_lease_and_fails(outcome):
    assert outcome["plain_bytes"] == 0


def test_the_reader_gets_every_byte_in_ranges(outcome):
    assert outcome["read_equal"]
    # The first range before any measure, then ranges of about a second at 1 MB/s.
    assert outcome["ranges"] >= OBJECT_BYTES // FIRST_RANGE_BYTES


def test_a_missing_object_is_none(outcome):
    assert outcome["missing"] is None


if __name__ == "__main__":
    print("RESULTS " + json.dumps(drive()), flush=True)
