"""The suites `python -m bench` runs, each at a size, each returning plain data for the run's
JSON and plots. A suite calls the functions its own script (`python -m bench.X`) runs and gets
their figures back as data, so the entry and the scripts measure the same way; `identical`
says whether every output a suite compares equalled its reference's: plain decoding's, or for
the device check the torch reference kernels' (None: the suite compares none). A suite a size
does not run, or a machine cannot, returns why as `skipped`."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from bench import cli

REMOTE_PREFIX_UNAVAILABLE = "needs an emulated link and a Mooncake store, not available here: "
"""How the remote-prefix suite's skip begins where it cannot run (the reason follows)."""
REMOTE_PREFIX_CONFIGS = ("recompute", "hicache", "vericache", "vericache-early")
"""What the remote-prefix suite compares, one line each in its plot: plain SGLang recomputing,
HiCache reading the full KV, VeriCache reading its coded pages, and drafting on them early."""


@dataclass(frozen=True)
class Size:
    """How much each suite measures; `smallest` is the test suite's, `full` the scripts'
    defaults."""

    quality_files: tuple[str, ...]
    quality_tokens: int
    quality_specs: tuple[str, ...]
    quality_new_tokens: int
    drafting_prompt: str
    """FILE:TOKENS, as bench.spec_offline takes it; longer than KIVI's exact window (128
    tokens), or KIVI drafts on an exact prompt."""
    drafting_specs: tuple[str, ...]
    draft_lengths: tuple[int, ...]
    drafting_new_tokens: int
    memory_files: tuple[str, ...]
    memory_context: int
    memory_specs: tuple[str, ...]
    codec_tokens: int
    store_tokens: int
    gemm_rows: tuple[int, ...]
    gemm_repeats: int
    remote_prefix_tokens: int
    remote_prefix_rates: tuple[float, ...]
    """Mbit/s of the emulated link, each in turn: the plot's x axis; none: skipped."""
    remote_prefix_batches: tuple[int, ...]
    remote_prefix_new_tokens: int
    remote_prefix_mark: int
    """The n of the time to the n-th token."""
    prompt_tokens: int
    """Server workloads' context."""
    new_tokens: int
    workloads: tuple[str, ...]
    request_types: tuple[str, ...]
    servers: tuple[str, ...] = ("VeriCache, one level",)
    """bench.multilevel's servers measured beside plain SGLang."""
    full_tier_budget: int | None = None
    """Device tokens of bench.full_tier's three servers; None: the full tier's figures come
    from the throughput suite's VeriCache server (no budget comparison)."""
    full_tier_prompt_tokens: int = 4000
    spec_decode_prompts: tuple[str, ...] = ()
    """FILE:TOKENS prompts of bench.spec_decode, each server answering each; none: skipped."""
    spec_decode_configs: tuple[str, ...] = ()
    """SPEC@K, one VeriCache server each beside plain SGLang."""
    logprob_drift: bool = False
    """bench.logprob_drift's two servers."""
    host_time_configs: tuple[str, ...] = ()
    """bench.round_host_time's configurations, on this checkout; none: skipped."""
    window_cap_requests: int | None = None
    """bench.window_cap's batch; None: skipped."""
    placement: bool = False
    """bench.placement's five servers, every memory setting at its default."""
    device_check_full: bool = False
    """bench.device_check at Llama-3-8B's sizes where a GPU is present (toy sizes otherwise)."""


CONTROL = "streaming:ratio=1.0"
"""Keeps every token: its greedy output must equal full-KV decoding's."""
QUALITY_SPECS = (CONTROL, "kivi:bits=8", "kivi:bits=4", "kivi:bits=2",
                 "snapkv:ratio=0.25", "h2o:ratio=0.25", "snapkv:ratio=0.5+kivi:bits=4")
MEMORY_SPECS = ("kivi:bits=8", "kivi:bits=4", "kivi:bits=2", "snapkv:ratio=0.25",
                "h2o:ratio=0.25", "streaming:ratio=0.25", "snapkv:ratio=0.5+kivi:bits=4")

SIZES = {
    "smallest": Size(
        quality_files=("argparse.py",), quality_tokens=256,
        quality_specs=(CONTROL, "kivi:bits=4", "snapkv:ratio=0.25"),
        quality_new_tokens=4, drafting_prompt="textwrap.py:192",
        drafting_specs=("kivi:bits=4", "snapkv:ratio=0.25"), draft_lengths=(4, 8),
        drafting_new_tokens=12, memory_files=("argparse.py",), memory_context=256,
        memory_specs=("kivi:bits=8", "kivi:bits=4", "kivi:bits=2", "snapkv:ratio=0.25"),
        codec_tokens=256, store_tokens=256, gemm_rows=(1, 2, 4), gemm_repeats=2,
        remote_prefix_tokens=1024, remote_prefix_rates=(),
        remote_prefix_batches=(1,), remote_prefix_new_tokens=16, remote_prefix_mark=8,
        prompt_tokens=1024, new_tokens=16,
        workloads=("code, batch 1", "code, batch 4"),
        request_types=("greedy", "3 greedy + 1 custom logit processor")),
    "small": Size(
        quality_files=("argparse.py", "GPL-3"), quality_tokens=1024, quality_specs=QUALITY_SPECS,
        quality_new_tokens=32, drafting_prompt="textwrap.py:512",
        drafting_specs=("kivi:bits=4", "kivi:bits=2", "snapkv:ratio=0.25"),
        draft_lengths=(2, 4, 8, 16), drafting_new_tokens=48,
        memory_files=("argparse.py", "difflib.py"), memory_context=1024,
        memory_specs=MEMORY_SPECS, codec_tokens=1024, store_tokens=1024,
        gemm_rows=(1, 2, 3, 4, 5, 6, 9), gemm_repeats=3, remote_prefix_tokens=3200,
        remote_prefix_rates=(1000.0, 200.0, 100.0), remote_prefix_batches=(1,),
        remote_prefix_new_tokens=64, remote_prefix_mark=32, prompt_tokens=1024, new_tokens=64,
        workloads=("code, batch 1", "chat, batch 1", "code, batch 4", "chat, batch 4"),
        request_types=("greedy", "sampled", "grammar", "3 greedy + 1 custom logit processor"),
        servers=("VeriCache, one level", "VeriCache + ngram"), full_tier_budget=6000,
        full_tier_prompt_tokens=2000, spec_decode_prompts=("textwrap.py:2048",),
        spec_decode_configs=("kivi:bits=4@16", "kivi:bits=8@32"), logprob_drift=True,
        host_time_configs=("one level",)),
    "full": Size(
        quality_files=("argparse.py", "textwrap.py", "GPL-3", "difflib.py"), quality_tokens=3072,
        quality_specs=QUALITY_SPECS, quality_new_tokens=64, drafting_prompt="textwrap.py:2048",
        drafting_specs=("kivi:bits=4", "kivi:bits=2", "snapkv:ratio=0.25"),
        draft_lengths=(4, 8, 16, 32), drafting_new_tokens=128,
        memory_files=("argparse.py", "difflib.py", "GPL-3", "typing.py"), memory_context=4096,
        memory_specs=MEMORY_SPECS, codec_tokens=2048, store_tokens=3200,
        gemm_rows=(1, 2, 3, 4, 5, 6, 9), gemm_repeats=5, remote_prefix_tokens=6000,
        remote_prefix_rates=(1000.0, 200.0), remote_prefix_batches=(1, 4),
        remote_prefix_new_tokens=256, remote_prefix_mark=128, prompt_tokens=2500,
        new_tokens=128,
        workloads=("code, batch 1", "chat, batch 1", "code, batch 4", "chat, batch 4"),
        request_types=("greedy", "sampled", "logprobs", "penalties", "grammar", "tools",
                       "custom logit processor", "3 greedy + 1 custom logit processor"),
        servers=("VeriCache, one level", "VeriCache + ngram", "VeriCache + draft model",
                 "SGLang NGRAM"), full_tier_budget=12000,
        spec_decode_prompts=("textwrap.py:2048", "argparse.py:3072", "difflib.py:4096",
                             "inspect.py:6144"),
        spec_decode_configs=("kivi:bits=4@8", "kivi:bits=4@16", "kivi:bits=4@32",
                             "kivi:bits=8@32", "snapkv:ratio=0.25@32"),
        logprob_drift=True, host_time_configs=("one level", "ngram two-level"),
        window_cap_requests=16, placement=True, device_check_full=True),
}


@dataclass
class Context:
    """What the suites of one run share: the size, the model, and earlier suites' results."""

    size: Size
    model_dir: Path
    results: dict[str, dict] = field(default_factory=dict)

    @cached_property
    def hf(self):
        """The float32 HF model and tokenizer with the recording attention (hf_eval)."""
        from vericache_tools.hf_eval import load_model

        return load_model(self.model_dir)


def compressors(ctx: Context) -> dict:
    """Ratio, attention error and greedy tokens matched per compressor (bench.compress_quality)."""
    from bench.compress_quality import measure
    from vericache_sglang.compress import parse_compressor_spec

    s = ctx.size
    model, tokenizer = ctx.hf
    rows = measure(model, tokenizer, list(s.quality_files), [s.quality_tokens],
                   list(s.quality_specs), s.quality_new_tokens, error_steps=2)
    result = [{"spec": r.compressor.spec(), "ratio_vs_bf16": r.bf16_bytes / r.bytes,
               "attention_error": sum(r.errors) / len(r.errors), "matched": r.matched}
              for r in rows]
    keeps_all = parse_compressor_spec(CONTROL).spec()
    control = [r for r in result if r["spec"] == keeps_all]
    return {"result": result, "new_tokens": s.quality_new_tokens,
            "identical": all(m == s.quality_new_tokens for r in control for m in r["matched"])
            if control else None}


def drafting(ctx: Context) -> dict:
    """E (tokens per verification) by draft length per compressor, from VeriCache rounds
    simulated on HF transformers (bench.spec_offline), each output checked against greedy."""
    from bench.spec_offline import greedy_reference, simulate
    from vericache_tools.prompts import file_prompt

    s = ctx.size
    model, tokenizer = ctx.hf
    label, ids = file_prompt(tokenizer, s.drafting_prompt)
    reference = greedy_reference(model, ids, s.drafting_new_tokens)
    rows, same = [], True
    for spec in s.drafting_specs:
        for k in s.draft_lengths:
            r = simulate(model, ids, spec, k, s.drafting_new_tokens)
            same &= r["output"] == reference
            rows.append({"spec": spec, "k": k, "E": r["E"], "rounds": r["rounds"],
                         "acceptance": r["accepted"] / max(r["drafted"], 1)})
            cli.log(f"  {spec} k={k}: E {r['E']:.2f}")
    return {"result": rows, "prompt": label, "new_tokens": s.drafting_new_tokens,
            "identical": same}


def memory(ctx: Context) -> dict:
    """Device bytes per context token while drafting, per compressor, bf16, one layer
    (bench.memory's first table)."""
    from bench.memory import Geometry, measure_memory, real_kv

    s = ctx.size
    kvs = real_kv(ctx.model_dir, list(s.memory_files), s.memory_context, layer=0)
    geometry = Geometry.of(ctx.model_dir)
    rows = [asdict(measure_memory(spec, "bfloat16", kvs, geometry, draft_length=8))
            for spec in s.memory_specs]
    return {"result": [{**r, "per_token": (r["pages"] + r["owned"] + r["buffers"]) / r["tokens"]}
                       for r in rows], "identical": None}


def codec(ctx: Context) -> dict:
    """The CacheGen codec's bytes per element and speed (bench.codec), per-channel tables."""
    from bench import codec as bench_codec

    model, tokenizer = ctx.hf
    return {"result": bench_codec.measure(model, tokenizer, ["argparse.py"],
                                          ctx.size.codec_tokens, groupings=("channel",)),
            "identical": None}


def store(ctx: Context) -> dict:
    """Files, bytes on disk and speed of a prefix in VeriCache's file store by page size
    (bench.store; every page is read back and compared as it is measured)."""
    from bench import store as bench_store

    model, tokenizer = ctx.hf
    return {"result": bench_store.measure(model, tokenizer, ["argparse.py"],
                                          ctx.size.store_tokens),
            "identical": None}


def cpu_gemm(ctx: Context) -> dict:
    """One forward's products at few rows, as X @ W^T and in the worker's few-row form
    (bench.cpu_gemm), with this run's torch threads."""
    from bench import cpu_gemm as bench_gemm

    model, _ = ctx.hf
    return {"result": bench_gemm.measure(bench_gemm.forward_weights(model), ctx.size.gemm_rows,
                                         ctx.size.gemm_repeats),
            "identical": None}


def device_check(ctx: Context) -> dict:
    """The prepared device check (bench.device_check): kernels against the torch reference,
    draft-step attention, the copy engine and the performance model, on the GPU at full size
    where there is one, else at toy sizes on the CPU."""
    from bench import device_check as check

    gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as out:
        data = check.run(Path(out), torch.device("cuda" if gpu else "cpu"),
                         small=not (gpu and ctx.size.device_check_full))
    return {"result": data, "identical": check.passed(data)}


def serving(ctx: Context) -> dict:
    """Decode throughput against plain SGLang by workload and batch (bench.multilevel), the
    request types' share of tokens from drafting rounds (bench.request_types) on the VeriCache
    server, and that server's full-tier figures; one server at a time, stopped by PID."""
    from transformers import AutoTokenizer

    from bench import multilevel, request_types
    from bench.serving import start_failure, vericache_figures
    from vericache_sglang import models
    from vericache_tools.server_args import server_args
    from vericache_tools.server_process import ServerProcess, ServerStartError

    s = ctx.size
    tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir)
    loads = {w: p for w, p in multilevel.workloads(tokenizer, s.prompt_tokens,
                                                   s.new_tokens).items() if w in s.workloads}
    kinds = {name: batch for name, batch in request_types.batches(tokenizer, s.new_tokens).items()
             if any(name.startswith(word) for word in s.request_types)}
    every = multilevel.server_args("host", models.prepare().drafter)
    servers = {name: every[name] for name in ["plain SGLang", *s.servers]}
    # bench.multilevel's batch, with /metrics and custom logit processors for the request types
    common = server_args(max_running_requests=4, metrics=True, custom_logit_processor=True)
    throughput, kinds_out, figures, failures, startup = {}, {}, None, {}, {}
    for name, extra in servers.items():
        cli.log(f"  {name}: starting")
        try:
            with ServerProcess(ctx.model_dir, [*common, *extra]) as server:
                startup[name] = server.startup_seconds
                throughput[name] = {w: multilevel.measure_decode(server, p)
                                    for w, p in loads.items()}
                if name == s.servers[0]:
                    kinds_out = {k: request_types.measure(server, b) for k, b in kinds.items()}
                    figures = vericache_figures(server.server_info())
        except ServerStartError as e:
            failures[name] = start_failure(e)
    plain = throughput["plain SGLang"]
    rows, same = [], True
    for name, by_workload in throughput.items():
        for w, r in by_workload.items():
            reference = plain[w]["outputs"][0]
            n = multilevel.identical(r, reference)
            same &= n == len(reference)
            rows.append({"server": name, "workload": w, "tok_s": r["tok_s"],
                         "vs_plain": r["tok_s"] / plain[w]["tok_s"], "E": r["E0"],
                         "identical": f"{n} of {len(reference)}"})
    return {"result": {"throughput": rows, "request_types": kinds_out, "full_tier": figures,
                       "startup_s": startup, "not_started": failures},
            "identical": same}


def full_tier(ctx: Context) -> dict:
    """More long requests under one device budget: plain, HiCache, VeriCache host tier
    (bench.full_tier); at a size without a budget, the throughput suite's figures."""
    s = ctx.size
    if s.full_tier_budget is None:
        return {"skipped": "this size runs no budget comparison (three more servers); the "
                "VeriCache server's full-tier figures are in the serving suite",
                "identical": None}
    from transformers import AutoTokenizer

    from bench import full_tier as bench_full_tier

    tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir)
    sent = bench_full_tier.payloads(tokenizer, s.full_tier_prompt_tokens, s.new_tokens)
    rows = {name: bench_full_tier.run(ctx.model_dir, extra, s.full_tier_budget, sent)
            for name, extra in bench_full_tier.CONFIGS.items()}
    plain = rows["plain"]["outputs"]
    return {"result": {name: {k: v for k, v in r.items() if k != "outputs"}
                       for name, r in rows.items()},
            "identical": all(r["outputs"] == plain for r in rows.values())}


def spec_decode(ctx: Context) -> dict:
    """E, acceptance, full-KV reads and decode speed of VeriCache servers at fixed draft
    lengths against plain SGLang (bench.spec_decode), every output compared."""
    s = ctx.size
    if not s.spec_decode_prompts:
        return {"skipped": "this size runs no fixed-k servers (two more servers); the drafting "
                "suite measures E offline", "identical": None}
    from transformers import AutoTokenizer

    from bench import spec_decode as bench_spec

    prompts = bench_spec.load_prompts(list(s.spec_decode_prompts),
                                      AutoTokenizer.from_pretrained(ctx.model_dir))
    result = bench_spec.run(ctx.model_dir, prompts,
                            [bench_spec.Config.parse(c) for c in s.spec_decode_configs],
                            s.new_tokens)
    return {"result": result, "identical": not any(c["mismatches"] for c in result["configs"])}


def logprob_drift(ctx: Context) -> dict:
    """How far VeriCache's returned logprobs are from plain SGLang's, against plain SGLang's own
    drift over a cached prefix (bench.logprob_drift), the tokens compared."""
    if not ctx.size.logprob_drift:
        return {"skipped": "this size runs no logprob drift (two more servers)",
                "identical": None}
    from bench import logprob_drift as drift

    rows = drift.measure(ctx.model_dir)
    return {"result": rows, "identical": all(r["same_tokens"] for r in rows)}


def round_host_time(ctx: Context) -> dict:
    """Host work per VeriCache round, timed inside the scheduler (bench.round_host_time), on
    this checkout."""
    s = ctx.size
    if not s.host_time_configs:
        return {"skipped": "this size times no rounds (a server per configuration)",
                "identical": None}
    from bench import round_host_time as host_time

    rows = host_time.run(ctx.model_dir, list(s.host_time_configs),
                         [w for w in s.workloads if w.startswith("code")], s.prompt_tokens,
                         s.new_tokens)
    return {"result": rows, "identical": None}


def window_cap(ctx: Context) -> dict:
    """What the drafting-window reserve's cap on running requests costs a larger batch
    (bench.window_cap)."""
    if ctx.size.window_cap_requests is None:
        return {"skipped": "this size runs no window-cap comparison (two more servers)",
                "identical": None}
    from bench import window_cap as cap

    return {"result": cap.run(ctx.model_dir, ctx.size.window_cap_requests, cap.PROMPT_TOKENS,
                              ctx.size.new_tokens), "identical": None}


def placement(ctx: Context) -> dict:
    """The full KV on the host against on the device, every memory setting at its default
    (bench.placement), outputs against plain SGLang's."""
    if not ctx.size.placement:
        return {"skipped": "this size runs no placement comparison (five more servers at "
                "default memory)", "identical": None}
    from bench import placement as bench_placement

    rows = bench_placement.measure(ctx.model_dir, bench_placement.PROMPT_TOKENS,
                                   ctx.size.new_tokens)
    return {"result": rows, "identical": all(map(bench_placement.identical, rows))}


def perfmodel(ctx: Context) -> dict:
    """Predicted decode speed-up of VeriCache (host tier) over plain SGLang (full KV in HBM)
    and over the full KV streamed from host memory every step, on an H200 (Llama-3-8B),
    against context length, at the E and compression this run measured."""
    from vericache_tools import perfmodel as pm

    drafted = [r for r in ctx.results.get("drafting", {}).get("result", [])
               if r["spec"] == "kivi:bits=4"]
    held = [r for r in ctx.results.get("memory", {}).get("result", [])
            if r["spec"] == "kivi:bits=4"]
    if not drafted or not held:
        return {"skipped": "needs the drafting and memory suites' kivi:bits=4 rows",
                "identical": None}
    best = max(drafted, key=lambda r: r["k"])
    k, e = best["k"], min(max(best["E"], 1.0), best["k"] + 1)
    ratio = held[0]["per_token"] / held[0]["full_per_token"]
    g, hw = pm.GEOMETRIES["llama-3-8b"], pm.HARDWARE["h200"]
    contexts = [2**i for i in range(12, 19)]
    rows = []
    for batch in (1, 8, 32):
        for context in contexts:
            w = pm.Workload(context=context, batch=batch, k=k, tokens_per_round=e,
                            compressed_bytes_per_token=ratio * g.full_kv_bytes_per_token())
            p = pm.predict(g, hw, w)
            rows.append({"batch": batch, "context": context,
                         **{f"{name}_tok_s": q.tokens_per_s for name, q in p.items()},
                         **{f"{name}_fits": q.fits for name, q in p.items()},
                         **{f"speedup_vs_{name}": p["vericache"].tokens_per_s / q.tokens_per_s
                            for name, q in p.items() if name != "vericache"}})
    return {"result": {"model": g.name, "hardware": hw.name, "k": k, "E": e,
                       "compressed_ratio": ratio, "rows": rows}, "identical": None}


def remote_prefix(ctx: Context) -> dict:
    """Time to the n-th token of requests over a stored prefix behind an emulated link, at each
    rate: plain SGLang recomputing it, HiCache reading the full KV, VeriCache reading its coded
    pages, and drafting on them early (bench.remote_prefix), every output against
    recomputing's."""
    from bench import remote_prefix as rp

    s = ctx.size
    if not s.remote_prefix_rates:
        return {"skipped": "this size measures no remote prefix (five servers one after another "
                "behind an emulated link): --size small runs it", "identical": None}
    reason = rp.unavailable_reason()
    if reason:
        return {"skipped": REMOTE_PREFIX_UNAVAILABLE + reason, "identical": None}
    record = rp.measure(rp.Settings(
        model=str(ctx.model_dir), prefix_tokens=s.remote_prefix_tokens,
        new_tokens=s.remote_prefix_new_tokens, mark_token=s.remote_prefix_mark,
        rates_mbit=s.remote_prefix_rates, batch=s.remote_prefix_batches,
        configs=REMOTE_PREFIX_CONFIGS))
    return {"result": record, "identical": rp.identical(record)}


SUITES: dict[str, Callable[[Context], dict]] = {
    "compressors": compressors, "drafting": drafting, "memory": memory, "codec": codec,
    "store": store, "cpu_gemm": cpu_gemm, "device_check": device_check, "perfmodel": perfmodel,
    "serving": serving, "spec_decode": spec_decode, "logprob_drift": logprob_drift,
    "round_host_time": round_host_time, "full_tier": full_tier, "window_cap": window_cap,
    "placement": placement, "remote_prefix": remote_prefix,
}
"""In run order: the suites without servers first; perfmodel reads drafting's and memory's
results."""
