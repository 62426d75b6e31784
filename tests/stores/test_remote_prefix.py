"""A stored prefix behind an emulated 20 Mbit/s link, so slow that recomputing it wins: a
VeriCache server with `--vericache-store-reads auto` recomputes it (counted), and its output is
plain SGLang's.

The scenario is `bench.remote_prefix`'s, at a small size (the same code the issue's benchmark
runs, so the test and the table measure one thing): a Mooncake store, a VeriCache server A
storing a 640-token prefix and a 640-token warm-up, then server B, inside a network namespace
whose loopback caps the store's data ports (`stores/shaped_link.py`; emulation, not a real
network). B answers the warm-up (measuring its reads on that link) and then the stored prefix
plus a question. At 20 Mbit/s a 64-token coded page (2.6 MB in float32) takes about a second to
arrive and prefilling its tokens about a fifth of that. Plain SGLang without a store answers
the same requests, the reference. Skips, saying why, where no namespace can be made or
Mooncake cannot run. (Drafting before the exact KV arrives, `--vericache-early-drafting`, is
tests/stores/test_mooncake_vericache.py's server B; over this link, `python -m
bench.remote_prefix --configs recompute vericache-early`.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.remote_prefix import PAGE_SIZE

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

PREFIX_TOKENS = 640
SLOW_MBIT = 20


@pytest.fixture(scope="module")
def measured(tmp_path_factory, demo_model) -> dict:
    out = tmp_path_factory.mktemp("remote_prefix") / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.remote_prefix", "--model", str(demo_model),
         "--prefix-tokens", str(PREFIX_TOKENS), "--rates-mbit", str(SLOW_MBIT),
         "--batch", "1", "--new-tokens", "8", "--configs", "recompute", "vericache-auto",
         "--json", str(out)],
        capture_output=True, text=True, timeout=1000, cwd=Path(__file__).parents[2])
    if done.returncode == 2 and "cannot run here" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print("\n" + done.stdout[-2500:])
    rows = json.loads(out.read_text())["results"]["rows"]
    return {(row["config"], row["rate_mbit"]): row for row in rows}


def test_a_slow_link_makes_the_server_recompute_the_stored_prefix(measured):
    slow = measured[("vericache-auto", SLOW_MBIT)]
    assert slow["identical"] == slow["compared"] == 1
    assert slow["storage_hit"] == 0
    # Every stored page of the prefix was declined, counted; none crossed the link.
    assert slow["store_read"]["declined_pages"] == PREFIX_TOKENS // PAGE_SIZE
    assert slow["store_read"]["read_coded_pages"] == 0
    assert slow["link_bytes_per_request"] < 200_000  # lookups only; a coded page is 2.6 MB
