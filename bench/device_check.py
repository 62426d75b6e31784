"""The prepared device check: what VeriCache needs a GPU to show, in one short script.

A GPU is lent to this project only sometimes, for minutes, bare (torch and Triton, no SGLang), so
everything that needs one is here, runnable from the repository root:

    python -m bench.device_check OUT_DIR            # on the GPU machine, at most ~8 minutes
    python -m bench.device_check OUT_DIR --small    # the same sections at toy sizes (CPU too)

Sections, each recorded even if another fails (OUT_DIR/device_check.json after every section,
OUT_DIR/device_check.txt at the end):
- kernels: the Triton quantize, dequantize and paged decode-attention kernels (pages + exact
  window + draft tail, split over the context or not) against the torch reference on the same
  device, bits 2/4/8, GQA, ragged requests, a shuffled page pool;
- attention: one layer's draft-step attention, 4-bit packed pages (the Triton kernel) against
  dense bf16 attention (torch SDPA), at a model's geometry on random data, by context and batch;
- graphs: a drafting step's attention over every layer, launched eagerly against replayed from
  the CUDA graph captured for its batch bucket (`vericache_kernels.graphs`), outputs equal;
- copy: the host tier's copy engine, host-to-device GB/s layer by layer, and the share of that
  copy hidden behind a stream running draft-step attention;
- codec: the KV codec's rANS lane decoders (`vericache_kernels.rans_triton`) against the numba
  ones (`rans_cpu`, one core) on the same streams of a chunk of the demo model's geometry
  (random KV, bf16 and float32), every part bit for bit, and each part's decode time on both
  (on a CPU: the numpy reference at toy size, no timing);
- model: `vericache_tools.perfmodel`'s prediction next to each measured figure.
On a CPU the kernel section compares the CPU kernel with the reference instead (no Triton).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import vericache_kernels as kernels
from vericache_kernels import PagedKV
from vericache_kernels.attention_ref import (
    decode_attention_ref,
    merge_attention,
    tail_attention_ref,
)
from vericache_kernels.graphs import BucketGraphs, bucket_for
from vericache_kernels.quant_ref import dequantize_unpack_ref, quantize_pack_ref
from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.tiers.copy_engine import measure_copy
from vericache_tools import perfmodel


@dataclass(frozen=True)
class Sizes:
    """What the attention and copy sections measure."""

    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    layers: int
    window: int
    """Exact recent tokens per request (KIVI's residual)."""
    draft: int
    """Draft tokens of the round so far (the tail)."""
    copy_tokens: int
    """Tokens of full KV per layer the copy section moves."""
    hidden: int
    """The model's hidden size: the draft steps' weight reads in the copy section."""
    layer_params: int
    """Weights per layer (attention and MLP), read once per draft step."""


FULL = Sizes(contexts=(8192, 32768, 131072), batches=(1, 32), q_heads=32, kv_heads=8,
             head_dim=128, layers=32, window=128, draft=8, copy_tokens=32768, hidden=4096,
             layer_params=218_103_808)
"""Llama-3-8B's attention geometry (32 layers, 8 KV heads of 128, 32 query heads)."""
SMALL = Sizes(contexts=(256, 1024), batches=(1, 4), q_heads=8, kv_heads=2, head_dim=64,
              layers=4, window=32, draft=4, copy_tokens=512, hidden=256,
              layer_params=256 * 1024)
BITS, GROUP = 4, 32
"""The packed tier timed: KIVI 4-bit, 32-token key groups (the project's default spec)."""


class Report:
    """Results by section, written to OUT_DIR after each one so that a cut-off run keeps them."""

    def __init__(self, out: Path, device: torch.device) -> None:
        self.out = out
        self.data: dict = {"machine": machine(device), "sections": {}}
        self.lines: list[str] = []

    def section(self, name: str, run: Callable[[], dict]) -> None:
        began = time.perf_counter()
        print(f"[device_check] {name} ...", flush=True)
        try:
            result = {"ok": True, **run()}  # a section may report ok False itself
        except Exception:  # recorded: the other sections still run
            result = {"ok": False, "error": traceback.format_exc()}
            print(result["error"], file=sys.stderr, flush=True)
        result["seconds"] = round(time.perf_counter() - began, 2)
        self.data["sections"][name] = result
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "device_check.json").write_text(json.dumps(self.data, indent=1))

    def text(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def machine(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count,
                    memory_gb=round(props.total_memory / 1e9, 1), cuda=torch.version.cuda)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


# -- timing ------------------------------------------------------------------------------------
def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of `fn` after one warm-up call (which also compiles)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


# -- inputs ------------------------------------------------------------------------------------
def pack_pages(keys: torch.Tensor, values: torch.Tensor, bits: int, group: int
               ) -> tuple[torch.Tensor, ...]:
    """[n, H, D] K/V (n a multiple of group) -> the six packed tensors in page form."""
    v_group = math.gcd(group, keys.shape[-1])
    k_parts = kernels.quantize_keys(keys, group, bits)
    v_parts = kernels.quantize_values(values, v_group, bits)
    return (*k_parts, *(t.reshape(-1, group, *t.shape[1:]) for t in v_parts))


def paged_pool(pages_per_request: list[int], heads: int, dim: int, bits: int, group: int,
               device: torch.device, gen: torch.Generator, shuffle: bool) -> PagedKV:
    """Random K/V packed into a pool holding every request's pages (shuffled if asked, with two
    pages no request owns), read through a page table."""
    total = sum(pages_per_request) + 2
    parts = pack_pages(*(torch.randn(total * group, heads, dim, generator=gen, device=device)
                         .to(torch.bfloat16) for _ in range(2)), bits, group)
    order = (torch.randperm(total, generator=gen, device=device) if shuffle
             else torch.arange(total, device=device))
    table = torch.full((len(pages_per_request), max(pages_per_request, default=0) + 1), -1,
                       dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(pages_per_request):
        table[b, :n] = order[start:start + n].to(torch.int32)
        start += n
    lengths = torch.tensor(pages_per_request, dtype=torch.int32, device=device) * group
    return PagedKV(*parts, page_table=table, lengths=lengths, bits=bits, group=group,
                   v_group=math.gcd(group, dim))


def close(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
          ) -> float:
    """Largest absolute difference of out and of finite lse; inf where -inf lse disagree."""
    if not torch.equal(torch.isinf(got[1]), torch.isinf(want[1])):
        return math.inf
    finite = ~torch.isinf(want[1])
    return max((got[0] - want[0]).abs().max().item(),
               (got[1][finite] - want[1][finite]).abs().max().item() if finite.any() else 0.0)


def triton_variants(splits: bool) -> list[dict]:
    """Keyword sets of the Triton decode-attention kernel to check (`splits`: over split
    counts too) or time; the first is the default call."""
    from vericache_kernels.attention_triton import decode_attention_triton

    variants = [{}, {"block_n": 32}]
    if "mma" in inspect.signature(decode_attention_triton).parameters:
        variants += [{"mma": True}, {"mma": True, "block_n": 32}]
    if splits:
        variants += [{"num_splits": 1}, {"num_splits": 3}]
    return variants


# -- sections ----------------------------------------------------------------------------------
def check_kernels(device: torch.device) -> dict:
    """Triton (CUDA) or CPU kernels against the torch reference: quantization bit for bit against
    the reference on CPU, attention within 1e-3 of the reference on the same device."""
    gen = torch.Generator(device=device).manual_seed(0)
    cases = []
    if device.type == "cuda":
        from vericache_kernels.quant_triton import dequantize_unpack_triton, quantize_pack_triton

        for bits in (2, 4, 8):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                x = (torch.randn(4099, 128, generator=gen, device=device) * 3).to(dtype)
                got = quantize_pack_triton(x, 32, bits)
                # the reference on CPU: torch on CUDA divides by a scalar as a multiply by its
                # reciprocal, which moves a scale's last bit (measured); the CPU divides as IEEE
                want = tuple(t.to(device) for t in quantize_pack_ref(x.cpu(), 32, bits))
                codes_differ = (got[0] != want[0]).sum().item()
                meta_equal = torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
                deq_equal = torch.equal(dequantize_unpack_triton(*want, 32, bits, dtype),
                                        dequantize_unpack_ref(*want, 32, bits, dtype))
                cases.append({"kernel": "quantize", "bits": bits, "dtype": str(dtype),
                              "codes_differing": codes_differ, "codes": want[0].numel(),
                              "meta_equal": meta_equal, "dequantize_equal": deq_equal,
                              "ok": codes_differ == 0 and meta_equal and deq_equal})
    for bits in (2, 4, 8):
        for heads, group_size, dim in ((8, 4, 128), (2, 3, 64), (4, 1, 128)):
            pages = [40, 0, 3, 17, 1]
            paged = paged_pool(pages, heads, dim, bits, GROUP, device, gen, shuffle=True)
            batch, window, draft = len(pages), 40, 5
            q = torch.randn(batch, heads * group_size, dim, generator=gen, device=device)
            k_res, v_res = (torch.randn(batch, window, heads, dim, generator=gen, device=device)
                            .to(torch.bfloat16) for _ in range(2))
            res_lengths = torch.tensor([window, 7, 0, 0, 33], dtype=torch.int32, device=device)
            tail_k, tail_v = (torch.randn(batch, draft, heads, dim, generator=gen, device=device)
                              for _ in range(2))
            head_lengths = torch.randint(0, draft + 1, (batch, heads * group_size),
                                         generator=gen, device=device, dtype=torch.int32)
            head_lengths[3] = 0  # request 3: no pages, no window, no tail: nothing at all
            tail = (tail_k, tail_v, head_lengths)
            scale = dim ** -0.5
            want = merge_attention([decode_attention_ref(q, paged, k_res, v_res, res_lengths,
                                                         scale),
                                    tail_attention_ref(q, *tail, scale)])
            for variant in (triton_variants(splits=True) if device.type == "cuda"
                            else [{}]):
                if device.type == "cuda":
                    from vericache_kernels.attention_triton import decode_attention_triton

                    got = decode_attention_triton(q, paged, k_res, v_res, res_lengths, scale,
                                                  tail, **variant)
                else:
                    got = kernels.decode_attention(q, paged, k_res, v_res, res_lengths, scale,
                                                   tail)
                err = close(got, want)
                cases.append({"kernel": "decode_attention", "bits": bits, "kv_heads": heads,
                              "group_size": group_size, "head_dim": dim, **variant,
                              "max_abs_diff": err, "ok": err < 1e-3})
    failed = [c for c in cases if not c["ok"]]
    return {"cases": cases, "passed": len(cases) - len(failed), "failed": len(failed)}


def time_attention(device: torch.device, sizes: Sizes, budget_s: float) -> dict:
    """One layer's draft-step attention, packed 4-bit pages + window + tail vs dense SDPA, for
    each context and batch until `budget_s` is spent."""
    gen = torch.Generator(device=device).manual_seed(1)
    began = time.perf_counter()
    rows = []
    for context in sizes.contexts:
        for batch in sizes.batches:
            if time.perf_counter() - began > budget_s:
                rows.append({"context": context, "batch": batch, "skipped": "time budget"})
                continue
            row = {"context": context, "batch": batch}
            rows.append(row)
            try:
                row.update(time_attention_row(device, sizes, context, batch, gen))
            except Exception:  # the rows measured so far stay; a device fault ends the section
                row["error"] = traceback.format_exc()
                print(row["error"], file=sys.stderr, flush=True)
                return {"geometry": sizes.__dict__, "bits": BITS, "group": GROUP, "rows": rows,
                        "ok": False, "error": row["error"]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"geometry": sizes.__dict__, "bits": BITS, "group": GROUP, "rows": rows}


def time_dense(device: torch.device, sizes: Sizes, q: torch.Tensor, context: int,
               gen: torch.Generator, reps: int) -> dict:
    """Dense bf16 attention over the context and the drafts, read by SDPA as the G query rows
    of each KV head's group: GQA decode without repeating K/V."""
    batch, _, dim = q.shape
    heads = sizes.kv_heads
    k, v = (torch.randn(batch, heads, context + sizes.draft, dim, generator=gen, device=device,
                        dtype=torch.bfloat16) for _ in range(2))
    qd = q.to(torch.bfloat16).reshape(batch, heads, -1, dim)
    seconds = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
        qd, k, v, scale=dim ** -0.5), device, reps)
    return {"dense_s": seconds, "dense_bytes": storage_bytes([k, v])}


def time_attention_row(device: torch.device, sizes: Sizes, context: int, batch: int,
                       gen: torch.Generator) -> dict:
    """`batch` requests of `context` tokens on random data; the inputs die with the call."""
    heads, dim = sizes.kv_heads, sizes.head_dim
    scale = dim ** -0.5
    reps = 20 if device.type == "cuda" else 3
    q = torch.randn(batch, sizes.q_heads, dim, generator=gen, device=device)
    row = time_dense(device, sizes, q, context, gen, reps)
    # packed: whole groups in pages, the rest in the exact window, then the draft tail
    n_pages = (context - sizes.window) // GROUP
    paged = paged_pool([n_pages] * batch, heads, dim, BITS, GROUP, device, gen, shuffle=False)
    window = context - n_pages * GROUP
    k_res, v_res = (torch.randn(batch, window, heads, dim, generator=gen, device=device,
                                dtype=torch.bfloat16) for _ in range(2))
    res_lengths = torch.full((batch,), window, dtype=torch.int32, device=device)
    tail = (*(torch.randn(batch, sizes.draft, heads, dim, generator=gen, device=device)
              for _ in range(2)),
            torch.full((batch, sizes.q_heads), sizes.draft, dtype=torch.int32, device=device))
    row["packed_bytes"] = storage_bytes([paged.k_codes, paged.k_scale, paged.k_zero,
                                         paged.v_codes, paged.v_scale, paged.v_zero, k_res,
                                         v_res, *tail[:2]])
    row["packed_s"] = timed(
        lambda: kernels.decode_attention(q, paged, k_res, v_res, res_lengths, scale, tail),
        device, reps)
    if device.type == "cuda":
        from vericache_kernels.attention_triton import decode_attention_triton

        for variant in triton_variants(splits=False)[1:]:
            row["packed_s_" + "_".join(f"{k}{v}" for k, v in variant.items())] = timed(
                lambda variant=variant: decode_attention_triton(
                    q, paged, k_res, v_res, res_lengths, scale, tail, **variant),
                device, reps)
    best_key = min((key for key in row if key.startswith("packed_s")), key=row.get)
    best = row[best_key]
    row.update(packed_best_s=best, packed_best=best_key.removeprefix("packed_s").strip("_")
               or "default", speedup=row["dense_s"] / best,
               dense_gbps=row["dense_bytes"] / row["dense_s"] / 1e9,
               packed_gbps=row["packed_bytes"] / best / 1e9,
               step_dense_s=row["dense_s"] * sizes.layers, step_packed_s=best * sizes.layers)
    return row


def time_graphs(device: torch.device, sizes: Sizes) -> dict:
    """A drafting step's attention over every layer (the packed kernel with pages, exact window
    and draft tail, each layer's output the next one's query, as in a model) launched eagerly
    against replayed from a CUDA graph captured for its batch bucket (`vericache_kernels.graphs`):
    what launch overhead costs a small-batch step. Off CUDA the runner runs eagerly (no replay
    to time); the outputs must match either way."""
    gen = torch.Generator(device=device).manual_seed(3)
    batches = (1, 3, 16) if device.type == "cuda" else (1, 3)
    rows = [time_graphs_row(device, sizes, batch, [1, 2, 4, 8, 16], gen) for batch in batches]
    return {"rows": rows, "ok": all(row["max_abs_diff"] <= 1e-5 for row in rows)}


def time_graphs_row(device: torch.device, sizes: Sizes, batch: int, buckets: list[int],
                    gen: torch.Generator) -> dict:
    """`batch` requests at the smallest context, on a shuffled page pool."""
    heads, dim, context = sizes.kv_heads, sizes.head_dim, sizes.contexts[0]
    scale = dim ** -0.5
    n_pages = (context - sizes.window) // GROUP
    paged = paged_pool([n_pages] * batch, heads, dim, BITS, GROUP, device, gen, shuffle=True)
    window = context - n_pages * GROUP

    def step(q, page_table, lengths, k_res, v_res, res_lengths, tail_k, tail_v, head_lengths):
        layer_kv = dataclasses.replace(paged, page_table=page_table, lengths=lengths)
        for _ in range(sizes.layers):
            out, _ = kernels.decode_attention(q, layer_kv, k_res, v_res, res_lengths, scale,
                                              (tail_k, tail_v, head_lengths))
            q = out.to(q.dtype)
        return q

    inputs = (torch.randn(batch, sizes.q_heads, dim, generator=gen, device=device),
              paged.page_table, paged.lengths,
              *(torch.randn(batch, window, heads, dim, generator=gen, device=device,
                            dtype=torch.bfloat16) for _ in range(2)),
              torch.full((batch,), window, dtype=torch.int32, device=device),
              *(torch.randn(batch, sizes.draft, heads, dim, generator=gen, device=device)
                for _ in range(2)),
              torch.full((batch, sizes.q_heads), sizes.draft, dtype=torch.int32, device=device))
    graphs = BucketGraphs(step, buckets, device)
    reps = 50 if device.type == "cuda" else 2
    row = {"batch": batch, "bucket": bucket_for(batch, buckets), "layers": sizes.layers,
           "context": context, "captured": graphs.use_graphs,
           "max_abs_diff": (step(*inputs) - graphs(*inputs)).abs().max().item(),
           "eager_s": timed(lambda: step(*inputs), device, reps)}
    if graphs.use_graphs:
        row["replay_s"] = timed(lambda: graphs(*inputs), device, reps)
        row["speedup"] = row["eager_s"] / row["replay_s"]
    return row


def time_copy(device: torch.device, sizes: Sizes) -> dict:
    """The copy engine moving `copy_tokens` rows of one request's full KV per layer to the
    device, alone and behind a round's drafting: per layer, `draft` steps that each read the
    layer's weights (a GEMV, batch 1) and attend over the request's packed pages."""
    gen = torch.Generator(device=device).manual_seed(2)
    heads, dim = sizes.kv_heads, sizes.head_dim
    weights = torch.randn(sizes.hidden, sizes.layer_params // sizes.hidden, generator=gen,
                          device=device, dtype=torch.bfloat16)
    x = torch.randn(1, sizes.hidden, generator=gen, device=device, dtype=torch.bfloat16)
    n_pages = sizes.copy_tokens // GROUP
    paged = paged_pool([n_pages], heads, dim, BITS, GROUP, device, gen, shuffle=False)
    q = torch.randn(1, sizes.q_heads, dim, generator=gen, device=device)
    empty = torch.empty(1, 0, heads, dim, device=device, dtype=torch.bfloat16)
    no_rows = torch.zeros(1, dtype=torch.int32, device=device)

    def draft_steps(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for _ in range(sizes.draft):
            x @ weights
            kernels.decode_attention(q, paged, empty, empty, no_rows, dim ** -0.5)

    result = measure_copy(sizes.layers, sizes.copy_tokens, heads, dim, torch.bfloat16, device,
                          draft_steps)
    result["layer_bytes"] = result["bytes"] / sizes.layers
    return result


def measure_profile(device: torch.device, small: bool, sections: dict) -> perfmodel.Hardware:
    """This device as a performance-model profile: HBM GB/s from a device-to-device copy (read
    plus write), dense bf16 FLOP/s from a square GEMM, the host link from the copy section, the
    packed kernel's read rate from the attention section's largest case; the rest from the
    H200 preset."""
    n = (4 << 20) if small else (1 << 30)
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, 10)
    size = 256 if small else 8192
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    gemm_s = timed(lambda: a @ b, device, 10)
    measured = {"name": f"measured {device.type}", "hbm_gbps": 2 * src.nbytes / copy_s / 1e9,
                "dense_tflops": 2 * size**3 / gemm_s / 1e12}
    copy = sections.get("copy", {})
    if copy.get("ok"):
        measured["host_link_gbps"] = copy["h2d_gbps"]
    timed_rows = [r for r in sections.get("attention", {}).get("rows", [])
                  if "packed_gbps" in r]
    if timed_rows:
        measured["packed_read_gbps"] = max(timed_rows, key=lambda r: r["packed_bytes"])[
            "packed_gbps"]
    return perfmodel.Hardware.from_measured(measured, base=perfmodel.HARDWARE["h200"])


def compare_model(device: torch.device, small: bool, sections: dict) -> dict:
    """The performance model's figures next to the measured ones: each attention time as the
    bytes it reads over HBM bandwidth (preset and measured), the copy as its bytes over the host
    link, and the model's decode predictions with the measured profile."""
    measured = measure_profile(device, small, sections)
    preset = perfmodel.HARDWARE["h200"]
    rows = []
    for row in sections.get("attention", {}).get("rows", []):
        if "packed_best_s" not in row:
            continue
        rows.append({"context": row["context"], "batch": row["batch"], **{
            f"{kind}_{name}_s": row[f"{kind}_bytes"] / hw.hbm_gbps / 1e9
            for kind in ("dense", "packed") for name, hw in (("h200", preset),
                                                             ("measured", measured))}})
    copy = sections.get("copy", {})
    sizes = SMALL if small else FULL
    predicted_copy = ({"layer_copy_h200_s": copy["layer_bytes"] / preset.host_link_gbps / 1e9,
                       "layer_copy_measured_s": copy["copy_s"] / sizes.layers}
                      if copy.get("ok") else {})
    geometry = perfmodel.GEOMETRIES["llama-3-8b"]
    compressed = geometry.full_kv_bytes_per_token() * (0.5 + 4 / GROUP) / 2  # 4-bit + fp16 meta
    workloads = [perfmodel.Workload(context=c, compressed_bytes_per_token=compressed, batch=b)
                 for b in sizes.batches for c in FULL.contexts]
    return {"profile": measured.__dict__, "attention": rows, "copy": predicted_copy,
            "table": perfmodel.table(geometry, measured, workloads)}


def check_codec(device: torch.device, small: bool) -> dict:
    """Each part of a chunk's stream (30 layers, 256 tokens, 3 KV heads of 64: the demo model's
    geometry; 2 layers of 32 tokens when `small`) decoded by the numba lanes on one core and by
    the Triton kernels (the numpy reference on a CPU), compared bit for bit and timed."""
    import numpy as np

    from vericache_kernels import rans_cpu, rans_ref
    from vericache_sglang.codec import CodecSpec, encode_chunk
    from vericache_sglang.codec.chunk import Geometry, decode_meta, exact_lanes, level_lanes
    from vericache_sglang.codec.stream import read_parts, unpack_sections
    from vericache_sglang.compress import parse_compressor_spec

    layers, tokens = (2, 32) if small else (30, 256)
    gen = torch.Generator().manual_seed(0)
    spread = 1 + 4 * torch.rand(layers, 1, 3, 64, generator=gen)
    rows = []
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float32):
            keys = (torch.randn(layers, tokens, 3, 64, generator=gen) * spread).to(dtype)
            values = torch.randn(layers, tokens, 3, 64, generator=gen).to(dtype)
            spec = CodecSpec.for_compressor(parse_compressor_spec("kivi:bits=4"), layers)
            header, parts = read_parts(encode_chunk(keys, values, spec))
            geo = Geometry(header)
            codes = np.zeros((layers, 2, geo.codes), dtype=np.uint8)
            sections0 = unpack_sections(parts[0], 4)
            mb = keys.numel() * 2 * keys.element_size() / 1e6
            for index in range(len(header.levels) + 1):
                row = {"dtype": str(dtype).removeprefix("torch."),
                       "part": f"level {index}" if index < len(header.levels) else "exact"}
                if index < len(header.levels):
                    sections = sections0[1:] if index == 0 else unpack_sections(parts[index], 3)
                    args = level_lanes(geo, sections, index, codes)
                    before = codes.copy()
                    began = time.perf_counter()
                    assert rans_cpu.decode_level(*args)
                    row["cpu_ms"] = (time.perf_counter() - began) * 1e3
                    want = codes.copy()
                    got = before.copy()
                    if device.type == "cuda":
                        from vericache_kernels import rans_triton

                        def level(got=got, args=args) -> torch.Tensor:
                            on = torch.from_numpy(got).to(device)
                            assert rans_triton.decode_level_triton(*args[:7], on, *args[8:])
                            return on
                        row["gpu_ms"] = timed(level, device, 3) * 1e3
                        got = level().cpu().numpy()
                    else:
                        assert rans_ref.decode_level_ref(*args[:7], got, *args[8:])
                    row["equal"] = bool(np.array_equal(got, want))
                else:
                    out = np.zeros((2 * layers, geo.codes), dtype=np.int64)
                    args, _ = exact_lanes(geo, parts[-1], codes, decode_meta(sections0[0], geo),
                                          out)
                    words, starts, exp_cum, residual, c, scales, zeros, model, *rest = args
                    began = time.perf_counter()
                    assert rans_cpu.decode_exact(words, starts, exp_cum, residual, c, scales,
                                                 zeros, *model, *rest)
                    row["cpu_ms"] = (time.perf_counter() - began) * 1e3
                    got = np.zeros_like(out)
                    if device.type == "cuda":
                        from vericache_kernels import rans_triton

                        def exact(args=args, shape=out.shape, pool=codes) -> torch.Tensor:
                            on = torch.zeros(shape, dtype=torch.int64, device=device)
                            assert rans_triton.decode_exact_triton(
                                *args[:4], torch.from_numpy(pool).to(device), *args[5:-1], on)
                            return on
                        row["gpu_ms"] = timed(exact, device, 3) * 1e3
                        got = exact().cpu().numpy()
                    else:
                        assert rans_ref.decode_exact_ref(*args[:-1], got)
                    row["equal"] = bool(np.array_equal(got[np.repeat(np.isin(
                        np.arange(layers), residual), 2)], out[np.repeat(np.isin(
                            np.arange(layers), residual), 2)]))
                row["cpu_mb_s"] = mb / row["cpu_ms"] * 1e3
                if "gpu_ms" in row:
                    row["gpu_mb_s"] = mb / row["gpu_ms"] * 1e3
                rows.append(row)
    return {"ok": all(r["equal"] for r in rows), "rows": rows,
            "note": "MB/s: MB of the chunk's KV in its dtype per second of that part's lanes"}


def summary(report: Report) -> None:
    """The text table: what passed, what each timing measured, the model beside it."""
    data = report.data
    report.text("VeriCache device check: " + ", ".join(f"{k}={v}" for k, v in
                                                       data["machine"].items()))
    sections = data["sections"]
    for name, section in sections.items():
        report.text(f"{name}: {'ok' if section['ok'] else 'FAILED'} in {section['seconds']} s"
                    + ("" if section["ok"] else "\n" + section["error"].splitlines()[-1]))
    kernels_ = sections["kernels"]
    if kernels_["ok"]:
        report.text(f"kernels against the torch reference: {kernels_['passed']} passed, "
                    f"{kernels_['failed']} failed")
        for case in kernels_["cases"]:
            if not case["ok"]:
                report.text(f"  FAILED {case}")
    attention = sections["attention"]
    model = sections.get("model", {})
    predicted = {(r["context"], r["batch"]): r for r in model.get("attention", [])}
    if attention.get("rows"):
        report.text("\none layer's draft-step attention, 4-bit packed pages + window + tail "
                    "(Triton) vs dense bf16 (SDPA); model = bytes / measured HBM GB/s")
        report.text(f"{'context':>8} {'batch':>5} {'dense ms':>9} {'model':>7} {'packed ms':>9} "
                    f"{'model':>7} {'speedup':>7} {'dense GB/s':>10} {'packed GB/s':>11}  "
                    "best variant")
        for row in attention["rows"]:
            if "packed_best_s" not in row:
                why = row.get("skipped") or row["error"].strip().splitlines()[-1]
                report.text(f"{row['context']:>8} {row['batch']:>5} not measured: {why}")
                continue
            guess = predicted.get((row["context"], row["batch"]), {})
            report.text(
                f"{row['context']:>8} {row['batch']:>5} {row['dense_s'] * 1e3:>9.3f} "
                f"{guess.get('dense_measured_s', math.nan) * 1e3:>7.3f} "
                f"{row['packed_best_s'] * 1e3:>9.3f} "
                f"{guess.get('packed_measured_s', math.nan) * 1e3:>7.3f} "
                f"{row['speedup']:>6.2f}x {row['dense_gbps']:>10.1f} {row['packed_gbps']:>11.1f}  "
                f"{row['packed_best']}")
    graphs = sections.get("graphs", {})
    if graphs.get("rows"):
        report.text("\ndrafting step attention, every layer, eager vs CUDA graph replay:")
        for row in graphs["rows"]:
            report.text(f"  batch {row['batch']:>3} (bucket {row['bucket']:>3}): eager "
                        f"{row['eager_s'] * 1e3:8.3f} ms, replay "
                        f"{row.get('replay_s', math.nan) * 1e3:8.3f} ms, "
                        f"{row.get('speedup', math.nan):.2f}x, max diff {row['max_abs_diff']:.2e}")
    copy = sections["copy"]
    if copy["ok"]:
        report.text(f"\ncopy engine: H2D {copy['h2d_gbps']:.1f} GB/s (event-timed), "
                    f"{copy['copy_gbps']:.1f} GB/s with the host gather; copy hidden behind "
                    f"the drafting stream: {copy.get('hidden_fraction', math.nan):.2f}")
    codec = sections.get("codec", {})
    if codec.get("rows"):
        report.text("\ncodec rANS lanes, one chunk (numba on one core vs Triton), bit-equal:")
        for row in codec["rows"]:
            report.text(f"  {row['dtype']:>8} {row['part']:>8}: cpu {row['cpu_ms']:8.2f} ms "
                        f"gpu {row.get('gpu_ms', math.nan):8.3f} ms  equal {row['equal']}")
    if model.get("ok"):
        profile = model["profile"]
        report.text(f"\nmeasured profile: HBM {profile['hbm_gbps']:.0f} GB/s, host link "
                    f"{profile['host_link_gbps']:.1f} GB/s, {profile['dense_tflops']:.3g} "
                    f"TFLOP/s bf16, packed KV read at {profile['packed_read_gbps']:.0f} GB/s "
                    "(the attention section's largest case)\n")
        report.text(model["table"])
    (report.out / "device_check.txt").write_text("\n".join(report.lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.device_check",
        description="VeriCache's device check: kernels, draft-step attention, copy engine and "
                    "the performance model on one GPU (or at toy sizes on a CPU).")
    parser.add_argument("out", type=Path, help="folder for device_check.json and .txt")
    parser.add_argument("--small", action="store_true",
                        help="toy sizes (what the CPU tests run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget-s", type=float, default=300,
                        help="seconds the attention timings may take before sizes are skipped")
    args = parser.parse_args(argv)
    data = run(args.out, torch.device(args.device), args.small, args.budget_s)
    return 0 if passed(data) else 1


def run(out: Path, device: torch.device, small: bool, budget_s: float = 300) -> dict:
    """Every section on `device` (toy sizes if `small`), written to `out` as it goes; the
    report's data (the machine and each section's results) for callers such as
    `python -m bench`."""
    sizes = SMALL if small else FULL
    report = Report(out, device)
    report.section("kernels", lambda: check_kernels(device))
    report.section("attention", lambda: time_attention(device, sizes, budget_s))
    report.section("graphs", lambda: time_graphs(device, sizes))
    report.section("copy", lambda: time_copy(device, sizes))
    report.section("codec", lambda: check_codec(device, small))
    report.section("model", lambda: compare_model(device, small, report.data["sections"]))
    summary(report)
    return report.data


def passed(data: dict) -> bool:
    """Every section ran and every kernel case equalled the torch reference."""
    sections = data["sections"]
    return all(s["ok"] for s in sections.values()) and sections["kernels"].get("failed") == 0


if __name__ == "__main__":
    sys.exit(main())
