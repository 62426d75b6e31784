"""A roofline model of decode speed: plain SGLang, full KV offloaded, and VeriCache.

Why a model: a GPU is lent to this project only for minutes, so the question "where does
drafting on a compressed KV and verifying on a streamed full KV pay?" is answered here from
bandwidths and byte counts, and the few device measurements check the model instead of having
to map the whole space. Every time is a roofline: a forward takes the longer of its HBM bytes
over HBM bandwidth and its FLOPs over dense bf16 FLOP/s; a copy takes its bytes over the link.
Kernel efficiency, launch overheads, scheduler time and activations are ignored, so predictions
are upper bounds on speed, except a mixture of experts' forwards of a few tokens (`Geometry`);
docs/perfmodel.md lists the assumptions and presets.

Pure Python on purpose (no torch, no sglang): it runs on a bare GPU machine and in the docs.

    python -m vericache_tools.perfmodel --help
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, fields, replace

GB = 1e9
TIERS = ("device", "host", "remote")
SYSTEMS = ("plain", "offloaded", "streamed", "vericache")


def _positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{owner}.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class Geometry:
    """What a model costs per token: weights read once per forward, KV per context token.

    A mixture of experts holds `params` but runs `active_params` per token (None: dense, all of
    them). A forward of t tokens is taken to read min(params, t * active_params) weights: each
    token its own active weights, capped at the whole model. That is exact at t = 1 and for
    many tokens, and an upper bound in between (shared weights and common experts count once
    per token), so MoE predictions for forwards of a few tokens, such as a verify of k + 1,
    lean slow where the rest of the model leans fast.

    Multi-head latent attention (DeepSeek) caches one `kv_latent_dim` vector per layer and token
    (compressed KV plus the shared RoPE key), read by every query head; when it is set,
    `kv_heads` and `head_dim` describe the up-projected heads and enter no cost."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    params: float
    weight_bytes_per_param: float = 2.0  # bf16; 1.0 for fp8 weights
    active_params: float | None = None
    kv_latent_dim: int | None = None

    def __post_init__(self) -> None:
        _positive("Geometry", layers=self.layers, q_heads=self.q_heads, kv_heads=self.kv_heads,
                  head_dim=self.head_dim, params=self.params,
                  weight_bytes_per_param=self.weight_bytes_per_param)
        if self.kv_latent_dim is not None:
            _positive("Geometry", kv_latent_dim=self.kv_latent_dim)
        if self.active_params is not None:
            _positive("Geometry", active_params=self.active_params)
            if self.active_params > self.params:
                raise ValueError(f"Geometry.active_params must be at most params = "
                                 f"{self.params!r}, got {self.active_params!r}")

    @property
    def weight_bytes(self) -> float:
        """Every parameter, experts included: what the weights take in HBM."""
        return self.params * self.weight_bytes_per_param

    def weight_bytes_read(self, tokens: float) -> float:
        """Weights a forward of `tokens` query tokens (over the batch) reads from HBM."""
        return min(self.params, tokens * (self.active_params or self.params)) \
            * self.weight_bytes_per_param

    def full_kv_bytes_per_token(self, dtype_bytes: float = 2.0) -> float:
        """K and V of every layer: 2 * layers * kv_heads * head_dim * dtype_bytes; with MLA the
        latent alone, layers * kv_latent_dim * dtype_bytes."""
        if self.kv_latent_dim is not None:
            return self.layers * self.kv_latent_dim * dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def flops_per_token(self, context: float) -> float:
        """2 FLOPs per active weight, plus attention over `context` keys: QK^T and PV, 2 FLOPs
        per multiply-add each, for every query head of every layer. MLA attends in absorbed
        form, both products over the latent (PV really over its kv_lora_rank part only, 512
        of DeepSeek-V3's 576: its attention FLOPs are counted 6% high)."""
        width = self.head_dim if self.kv_latent_dim is None else self.kv_latent_dim
        return 2 * (self.active_params or self.params) \
            + 4 * self.layers * self.q_heads * width * context


GEOMETRIES = {g.name: g for g in (
    Geometry("llama-3-8b", layers=32, q_heads=32, kv_heads=8, head_dim=128, params=8.03e9),
    Geometry("llama-3-70b", layers=80, q_heads=64, kv_heads=8, head_dim=128, params=70.6e9),
    Geometry("smollm2-135m", layers=30, q_heads=9, kv_heads=3, head_dim=64, params=134.5e6),
    Geometry("qwen3-32b", layers=64, q_heads=64, kv_heads=8, head_dim=128, params=32.8e9),
    Geometry("mixtral-8x7b", layers=32, q_heads=32, kv_heads=8, head_dim=128, params=46.7e9,
             active_params=12.9e9),
    # MLA: kv_lora_rank 512 + qk_rope_head_dim 64; released with fp8 weights
    Geometry("deepseek-v3", layers=61, q_heads=128, kv_heads=128, head_dim=128, params=671e9,
             weight_bytes_per_param=1.0, active_params=37e9, kv_latent_dim=512 + 64),
)}


@dataclass(frozen=True)
class Hardware:
    """One accelerator: HBM bandwidth and size, the links the full KV can cross, dense FLOP/s.
    Bandwidths in GB/s and sizes in GB are decimal (1e9 bytes)."""

    name: str
    hbm_gbps: float
    hbm_gb: float
    host_link_gbps: float
    network_gbps: float
    dense_tflops: float
    packed_read_gbps: float | None = None
    """How fast drafting's attention reads the compressed KV, when a kernel is measured slower
    than HBM (the device check's packed GB/s); None: at HBM bandwidth, dequantization free."""

    def __post_init__(self) -> None:
        _positive("Hardware", hbm_gbps=self.hbm_gbps, hbm_gb=self.hbm_gb,
                  host_link_gbps=self.host_link_gbps, network_gbps=self.network_gbps,
                  dense_tflops=self.dense_tflops)
        if self.packed_read_gbps is not None:
            _positive("Hardware", packed_read_gbps=self.packed_read_gbps)

    @classmethod
    def from_measured(cls, measured: dict, base: Hardware | None = None) -> Hardware:
        """A profile from measured figures, keyed by this class's field names (`hbm_gbps`,
        `hbm_gb`, `host_link_gbps`, `network_gbps`, `dense_tflops`, optional `name` and
        `packed_read_gbps`); a key left out is taken from `base`. Unknown keys raise: a
        misspelt key would otherwise silently keep the preset's figure."""
        if not isinstance(measured, dict):
            raise ValueError(f"Hardware.from_measured takes a dict, got {type(measured).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(measured) - set(names))
        if unknown:
            raise ValueError(f"Hardware.from_measured: unknown keys {unknown}; expected {names}")
        values = {**({f: getattr(base, f) for f in names} if base else {"name": "measured"}),
                  **measured}
        missing = [n for n in names if n not in values and n != "packed_read_gbps"]
        if missing:
            raise ValueError(f"Hardware.from_measured: missing keys {missing} (or pass base=)")
        return cls(**values)


HARDWARE = {h.name: h for h in (
    Hardware("h100-sxm", hbm_gbps=3350, hbm_gb=80, host_link_gbps=55, network_gbps=50,
             dense_tflops=989),
    Hardware("h200", hbm_gbps=4800, hbm_gb=141, host_link_gbps=55, network_gbps=50,
             dense_tflops=989),
    Hardware("gh200", hbm_gbps=4000, hbm_gb=96, host_link_gbps=450, network_gbps=50,
             dense_tflops=989),
)}


@dataclass(frozen=True)
class Workload:
    """One decode phase: `batch` requests of `context` tokens each, `n` output tokens each.

    VeriCache's round drafts `k` tokens on the compressed KV and verifies them in one forward;
    `tokens_per_round` (E) is what a round emits per request, measured by bench.spec_decode:
    between 1 (every draft rejected, the bonus token only) and k + 1 (all accepted).
    `staging_units` is the device area the full KV streams through, in units of one layer of
    one request (the server's `--vericache-staging-budget` default is 4)."""

    context: int
    compressed_bytes_per_token: float
    batch: int = 1
    k: int = 8
    tokens_per_round: float = 4.0
    full_bytes_per_token: float | None = None  # None: the geometry's KV at bf16
    n: int = 256
    full_tier: str = "host"
    staging_units: float = 4.0

    def __post_init__(self) -> None:
        _positive("Workload", context=self.context, batch=self.batch, n=self.n,
                  compressed_bytes_per_token=self.compressed_bytes_per_token,
                  staging_units=self.staging_units)
        if self.full_bytes_per_token is not None:
            _positive("Workload", full_bytes_per_token=self.full_bytes_per_token)
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"Workload.k must be an integer >= 0, got {self.k!r}")
        e = self.tokens_per_round
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 1 <= e <= self.k + 1:
            raise ValueError(
                f"Workload.tokens_per_round (E) must be between 1 and k + 1 = {self.k + 1} "
                f"(a round emits at most its k drafts and one bonus token), got {e!r}")
        if self.full_tier not in TIERS:
            raise ValueError(f"Workload.full_tier must be one of {TIERS}, got {self.full_tier!r}")


@dataclass(frozen=True)
class Prediction:
    """One system's predicted decode speed for the whole batch.

    `step_s` is one decode step (plain, offloaded, streamed) or one round (VeriCache), which
    emits `tokens_per_step` tokens over the batch; `link_s` is the time the full KV spends
    crossing a link per step (offloaded: once per phase, in `fetch_s`)."""

    system: str
    tokens_per_s: float
    step_s: float
    tokens_per_step: float
    link_s: float
    fetch_s: float
    device_bytes: float
    fits: bool


def _full(g: Geometry, w: Workload) -> float:
    return w.full_bytes_per_token or g.full_kv_bytes_per_token()


def forward_seconds(g: Geometry, hw: Hardware, tokens: float, context: float,
                    kv_bytes: float, packed_bytes: float = 0.0) -> float:
    """One forward of `tokens` query tokens (over the batch) attending to `context` keys each:
    the longer of its reads (the weights its tokens use and `kv_bytes` from HBM, `packed_bytes`
    of compressed KV at `hw.packed_read_gbps`) and its FLOPs."""
    packed_gbps = hw.packed_read_gbps or hw.hbm_gbps
    return max((g.weight_bytes_read(tokens) + kv_bytes) / (hw.hbm_gbps * GB)
               + packed_bytes / (packed_gbps * GB),
               tokens * g.flops_per_token(context) / (hw.dense_tflops * 1e12))


def link_gbps(hw: Hardware, tier: str) -> float:
    """Where the full KV comes from: host memory over the host link; a remote store through
    host memory, so the slower of the network and the host link."""
    return min(hw.network_gbps, hw.host_link_gbps) if tier == "remote" else hw.host_link_gbps


def device_bytes(g: Geometry, w: Workload, system: str) -> float:
    """HBM a system holds: weights and KV (activations ignored).

    plain, and offloaded (fetch then decode needs the fetched KV resident): the full KV;
    streamed: a staging area only; VeriCache: the compressed KV, each request's draft tail and
    verify chain at full precision, and the full KV (device tier) or a staging area."""
    return _device_bytes(g, w, system, w.context, w.batch)


def _device_bytes(g: Geometry, w: Workload, system: str, context: float, batch: float) -> float:
    full = _full(g, w)
    kv, staging = batch * context * full, w.staging_units * context * full / g.layers
    if system in ("plain", "offloaded"):
        return g.weight_bytes + kv
    if system == "streamed":
        return g.weight_bytes + staging
    if system == "vericache":
        return (g.weight_bytes + batch * context * w.compressed_bytes_per_token
                + batch * (w.k + 1) * full + (kv if w.full_tier == "device" else staging))
    raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")


def _prediction(system: str, g: Geometry, hw: Hardware, w: Workload, step_s: float,
                tokens_per_step: float, link_s: float = 0.0, fetch_s: float = 0.0,
                steps: int = 1) -> Prediction:
    used = device_bytes(g, w, system)
    tokens_per_s = tokens_per_step * steps / (fetch_s + step_s * steps)
    return Prediction(system, tokens_per_s, step_s, tokens_per_step, link_s, fetch_s, used,
                      used <= hw.hbm_gb * GB)


def _pipelined(device_s: float, link_s: float, layers: int, ahead_s: float = 0.0) -> float:
    """A forward whose KV streams in layer by layer: layer l computes while later layers copy,
    so it takes the longer of its own time and the copy still to do (`ahead_s` of it done
    before the forward began) plus the last layer's compute."""
    return max(device_s, link_s - ahead_s + device_s / layers)


def predict_plain(g: Geometry, hw: Hardware, w: Workload) -> Prediction:
    """Full KV in HBM: every step reads the weights and the batch's whole KV."""
    step = forward_seconds(g, hw, w.batch, w.context, w.batch * w.context * _full(g, w))
    return _prediction("plain", g, hw, w, step, w.batch)


def predict_offloaded(g: Geometry, hw: Hardware, w: Workload) -> Prediction:
    """Full KV off the device, fetched once (the batch's KV crosses the link), then decoded as
    plain does: tokens/s over `n` output tokens, the fetch included."""
    fetch = w.batch * w.context * _full(g, w) / (link_gbps(hw, w.full_tier) * GB)
    step = predict_plain(g, hw, w).step_s
    return _prediction("offloaded", g, hw, w, step, w.batch, fetch_s=fetch, steps=w.n)


def predict_streamed(g: Geometry, hw: Hardware, w: Workload) -> Prediction:
    """Full KV off the device and streamed layer by layer at every decode step: holds almost no
    KV on the device, pays the link once per token."""
    link = w.batch * w.context * _full(g, w) / (link_gbps(hw, w.full_tier) * GB)
    step = _pipelined(predict_plain(g, hw, w).step_s, link, g.layers)
    return _prediction("streamed", g, hw, w, step, w.batch, link_s=link)


def predict_vericache(g: Geometry, hw: Hardware, w: Workload) -> Prediction:
    """One round: k draft steps on the compressed KV (plus the round's draft tail at full
    precision), then one verify forward of k+1 tokens per request over the full KV; the batch
    emits batch * E tokens.

    With the full tier off the device its stream starts with drafting, but only the staging
    area can fill ahead of the verify forward (a buffer is reused once verify released it);
    the rest streams under the verify forward, layer by layer, as in `predict_streamed`."""
    full = _full(g, w)
    draft = sum(forward_seconds(g, hw, w.batch, w.context + j, w.batch * j * full,
                                w.batch * w.context * w.compressed_bytes_per_token)
                for j in range(w.k))
    verify = forward_seconds(g, hw, w.batch * (w.k + 1), w.context, w.batch * w.context * full)
    link = 0.0
    if w.full_tier == "device":
        round_s = draft + verify
    else:
        bandwidth = link_gbps(hw, w.full_tier) * GB
        link = w.batch * w.context * full / bandwidth
        ahead = min(draft, link, w.staging_units * w.context * full / g.layers / bandwidth)
        round_s = draft + _pipelined(verify, link, g.layers, ahead)
    return _prediction("vericache", g, hw, w, round_s, w.batch * w.tokens_per_round,
                       link_s=link)


PREDICTORS = {"plain": predict_plain, "offloaded": predict_offloaded,
              "streamed": predict_streamed, "vericache": predict_vericache}


def predict(g: Geometry, hw: Hardware, w: Workload) -> dict[str, Prediction]:
    """Every system's prediction for the same workload."""
    return {name: fn(g, hw, w) for name, fn in PREDICTORS.items()}


def break_even_tokens_per_round(g: Geometry, hw: Hardware, w: Workload,
                                against: str = "plain") -> float:
    """The E at which VeriCache matches `against` (a round's time does not depend on E); above
    k + 1 means no acceptance rate makes VeriCache faster at this k."""
    return w.tokens_per_round * (PREDICTORS[against](g, hw, w).tokens_per_s
                                 / predict_vericache(g, hw, w).tokens_per_s)


def _affine_limit(used, capacity: float) -> int | None:
    """Largest x >= 0 with used(x) <= capacity, for `used` affine in x; None if unbounded."""
    base, slope = used(0), used(1) - used(0)
    if base > capacity:
        return 0
    return None if slope <= 0 else int((capacity - base) // slope)


def max_context(g: Geometry, hw: Hardware, w: Workload, system: str) -> int | None:
    """Longest context per request that fits in HBM at `w.batch` (0: not even the weights fit;
    None: no limit from the KV)."""
    return _affine_limit(lambda c: _device_bytes(g, w, system, c, w.batch), hw.hbm_gb * GB)


def max_batch(g: Geometry, hw: Hardware, w: Workload, system: str) -> int | None:
    """Most requests of `w.context` tokens that fit in HBM (None: no limit from the KV, as for
    `streamed`, whose staging area does not grow with the batch)."""
    return _affine_limit(lambda b: _device_bytes(g, w, system, w.context, b), hw.hbm_gb * GB)


# -- command line ------------------------------------------------------------------------------
def _tps(p: Prediction) -> str:
    return f"{p.tokens_per_s:,.1f}" if p.fits else f"({p.tokens_per_s:,.1f})"


def _limit(x: int | None) -> str:
    return "no limit" if x is None else f"{x:,}"


def table(g: Geometry, hw: Hardware, workloads: list[Workload]) -> str:
    """Markdown tables: tokens/s of every system per workload, then the fit limits."""
    e, k = workloads[0].tokens_per_round, workloads[0].k
    rows = ["| batch | context | plain | offloaded | streamed | VeriCache | VeriCache / plain "
            "| VeriCache / streamed | E to match plain |", "|" + "---:|" * 9]
    for w in workloads:
        p = predict(g, hw, w)
        rows.append(f"| {w.batch} | {w.context:,} | " + " | ".join(_tps(p[s]) for s in SYSTEMS)
                    + f" | {p['vericache'].tokens_per_s / p['plain'].tokens_per_s:.2f}x"
                    + f" | {p['vericache'].tokens_per_s / p['streamed'].tokens_per_s:.2f}x"
                    + f" | {break_even_tokens_per_round(g, hw, w):.1f} |")
    rows += ["", "| limit | " + " | ".join(SYSTEMS) + " |", "|---|" + "---:|" * len(SYSTEMS)]
    for batch in sorted({w.batch for w in workloads}):
        w = next(w for w in workloads if w.batch == batch)
        rows.append(f"| max context at batch {batch} | "
                    + " | ".join(_limit(max_context(g, hw, w, s)) for s in SYSTEMS) + " |")
    for context in sorted({w.context for w in workloads}):
        w = next(w for w in workloads if w.context == context)
        rows.append(f"| max batch at context {context:,} | "
                    + " | ".join(_limit(max_batch(g, hw, w, s)) for s in SYSTEMS) + " |")
    w = workloads[0]
    return "\n".join([
        f"{g.name} on {hw.name}: k={k}, E={e:g}, full KV {_full(g, w):,.0f} B/token, "
        f"compressed {w.compressed_bytes_per_token:,.0f} B/token, full tier {w.full_tier}, "
        f"offloaded over n={w.n} tokens. Decode tokens/s for the batch; (x): does not fit in "
        f"{hw.hbm_gb:g} GB of HBM. Model predictions, not measurements.", "", *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vericache_tools.perfmodel",
        description="Roofline predictions of decode tokens/s: plain SGLang (full KV in HBM), "
                    "full KV offloaded (fetched once, then decoded), full KV streamed every "
                    "step, and VeriCache (k drafts on the compressed KV, one verify over the "
                    "full KV). Model predictions, not measurements: docs/perfmodel.md.")
    parser.add_argument("--model", choices=GEOMETRIES, default="llama-3-8b")
    parser.add_argument("--weight-bytes-per-param", type=float, metavar="BYTES",
                        help="override the model's weight bytes per parameter (2: bf16, 1: fp8)")
    parser.add_argument("--hardware", choices=HARDWARE, default="h200",
                        help="preset profile (default h200); --profile overrides its figures")
    parser.add_argument("--profile", metavar="JSON",
                        help="file of measured figures, keys: " + ", ".join(
                            f.name for f in fields(Hardware)) + " (missing ones from --hardware)")
    parser.add_argument("--context", type=int, nargs="+", metavar="TOKENS",
                        default=[8192, 32768, 131072],
                        help="context tokens per request (default 8192 32768 131072)")
    parser.add_argument("--batch", type=int, nargs="+", metavar="N", default=[1, 32],
                        help="requests decoded together (default 1 32)")
    parser.add_argument("--k", type=int, default=8, help="draft tokens per round (default 8)")
    parser.add_argument("--E", type=float, default=4.0, dest="tokens_per_round", metavar="E",
                        help="tokens emitted per request per round, measured by "
                             "bench.spec_decode; 1 <= E <= k+1 (default 4)")
    compressed = parser.add_mutually_exclusive_group()
    compressed.add_argument("--compressed-ratio", type=float, default=0.27, metavar="R",
                            help="compressed KV bytes as a fraction of the full KV's "
                                 "(default 0.27, 4-bit KIVI)")
    compressed.add_argument("--compressed-bytes", type=float, metavar="BYTES",
                            help="compressed KV bytes per token, all layers")
    parser.add_argument("--full-bytes", type=float, metavar="BYTES",
                        help="full KV bytes per token, all layers (default: the model's at bf16)")
    parser.add_argument("--n", type=int, default=256,
                        help="output tokens per request the offloaded fetch is spread over "
                             "(default 256)")
    parser.add_argument("--full-tier", choices=TIERS, default="host",
                        help="where VeriCache's full KV lives; remote: over the network "
                             "(default host)")
    parser.add_argument("--staging-units", type=float, default=4.0, metavar="UNITS",
                        help="staging area, in layers of one request's full KV (default 4)")
    args = parser.parse_args(argv)
    try:
        g = GEOMETRIES[args.model]
        if args.weight_bytes_per_param is not None:
            g = replace(g, weight_bytes_per_param=args.weight_bytes_per_param)
        hw = HARDWARE[args.hardware]
        if args.profile:
            with open(args.profile) as f:
                hw = Hardware.from_measured(json.load(f), base=hw)
        full = g.full_kv_bytes_per_token() if args.full_bytes is None else args.full_bytes
        workloads = [Workload(context=c, batch=b, k=args.k, tokens_per_round=args.tokens_per_round,
                              compressed_bytes_per_token=args.compressed_ratio * full
                              if args.compressed_bytes is None else args.compressed_bytes,
                              full_bytes_per_token=args.full_bytes, n=args.n,
                              full_tier=args.full_tier, staging_units=args.staging_units)
                     for b in args.batch for c in args.context]
    except (OSError, ValueError) as e:
        parser.error(str(e))
    print(table(g, hw, workloads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
