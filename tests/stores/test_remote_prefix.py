"""A stored prefix behind an emulated 20 Mbit/s link, slow enough that recomputing it wins
and that its exact KV takes seconds to arrive: a VeriCache server with
`--vericache-store-reads auto` recomputes it (counted), one with `--vericache-early-drafting`
drafts on its pages' drafting level before their exact KV has arrived (counted), and both
emit plain SGLang's tokens.

The scenario is `bench.remote_prefix`'s, at a small size (the same code the issue's benchmark
runs, so the test and the table measure one thing): a Mooncake store, a VeriCache server A
storing a 640-token prefix and a 640-token warm-up (its pages shared by both configurations),
then each server B, inside a network namespace whose loopback caps the store's data ports
(`stores/shaped_link.py`; emulation, not a real network). B answers the warm-up (measuring its
reads on that link) and then the stored prefix plus a question. At 20 Mbit/s a 64-token coded
page (2.6 MB in float32) takes about a second to arrive, its drafting part (0.5 MB) a fifth of
that, and prefilling its tokens about a fifth too. Plain SGLang without a store answers the
same requests, the reference. Skips, saying why, where no namespace can be made or Mooncake
cannot run.
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
         "vericache-early",
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


def test_a_slow_link_drafts_before_the_exact_kv_has_arrived(measured):
    """At 20 Mbit/s a page's exact part (2.1 MB) takes most of a second, its drafting level
    (0.5 MB) a fifth of that: the server answered on the drafting level of every page, drafted
    before the exact KV was in (counted), read every exact part, and emitted plain SGLang's
    tokens."""
    slow = measured[("vericache-early", SLOW_MBIT)]
    assert slow["identical"] == slow["compared"] == 1
    assert slow["storage_hit"] == PREFIX_TOKENS
    read = slow["store_read"]
    pages = PREFIX_TOKENS // PAGE_SIZE
    assert read["read_drafting_pages"] == read["read_exact_pages"] == pages
    assert read["read_coded_pages"] == 0
    # More than the suffix's own draft: draft steps ran while the exact KV was on its way.
    assert read["early_drafts"] >= 2
    assert read["read_drafting_bytes"] < read["read_exact_bytes"] / 2
