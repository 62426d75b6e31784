"""The prepared device check's CPU-runnable parts, at toy sizes, so the script cannot rot
between the rare sessions that lend a GPU: every section runs, the CPU kernel equals the torch
reference in every case, and the JSON and text reports are written."""

from __future__ import annotations

import json

from bench import device_check


def test_device_check_runs_every_section_at_toy_sizes(tmp_path) -> None:
    code = device_check.main([str(tmp_path), "--small", "--device", "cpu"])
    report = json.loads((tmp_path / "device_check.json").read_text())
    sections = report["sections"]
    assert set(sections) == {"kernels", "attention", "graphs", "copy", "codec", "model"}
    failed = {name: s.get("error") for name, s in sections.items() if not s["ok"]}
    assert not failed, failed
    kernels = sections["kernels"]
    assert kernels["failed"] == 0 and kernels["passed"] == len(kernels["cases"]) > 0
    assert code == 0
    rows = sections["attention"]["rows"]
    sizes = device_check.SMALL
    assert [(r["context"], r["batch"]) for r in rows] == [
        (c, b) for c in sizes.contexts for b in sizes.batches]
    for row in rows:
        # the packed tier is allocated smaller than dense bf16 over the same context
        assert 0 < row["packed_bytes"] < row["dense_bytes"]
        assert row["dense_s"] > 0 and row["packed_best_s"] > 0
    # off CUDA the graph runner runs the step eagerly: same outputs, no replay timed
    graphs = sections["graphs"]["rows"]
    assert [r["bucket"] for r in graphs] == [1, 4]
    assert all(not r["captured"] and r["max_abs_diff"] == 0 for r in graphs)
    copy = sections["copy"]
    # bytes moved: K and V of copy_tokens rows per layer, bf16, counted by the engine
    assert copy["bytes"] == 2 * sizes.layers * sizes.copy_tokens * sizes.kv_heads \
        * sizes.head_dim * 2
    assert 0 <= copy["hidden_fraction"] <= 1
    assert sections["model"]["profile"]["host_link_gbps"] == copy["h2d_gbps"]
    # every codec part decoded by the numpy reference equals the numba decode (bf16, float32)
    codec = sections["codec"]["rows"]
    assert len(codec) == 6 and all(row["equal"] for row in codec)
    text = (tmp_path / "device_check.txt").read_text()
    assert "kernels against the torch reference" in text and "| batch | context |" in text
