"""`python -m bench` end to end at its smallest size: one JSON file that parses, the plots
written, and every output a suite compares equal to plain decoding's (plain SGLang's for the
servers, full-KV greedy decoding for the HF suites).

The smallest size starts one server pair (plain SGLang, then VeriCache), one at a time. It skips
the full tier's device-budget comparison (three more servers: plain, HiCache, VeriCache; the
VeriCache server's full-tier figures are read instead), and the remote-prefix suite is not built:
both are asserted to say so rather than pass silently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.plots import PLOTS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.server
@pytest.mark.usefixtures("no_idle_servers")
@pytest.mark.timeout(1500)
def test_the_entry_runs_every_suite_at_its_smallest_size(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench", "--size", "smallest", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = tmp_path.glob("bench-*.json")
    record = json.loads(path.read_text())
    assert record["size"] == "smallest" and record["git"]["commit"]
    assert record["machine"]["cores"] >= 1
    suites = record["suites"]
    assert set(suites) == {"compressors", "drafting", "memory", "codec", "serving",
                           "full_tier", "perfmodel", "remote_prefix"}
    compared = {name for name, s in suites.items() if s["identical"] is not None}
    assert compared == {"compressors", "drafting", "serving"}
    assert all(suites[name]["identical"] for name in compared) and record["identical"]
    assert all(r["identical"].split(" of ")[0] == r["identical"].split(" of ")[1]
               for r in suites["serving"]["result"]["throughput"])
    assert "bench.remote_prefix" in suites["remote_prefix"]["skipped"]
    assert "skipped" in suites["full_tier"] and suites["serving"]["result"]["full_tier"]
    assert sorted(record["plots"]) == sorted(file for file, _ in PLOTS.values())
    for file in record["plots"]:
        assert (tmp_path / file).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
