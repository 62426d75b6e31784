"""`--vericache-store-reads auto` through a link that gets faster: a real server declines a
stored prefix while the link is slow and reads it again once a probe has measured the faster
link, its output the same throughout.

One VeriCache server (`--vericache-store-reads auto`) and a Mooncake store, both inside a network
namespace whose loopback caps the store's data ports (`stores/shaped_link.py`; emulation, not a
real network), driven from inside by this module run as a script. The server answers a warm-up
prompt and a 448-token prompt (their prefills measured, their 7 pages each stored), then, after
each cache flush, the same prompt again, so that every answer looks its prefix up in the store:
at 10 Mbit/s the first reads it (a 64-token float32 page, 2.6 MB, takes about two seconds to
cross: measured 27 ms per token against 2.9 to prefill) and the next are declined; the link
is then set to 10 Gbit/s, the lookups are still declined (the rates say the link is slow) until
the `PROBE_EVERY`-th, a probe, reads it and measures the fast link (the page's decode sets the
pace: measured 1.2 ms per token against 2.9 to prefill; 3.7 against 4.9 with another server
test running), and the answer after the probe reads the prefix too. Every answer is the first
one's tokens (greedy, float32). The store's read lease is 1 s, shorter than a page's crossing
at 10 Mbit/s: the slow read succeeds because VeriCache reads objects in lease-sized ranges
(`stores/leased_reads.py`). About 2.5 minutes (4 beside another server test); skips, saying
why, where no namespace can be made or Mooncake cannot run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.support.identity import payload
from vericache_sglang.stores.admission import PROBE_EVERY
from vericache_tools.mooncake_service import MooncakeService, mooncake_unavailable_reason
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_args import HICACHE_STORE_ARGS, VERICACHE, server_args
from vericache_tools.server_process import ServerProcess
from vericache_tools.shaped_link import ShapedLink, set_rate, shaping_unavailable_reason

pytestmark = [pytest.mark.server, pytest.mark.timeout(900),
              pytest.mark.usefixtures("no_idle_servers")]

SLOW_MBIT = 10
FAST_MBIT = 10_000
PROMPT_TOKENS = 448
PAGE_SIZE = 64
DEVICE_TOKENS = 8192
SERVER = [*server_args(page_size=PAGE_SIZE), *HICACHE_STORE_ARGS, *VERICACHE,
          "--vericache-full-tier", "device", "--vericache-store-reads", "auto"]
"""VeriCache reading or recomputing the stored prefix by the faster measured rate, its full KV
in the device pool (as `python -m bench.remote_prefix` runs it)."""
LEASE_MS = 1000
"""The store's read lease, shorter than a page's transfer on the slow link."""
SLOW_DECLINES = 2
"""Lookups declined on the slow link before it gets faster."""


def _answer(server: ServerProcess, ids: list[int]) -> dict:
    """After a cache flush, so that the prefix is looked up in the store: the output, its
    storage hit, and the server's read-or-recompute state after it."""
    server.flush_cache()
    out = server.generate(payload(ids, "code", max_new_tokens=8))
    state = server.server_info()["internal_states"][0]["vericache_state"]["store_reads"]
    return {"output_ids": out["output_ids"],
            "storage_hit": (out["meta_info"].get("cached_tokens_details") or {})
            .get("storage", 0), **state}


def drive(model: Path) -> dict[str, list[dict]]:
    """The scenario, inside the link's namespace: each phase's answers."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = stdlib_ids(tokenizer, "inspect", PROMPT_TOKENS, start=100)
    warm_up = stdlib_ids(tokenizer, "heapq", PROMPT_TOKENS, start=0)
    answers: dict[str, list[dict]] = {}
    # A 1 s read lease: a page takes about 2 s to cross the slow link, so a read that is one
    # Mooncake get fails there on LEASE_EXPIRED; VeriCache reads it in lease-sized ranges.
    with MooncakeService(master_args=[f"--default_kv_lease_ttl={LEASE_MS}"]) as store:
        with ServerProcess(model, [*SERVER, *store.server_args()], max_total_tokens=DEVICE_TOKENS,
                           env=store.env()) as server:
            # A first prefill pays one-time costs: a warm-up's gives a steadier prefill rate.
            server.generate(payload(warm_up, "code", max_new_tokens=1))
            answers["first"] = [_answer(server, ids)]  # prefilled; its pages are stored
            store.wait_keys(4 * PROMPT_TOKENS // PAGE_SIZE)  # a page: two or three objects
            set_rate(SLOW_MBIT)
            answers["slow"] = [_answer(server, ids) for _ in range(1 + SLOW_DECLINES)]
            set_rate(FAST_MBIT)
            # The probe is the PROBE_EVERY-th lookup the rates decline; one more reads.
            answers["fast"] = [_answer(server, ids)
                               for _ in range(PROBE_EVERY - SLOW_DECLINES + 1)]
    return answers


@pytest.fixture(scope="module")
def answers(demo_model: Path) -> dict[str, list[dict]]:
    reason = shaping_unavailable_reason() or mooncake_unavailable_reason()
    if reason:
        pytest.skip(f"no emulated link and store here: {reason}")
    with ShapedLink(FAST_MBIT) as link:
        done = subprocess.run(link.command([sys.executable, "-m", __name__, str(demo_model)]),
                              capture_output=True, text=True, timeout=840,
                              cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    return json.loads(found[-1][len("RESULTS "):])


def test_a_link_that_gets_faster_is_read_again_after_a_probe(answers):
    first, slow, fast = answers["first"][0], answers["slow"], answers["fast"]
    print(f"\n[store reads] slow: read {slow[0]['read_seconds_per_token'] * 1e3:.2f} ms/token, "
          f"prefill {slow[0]['prefill_seconds_per_token'] * 1e3:.2f}; after the probe: read "
          f"{fast[-1]['read_seconds_per_token'] * 1e3:.2f} ms/token, prefill "
          f"{fast[-1]['prefill_seconds_per_token'] * 1e3:.2f}")
    assert first["storage_hit"] == 0
    # Slow: the first lookup reads (nothing measured yet), the next are declined.
    assert slow[0]["storage_hit"] > 0 and slow[0]["declined_pages"] == 0
    assert [a["storage_hit"] for a in slow[1:]] == [0] * SLOW_DECLINES
    pages = slow[1]["declined_pages"]
    assert pages == slow[0]["storage_hit"] // PAGE_SIZE
    # Fast: declined until the probe, which reads; then the prefix is read again.
    hits = [a["storage_hit"] > 0 for a in fast]
    assert hits == [False] * (len(fast) - 2) + [True, True], hits
    assert [a["probes"] for a in fast[-2:]] == [1, 1]
    assert fast[-1]["declined_pages"] == pages * (PROBE_EVERY - 1)
    assert fast[-1]["read_seconds_per_token"] < fast[-1]["prefill_seconds_per_token"]
    for answer in [*slow, *fast]:
        assert answer["output_ids"] == first["output_ids"]


if __name__ == "__main__":
    print("RESULTS " + json.dumps(drive(Path(sys.argv[1]))), flush=True)
