"""vericache_tools.perfmodel: hand-computed cases on a toy model and machine with round
numbers (the arithmetic is written out), the model's limits and shapes, validation, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from vericache_tools import perfmodel as pm
from vericache_tools.perfmodel import Geometry, Hardware, Workload

ROOT = Path(__file__).resolve().parents[1]

# Toy model: 1e9 params in bf16 = 2e9 weight bytes; 4 layers; attention FLOPs per token
# 4 * layers * q_heads * head_dim * context = 16 * context. Its KV bytes are set per workload.
TOY = Geometry("toy", layers=4, q_heads=1, kv_heads=1, head_dim=1, params=1e9)
# Toy machine: HBM 1e12 B/s and 100 GB, host link 1e10 B/s, network 5e9 B/s, 1e15 FLOP/s.
MACHINE = Hardware("toy", hbm_gbps=1000, hbm_gb=100, host_link_gbps=10, network_gbps=5,
                   dense_tflops=1000)
# Two requests of 1e6 tokens, 1000 full / 250 compressed bytes per token:
# the batch's full KV is 2 * 1e6 * 1000 = 2e9 bytes, its compressed KV 0.5e9 bytes.
LOAD = Workload(context=1_000_000, batch=2, full_bytes_per_token=1000,
                compressed_bytes_per_token=250, k=4, tokens_per_round=2, n=100)


def test_plain_by_hand():
    # memory: (2e9 weights + 2e9 KV) / 1e12 = 4 ms;
    # compute: 2 tokens * (2e9 + 16e6) FLOPs / 1e15 = 4.03 us, hidden; 2 tokens per 4 ms.
    p = pm.predict_plain(TOY, MACHINE, LOAD)
    assert p.step_s == pytest.approx(4e-3)
    assert p.tokens_per_s == pytest.approx(500)
    assert p.device_bytes == pytest.approx(4e9) and p.fits


def test_compute_bound_step_by_hand():
    # 1e6 query tokens over 1e6 keys each: 1e6 * (2e9 + 16 * 1e6) = 2.016e15 FLOPs -> 2.016 s
    # at 1e15 FLOP/s, above its memory time (2e9 weight bytes, no KV bytes: 2 ms).
    assert pm.forward_seconds(TOY, MACHINE, 1e6, 1e6, 0) == pytest.approx(2.016)


def test_offloaded_by_hand():
    # fetch: 2e9 B / 1e10 B/s = 0.2 s once, then 100 steps of 4 ms = 0.4 s: 200 tokens / 0.6 s.
    p = pm.predict_offloaded(TOY, MACHINE, LOAD)
    assert p.fetch_s == pytest.approx(0.2)
    assert p.tokens_per_s == pytest.approx(200 / 0.6)


def test_streamed_by_hand():
    # each step streams 2e9 B (0.2 s) layer by layer; the last layer's compute (4 ms / 4
    # layers = 1 ms) comes after it: 0.201 s per 2 tokens.
    p = pm.predict_streamed(TOY, MACHINE, LOAD)
    assert p.step_s == pytest.approx(0.201)
    assert p.link_s == pytest.approx(0.2)
    assert p.tokens_per_s == pytest.approx(2 / 0.201)


# Draft step j (0..3) reads 2e9 weights + 2 * (1e6 * 250 + j * 1000) = 2.5e9 + 2000 j bytes:
# 2.5 ms + 2 ns * j; four steps: 10 ms + 12 ns. Verify (5 tokens per request) reads
# 2e9 + 2e9 bytes: 4 ms (its 10 * 2.016e9 FLOPs take 20 us).
DRAFT_S = 4 * 2.5e-3 + 2e-9 * (0 + 1 + 2 + 3)
VERIFY_S = 4e-3


def test_vericache_device_tier_by_hand():
    p = pm.predict_vericache(TOY, MACHINE, replace(LOAD, full_tier="device"))
    assert p.step_s == pytest.approx(DRAFT_S + VERIFY_S)
    assert p.tokens_per_step == 4  # E = 2 per request, 2 requests
    assert p.tokens_per_s == pytest.approx(4 / (DRAFT_S + VERIFY_S))


def test_a_slow_packed_kernel_by_hand():
    # Drafting's compressed reads at 100 GB/s instead of HBM's 1e12 B/s: each draft step reads
    # its 2e9 weights (+ 2000 j tail bytes) from HBM, 2 ms + 2 ns * j, and 0.5e9 compressed
    # bytes at 1e11 B/s, 5 ms: four steps 28 ms + 12 ns; plain is untouched.
    slow = replace(MACHINE, packed_read_gbps=100)
    device = replace(LOAD, full_tier="device")
    draft_s = 4 * (2e-3 + 5e-3) + 2e-9 * (0 + 1 + 2 + 3)
    assert pm.predict_vericache(TOY, slow, device).step_s == pytest.approx(draft_s + VERIFY_S)
    assert pm.predict_plain(TOY, slow, LOAD) == pm.predict_plain(TOY, MACHINE, LOAD)
    assert Hardware.from_measured({"packed_read_gbps": 100}, base=MACHINE) == slow
    with pytest.raises(ValueError, match="packed_read_gbps"):
        replace(MACHINE, packed_read_gbps=0)


def test_vericache_host_tier_by_hand():
    # The stream (0.2 s) starts with drafting; the staging area (4 units of one request's layer:
    # 4 * 1e6 * 1000 / 4 = 1e9 B, 0.1 s of link) outlasts drafting (10 ms), so 10 ms of it
    # runs ahead; the other 0.19 s streams under verify, then the last layer's verify (1 ms):
    # 10 ms + 190 ms + 1 ms = 0.201 s per round of 4 tokens.
    p = pm.predict_vericache(TOY, MACHINE, LOAD)
    assert p.link_s == pytest.approx(0.2)
    assert p.step_s == pytest.approx(DRAFT_S + (0.2 - DRAFT_S) + VERIFY_S / 4)
    assert p.tokens_per_s == pytest.approx(4 / 0.201)
    # staging of 0.1 units = 25e6 B: 2.5 ms of link ahead, 197.5 ms under verify.
    small = pm.predict_vericache(TOY, MACHINE, replace(LOAD, staging_units=0.1))
    assert small.step_s == pytest.approx(DRAFT_S + (0.2 - 2.5e-3) + 1e-3)
    # remote: the slower of network (5e9) and host link (1e10): 0.4 s of stream.
    remote = pm.predict_vericache(TOY, MACHINE, replace(LOAD, full_tier="remote"))
    assert remote.link_s == pytest.approx(0.4)
    assert remote.step_s == pytest.approx(0.4 + 1e-3)


def test_fit_limits_by_hand():
    cap = 100e9
    # plain: 2e9 + batch * context * 1000 <= 1e11
    assert pm.max_context(TOY, MACHINE, LOAD, "plain") == (cap - 2e9) // (2 * 1000)  # 49e6
    assert pm.max_batch(TOY, MACHINE, LOAD, "plain") == 98
    assert pm.max_batch(TOY, MACHINE, LOAD, "offloaded") == 98  # the fetched KV is resident
    # streamed: 2e9 + 4 units * context * 1000 / 4 layers; no KV grows with the batch
    assert pm.max_context(TOY, MACHINE, LOAD, "streamed") == 98_000_000
    assert pm.max_batch(TOY, MACHINE, LOAD, "streamed") is None
    # VeriCache, host tier: 2e9 + b*c*250 + b*(k+1)*1000 + staging c*1000
    # at b = 2: 2e9 + 10,000 + 1500 c <= 1e11 -> c <= 65,333,326.7
    assert pm.max_context(TOY, MACHINE, LOAD, "vericache") == 65_333_326
    # at c = 1e6: 3e9 + b * (250e6 + 5000) <= 1e11 -> b <= 387.99
    assert pm.max_batch(TOY, MACHINE, LOAD, "vericache") == 387
    # device tier: the full KV too, b * (1e9 + 250e6 + 5000) <= 98e9 -> b <= 78.4
    assert pm.max_batch(TOY, MACHINE, replace(LOAD, full_tier="device"), "vericache") == 78
    # the limits are where `fits` flips
    at = replace(LOAD, batch=387)
    assert pm.predict_vericache(TOY, MACHINE, at).fits
    assert not pm.predict_vericache(TOY, MACHINE, replace(at, batch=388)).fits
    # a model whose weights do not fit: nothing fits
    big = replace(TOY, params=60e9)
    assert pm.max_context(big, MACHINE, LOAD, "vericache") == 0
    with pytest.raises(ValueError, match="system must be one of"):
        pm.max_batch(TOY, MACHINE, LOAD, "eager")


def test_presets():
    llama = pm.GEOMETRIES["llama-3-8b"]
    assert llama.full_kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072
    assert llama.weight_bytes == pytest.approx(16.06e9)
    # the demo model in float32: docs/spec_decode.md's "Full KV: 46080 bytes per token"
    assert pm.GEOMETRIES["smollm2-135m"].full_kv_bytes_per_token(4) == 46080
    assert pm.HARDWARE["h200"].hbm_gbps == 4800 and pm.HARDWARE["gh200"].host_link_gbps == 450


def test_new_presets_kv_bytes_by_hand():
    # GQA: K and V, 2 * layers * kv_heads * head_dim * 2 bytes (bf16)
    assert pm.GEOMETRIES["qwen3-32b"].full_kv_bytes_per_token() == 2 * 64 * 8 * 128 * 2 == 262144
    assert pm.GEOMETRIES["mixtral-8x7b"].full_kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 \
        == 131072
    # MLA: one latent of 512 + 64 per layer, no factor 2 and no heads: 61 * 576 * 2
    deepseek = pm.GEOMETRIES["deepseek-v3"]
    assert deepseek.full_kv_bytes_per_token() == 61 * 576 * 2 == 70272
    assert deepseek.full_kv_bytes_per_token(1) == 35136  # fp8 KV
    # its released weights are fp8: all 671e9 parameters held, one byte each
    assert deepseek.weight_bytes == pytest.approx(671e9)


def test_moe_reads_active_weights_by_hand():
    mixtral = pm.GEOMETRIES["mixtral-8x7b"]
    assert mixtral.weight_bytes == pytest.approx(46.7e9 * 2)  # HBM holds every expert
    # a forward of t tokens reads min(46.7e9, t * 12.9e9) params in bf16
    assert mixtral.weight_bytes_read(1) == pytest.approx(12.9e9 * 2)
    assert mixtral.weight_bytes_read(2) == pytest.approx(25.8e9 * 2)
    assert mixtral.weight_bytes_read(9) == pytest.approx(46.7e9 * 2)  # capped: a k = 8 verify
    # one token over 1000 keys of 131,072 B on the toy machine: (25.8e9 + 131.072e6) / 1e12 s;
    # its FLOPs, 2 * 12.9e9 + 4 * 32 * 32 * 128 * 1000 = 26.32e9, take 26 us
    w = Workload(context=1000, batch=1, compressed_bytes_per_token=1)
    assert mixtral.flops_per_token(1000) == pytest.approx(2 * 12.9e9 + 4 * 32 * 32 * 128 * 1000)
    assert pm.predict_plain(mixtral, MACHINE, w).step_s == pytest.approx(25.931072e-3)
    # nine tokens and no KV: 93.4e9 B / 1e12 = 93.4 ms (FLOPs 9 * 25.8e9: 0.23 ms)
    assert pm.forward_seconds(mixtral, MACHINE, 9, 0, 0) == pytest.approx(93.4e-3)
    # a dense model reads all its weights at any token count
    assert TOY.weight_bytes_read(1) == TOY.weight_bytes_read(1000) == TOY.weight_bytes == 2e9


def test_mla_attention_flops_by_hand():
    # absorbed MLA: QK^T and PV over the 576-wide latent, 4 FLOPs per key per query head
    # per layer, plus 2 per active parameter
    deepseek = pm.GEOMETRIES["deepseek-v3"]
    assert deepseek.flops_per_token(1000) == pytest.approx(2 * 37e9 + 4 * 61 * 128 * 576 * 1000)


def test_plain_slows_with_context():
    g, hw = pm.GEOMETRIES["llama-3-8b"], pm.HARDWARE["h200"]
    speeds = [pm.predict_plain(g, hw, Workload(context=c, batch=4,
                                               compressed_bytes_per_token=3e4)).tokens_per_s
              for c in (1024, 4096, 16384, 65536, 262144)]
    assert speeds == sorted(speeds, reverse=True) and len(set(speeds)) == len(speeds)


def test_offloaded_converges_to_plain():
    plain = pm.predict_plain(TOY, MACHINE, LOAD).tokens_per_s
    speeds = [pm.predict_offloaded(TOY, MACHINE, replace(LOAD, n=n)).tokens_per_s
              for n in (1, 100, 10_000, 10_000_000)]
    assert speeds == sorted(speeds) and all(s < plain for s in speeds)
    assert speeds[-1] == pytest.approx(plain, rel=1e-4)


def test_no_drafting_is_no_faster_than_plain():
    for g, hw in ((TOY, MACHINE), (pm.GEOMETRIES["llama-3-8b"], pm.HARDWARE["h200"])):
        w = Workload(context=32768, batch=8, compressed_bytes_per_token=1e4, k=0,
                     tokens_per_round=1)
        plain = pm.predict_plain(g, hw, w)
        device = pm.predict_vericache(g, hw, replace(w, full_tier="device"))
        host = pm.predict_vericache(g, hw, w)
        # k = 0, E = 1: the round is one plain decode step (device) or one streamed step (host)
        assert device.tokens_per_s == pytest.approx(plain.tokens_per_s)
        assert host.tokens_per_s == pytest.approx(pm.predict_streamed(g, hw, w).tokens_per_s)
        assert host.tokens_per_s <= plain.tokens_per_s
        # drafting 8 tokens and keeping none (E = 1) is slower still
        rejected = pm.predict_vericache(g, hw, replace(w, k=8, full_tier="device"))
        assert rejected.tokens_per_s < plain.tokens_per_s


def test_link_bound_vericache_gains_e_over_streaming():
    # when the stream dominates both, a VeriCache round emits E tokens per stream, streaming 1
    g, hw = pm.GEOMETRIES["llama-3-8b"], pm.HARDWARE["h200"]
    w = Workload(context=131072, batch=32, compressed_bytes_per_token=0.27 * 131072)
    ratio = pm.predict_vericache(g, hw, w).tokens_per_s / pm.predict_streamed(g, hw, w).tokens_per_s
    assert 0.9 * 4 < ratio < 4
    # and the break-even E against plain is where the two speeds meet
    e = pm.break_even_tokens_per_round(TOY, MACHINE, replace(LOAD, full_tier="device"))
    assert e == pytest.approx(2 * 500 / (4 / (DRAFT_S + VERIFY_S)))


def test_hardware_from_measured():
    measured = {"name": "cpu", "hbm_gbps": 20, "hbm_gb": 23, "host_link_gbps": 11.7,
                "network_gbps": 0.1, "dense_tflops": 0.077}
    hw = Hardware.from_measured(json.loads(json.dumps(measured)))
    assert hw == Hardware(**measured)
    partial = Hardware.from_measured({"host_link_gbps": 40.5}, base=pm.HARDWARE["h200"])
    assert partial == replace(pm.HARDWARE["h200"], host_link_gbps=40.5)
    with pytest.raises(ValueError, match=r"unknown keys \['hbm_GBps'\]"):
        Hardware.from_measured({**measured, "hbm_GBps": 1})
    with pytest.raises(ValueError, match=r"missing keys \['dense_tflops'\]"):
        Hardware.from_measured({k: v for k, v in measured.items() if k != "dense_tflops"})
    with pytest.raises(ValueError, match="Hardware.hbm_gbps must be a positive number"):
        Hardware.from_measured({**measured, "hbm_gbps": -1})


@pytest.mark.parametrize("change, message", [
    ({"context": -5}, "Workload.context must be a positive number, got -5"),
    ({"batch": 0}, "Workload.batch must be a positive number, got 0"),
    ({"compressed_bytes_per_token": float("nan")}, "compressed_bytes_per_token must be"),
    ({"full_bytes_per_token": -1.0}, "Workload.full_bytes_per_token must be a positive"),
    ({"k": -1}, "Workload.k must be an integer >= 0, got -1"),
    ({"k": 4, "tokens_per_round": 6}, r"between 1 and k \+ 1 = 5 .*got 6"),
    ({"tokens_per_round": 0.5}, r"\(E\) must be between 1 and k \+ 1"),
    ({"full_tier": "disk"}, "full_tier must be one of"),
    ({"staging_units": 0}, "staging_units must be a positive number"),
])
def test_invalid_workload(change, message):
    with pytest.raises(ValueError, match=message):
        replace(LOAD, **change)


def test_invalid_geometry_and_hardware():
    with pytest.raises(ValueError, match="Geometry.layers must be a positive number, got 0"):
        replace(TOY, layers=0)
    with pytest.raises(ValueError, match="Hardware.host_link_gbps must be a positive"):
        replace(MACHINE, host_link_gbps=-55)
    with pytest.raises(ValueError, match="Geometry.kv_latent_dim must be a positive number, "
                                         "got 0"):
        replace(TOY, kv_latent_dim=0)
    with pytest.raises(ValueError, match="Geometry.active_params must be a positive number"):
        replace(TOY, active_params=-1e9)
    with pytest.raises(ValueError, match=r"Geometry.active_params must be at most params = "
                                         r"1000000000.0, got 2000000000.0"):
        replace(TOY, active_params=2e9)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vericache_tools.perfmodel", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_cli_help_and_table(tmp_path):
    done = run_cli("--help")
    assert done.returncode == 0
    for flag in ("--model", "--hardware", "--profile", "--k", "--E", "--compressed-ratio",
                 "--full-tier", "--n"):
        assert flag in done.stdout
    done = run_cli("--context", "8192", "32768", "--batch", "1")
    assert done.returncode == 0, done.stderr
    assert "Model predictions, not measurements" in done.stdout
    lines = done.stdout.splitlines()
    assert any(line.startswith("| 1 | 8,192 | 280.1 |") for line in lines)  # docs' table
    assert any(line.startswith("| max batch at context 32,768 |") for line in lines)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"name": "slow", "hbm_gbps": 480}))
    done = run_cli("--profile", str(profile), "--context", "8192", "--batch", "1")
    assert done.returncode == 0, done.stderr
    assert "llama-3-8b on slow" in done.stdout
    assert "| 1 | 8,192 | 28.0 |" in done.stdout  # a tenth of the HBM bandwidth
    done = run_cli("--k", "4", "--E", "6")
    assert done.returncode == 2 and "between 1 and k + 1 = 5" in done.stderr
    done = run_cli("--weight-bytes-per-param", "0")
    assert done.returncode == 2 and "weight_bytes_per_param must be a positive" in done.stderr
    done = run_cli("--model", "deepseek-v3", "--context", "8192", "--batch", "1")
    assert done.returncode == 0, done.stderr
    assert "deepseek-v3 on h200" in done.stdout and "full KV 70,272 B/token" in done.stdout
    assert "| max context at batch 1 | 0 | 0 | 0 | 0 |" in done.stdout  # 671 GB of weights
    profile.write_text("[20, 80]")
    done = run_cli("--profile", str(profile))
    assert done.returncode == 2 and "takes a dict, got list" in done.stderr


def test_imports_without_torch_or_sglang():
    # it must run on a bare GPU machine and in the docs' examples
    code = ("import sys, vericache_tools.perfmodel; "
            "print(sorted(m for m in ('torch', 'sglang', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
