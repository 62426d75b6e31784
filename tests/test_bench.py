"""`python -m bench`'s entry (`bench.__main__.main`, run in the test process so that its servers
fork from the tests' launcher) end to end at its smallest size: one JSON file that parses, the
plots written, and every output a suite compares equal to its reference (plain SGLang's for the
servers, full-KV greedy decoding for the HF suites, the torch reference for the device check's
kernels).

The smallest size starts one server pair (plain SGLang, then VeriCache), one at a time. It skips
the suites of more servers (the full tier's device-budget comparison, fixed-k drafting, logprob
drift, round host time, the window cap, placement, the remote prefix behind an emulated link):
each is asserted to say so rather than pass silently.

Without servers: the report and every plot drawn from committed results (docs/benchmarks/),
the remote-prefix plot from a saved `python -m bench.remote_prefix --json` record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import remote_prefix
from bench.__main__ import main as bench_main
from bench.plots import PLOTS, draw
from bench.report import markdown
from bench.suites import SUITES

ROOT = Path(__file__).resolve().parents[1]
SAVED = ROOT / "docs" / "benchmarks"
PNG = b"\x89PNG\r\n\x1a\n"
SKIPPED_AT_SMALLEST = {"spec_decode", "logprob_drift", "round_host_time", "full_tier",
                       "window_cap", "placement", "remote_prefix"}


@pytest.mark.server
@pytest.mark.usefixtures("no_idle_servers")
@pytest.mark.timeout(2400)
def test_the_entry_runs_every_suite_at_its_smallest_size(tmp_path: Path) -> None:
    assert bench_main(["--size", "smallest", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("bench-*.json")
    record = json.loads(path.read_text())
    assert record["size"] == "smallest" and record["git"]["commit"]
    assert record["machine"]["cores"] >= 1
    suites = record["suites"]
    assert list(suites) == list(SUITES)
    skipped = {name for name, s in suites.items() if "skipped" in s}
    assert skipped == SKIPPED_AT_SMALLEST
    assert all("result" in suites[name] for name in set(suites) - skipped)
    compared = {name for name, s in suites.items() if s["identical"] is not None}
    assert compared == {"compressors", "drafting", "serving", "device_check"}
    assert all(suites[name]["identical"] for name in compared) and record["identical"]
    assert all(r["identical"].split(" of ")[0] == r["identical"].split(" of ")[1]
               for r in suites["serving"]["result"]["throughput"])
    assert suites["serving"]["result"]["full_tier"]
    drawn = {file for name, (file, _) in PLOTS.items() if "result" in suites[name]}
    assert sorted(record["plots"]) == sorted(drawn)
    for file in record["plots"]:
        assert (tmp_path / file).read_bytes()[:8] == PNG


def test_the_report_and_every_plot_draw_from_saved_results(tmp_path: Path) -> None:
    """The committed run's suites that draw (its codec table predates the codec suite's data),
    and the remote-prefix suite's record as `python -m bench.remote_prefix --json` saved it."""
    [committed] = SAVED.glob("bench-*.json")
    suites = {name: s for name, s in json.loads(committed.read_text())["suites"].items()
              if name in PLOTS or name == "compressors"}
    saved = json.loads((SAVED / "remote_prefix-early-matrix-float32-20261206.json").read_text())
    assert remote_prefix.identical(saved) is True
    # in bfloat16 a prefix read from a cache is not bit for bit a recomputed one
    bf16 = json.loads((SAVED / "remote_prefix-link-bfloat16-20261206.json").read_text())
    assert remote_prefix.identical(bf16) is False
    suites["remote_prefix"] = {"result": saved, "identical": True,
                               "seconds": round(saved["results"]["wall_s"], 1)}
    paths = draw(suites, tmp_path)
    assert sorted(p.name for p in paths) == sorted(file for file, _ in PLOTS.values())
    assert all(p.read_bytes()[:8] == PNG for p in paths)
    record = {"command": "python -m bench", "size": "smallest", "seconds": 1.0,
              "machine": {"cpu": "cpu", "cores": 2, "memory_gb": 1, "gpu": None,
                          "python": "3", "torch": "2", "sglang": "0"},
              "git": {"commit": None, "dirty": False}, "suites": suites, "identical": True}
    text = markdown(record)
    assert "**remote_prefix**" in text and "| 200 | 4 | vericache-early |" in text
    assert "**perfmodel**" in text and "**serving**" in text

