"""The disk tier (`--vericache-full-tier disk`): pages evicted from the host full tier go to
files through SGLang's hierarchical cache, and come back with output identical to plain
SGLang's; a corrupted, deleted or truncated page file, or a disk directory that is gone, makes
that prefix recompute from the bad page on, with identical output, and is counted.

One VeriCache server: a host full tier of 3,072 tokens, so four 1,000-token prompts in turn
spill the first to disk; SGLang's prefetch waits for the whole prefix (`wait_complete`), so the
reloaded token counts are exact rather than timing-dependent. The store is a slow one: SGLang's
own fault injector delays every storage call by up to 50 ms
(`SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY`).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import requests
from sglang.srt.mem_cache.utils import get_hash_str

from tests.support.identity import payload
from tests.support.servers import FULL_KV_BYTES_PER_TOKEN, SERVER_ARGS, ServerSpec
from vericache_sglang.stores.file import DIGEST_BYTES
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_process import ServerProcess

# SGLang's hierarchical cache keeps 10 GiB of host memory free.
pytestmark = [pytest.mark.server, pytest.mark.timeout(1200),
              pytest.mark.usefixtures("no_idle_servers")]

HOST_TOKENS = 3072
MODULES = ["textwrap", "argparse", "difflib", "inspect"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vericache-disk")


@pytest.fixture(scope="module")
def disk_server(demo_model: Path, disk_dir: Path, servers) -> ServerProcess:
    return servers(ServerSpec.of(demo_model, [
        *SERVER_ARGS, "--max-running-requests", "4",
        "--enable-vericache", "--vericache-full-tier", "disk",
        "--vericache-disk-dir", str(disk_dir),
        "--vericache-full-tier-budget", str(HOST_TOKENS * FULL_KV_BYTES_PER_TOKEN),
        "--hicache-storage-prefetch-policy", "wait_complete",
    ], max_total_tokens=8192, env={"SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY": "0.05"}))[0]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [stdlib_ids(tokenizer, module, 1000, start=200) for module in MODULES]


@pytest.fixture(scope="module")
def expected(plain, prompts) -> list[list[int]]:
    return [out["output_ids"] for out in plain.all([_payload(ids) for ids in prompts])]


def _payload(ids: list[int]) -> dict:
    return payload(ids, "code", max_new_tokens=NEW_TOKENS)


def _ask(server: ServerProcess, ids: list[int]) -> tuple[list[int], dict]:
    out = server.generate(_payload(ids))
    # SGLang leaves the details out when nothing was cached.
    return out["output_ids"], out["meta_info"].get("cached_tokens_details") or {}


def _page_file(directory: Path, ids: list[int], page: int) -> Path:
    """The file of the prompt's `page`-th page (one token per page): SGLang's chained hash."""
    key = get_hash_str(ids, None, 1)[page]
    (path,) = directory.glob(f"{key}_*.bin")
    return path


def _faults(server: ServerProcess) -> dict[str, int]:
    return server.server_info()["internal_states"][0]["vericache_state"]["disk_faults"]


def test_a_prefix_spilled_to_disk_reloads_with_identical_output(disk_server, disk_dir,
                                                                 prompts, expected):
    assert sum(len(ids) + NEW_TOKENS for ids in prompts) > HOST_TOKENS
    assert [_ask(disk_server, ids)[0] for ids in prompts] == expected
    files = list(disk_dir.glob("*.bin"))
    assert len(files) >= 3000
    assert {f.stat().st_size for f in files} == {FULL_KV_BYTES_PER_TOKEN + DIGEST_BYTES}
    output, cached = _ask(disk_server, prompts[0])
    assert output == expected[0]
    assert cached["device"] == 0 and cached["host"] == 0 and cached["storage"] >= 999


def test_a_context_larger_than_the_host_tier_is_refused_for_that_request(disk_server, tokenizer,
                                                                         prompts, expected):
    too_long = stdlib_ids(tokenizer, "typing", HOST_TOKENS + 500)
    response = requests.post(f"{disk_server.url}/generate", json=_payload(too_long), timeout=300)
    assert response.status_code == 400
    assert "exceeds the maximum allowed length" in response.json()["error"]["message"]
    assert _ask(disk_server, prompts[0])[0] == expected[0]


def test_bad_page_files_recompute_from_the_bad_page(disk_server, disk_dir, prompts, expected):
    disk_server.flush_cache()  # the host tiers are emptied; the files stay
    before = _faults(disk_server)
    corrupt = _page_file(disk_dir, prompts[1], 500)
    data = bytearray(corrupt.read_bytes())
    data[4000] ^= 0x10
    corrupt.write_bytes(bytes(data))
    os.remove(_page_file(disk_dir, prompts[2], 300))
    short = _page_file(disk_dir, prompts[3], 200)
    short.write_bytes(short.read_bytes()[:1000])
    for i, good_pages in ((1, 500), (2, 300), (3, 200)):
        output, cached = _ask(disk_server, prompts[i])
        assert output == expected[i], MODULES[i]
        assert cached["storage"] == good_pages, (MODULES[i], cached)
    after = _faults(disk_server)
    for kind in ("corrupt", "missing", "short"):
        assert after[kind] > before[kind], (kind, before, after)
    metrics = requests.get(f"{disk_server.url}/metrics", timeout=30).text
    for kind in ("corrupt", "missing", "short"):
        counted = re.search(rf'^vericache:disk_faults_total{{[^}}]*kind="{kind}"[^}}]*}} (\S+)$',
                            metrics, re.MULTILINE)
        assert counted and float(counted.group(1)) >= after[kind] - before[kind], kind


def test_a_broken_disk_directory_recomputes(disk_server, disk_dir, prompts, expected):
    disk_server.flush_cache()
    before = _faults(disk_server)
    shutil.rmtree(disk_dir)
    disk_dir.write_bytes(b"the disk is gone")  # neither reads nor writes can succeed
    try:
        for i in (0, 1):
            output, cached = _ask(disk_server, prompts[i])
            assert output == expected[i], MODULES[i]
            assert cached.get("storage", 0) == 0
        after = _faults(disk_server)
        assert after["missing"] > before["missing"]
        assert after["write_error"] > before["write_error"]
    finally:
        disk_dir.unlink()
        disk_dir.mkdir()
