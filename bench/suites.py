"""The suites `python -m bench` runs, each at a size, each returning plain data for the run's
JSON and plots. A suite calls the functions its own script (`python -m bench.X`) runs, so the
entry and the scripts measure the same way; `identical` says whether every output a suite
compares equalled plain decoding's (None: the suite compares none)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from bench import cli

REMOTE_PREFIX = ("run on its own: `python -m bench.remote_prefix` measures a stored prefix "
                 "behind an emulated link (a network namespace, a Mooncake store, up to seven "
                 "servers: too long for this entry); levels chosen by the link (issue 27) are "
                 "not built yet")


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
        codec_tokens=256, prompt_tokens=1024, new_tokens=16,
        workloads=("code, batch 1", "code, batch 4"),
        request_types=("greedy", "3 greedy + 1 custom logit processor")),
    "small": Size(
        quality_files=("argparse.py", "GPL-3"), quality_tokens=1024, quality_specs=QUALITY_SPECS,
        quality_new_tokens=32, drafting_prompt="textwrap.py:512",
        drafting_specs=("kivi:bits=4", "kivi:bits=2", "snapkv:ratio=0.25"),
        draft_lengths=(2, 4, 8, 16), drafting_new_tokens=48,
        memory_files=("argparse.py", "difflib.py"), memory_context=1024,
        memory_specs=MEMORY_SPECS, codec_tokens=1024, prompt_tokens=1024, new_tokens=64,
        workloads=("code, batch 1", "chat, batch 1", "code, batch 4", "chat, batch 4"),
        request_types=("greedy", "sampled", "grammar", "3 greedy + 1 custom logit processor"),
        servers=("VeriCache, one level", "VeriCache + ngram"), full_tier_budget=6000,
        full_tier_prompt_tokens=2000),
    "full": Size(
        quality_files=("argparse.py", "textwrap.py", "GPL-3", "difflib.py"), quality_tokens=3072,
        quality_specs=QUALITY_SPECS, quality_new_tokens=64, drafting_prompt="textwrap.py:2048",
        drafting_specs=("kivi:bits=4", "kivi:bits=2", "snapkv:ratio=0.25"),
        draft_lengths=(4, 8, 16, 32), drafting_new_tokens=128,
        memory_files=("argparse.py", "difflib.py", "GPL-3", "typing.py"), memory_context=4096,
        memory_specs=MEMORY_SPECS, codec_tokens=2048, prompt_tokens=2500, new_tokens=128,
        workloads=("code, batch 1", "chat, batch 1", "code, batch 4", "chat, batch 4"),
        request_types=("greedy", "sampled", "logprobs", "penalties", "grammar", "tools",
                       "custom logit processor", "3 greedy + 1 custom logit processor"),
        servers=("VeriCache, one level", "VeriCache + ngram", "VeriCache + draft model",
                 "SGLang NGRAM"), full_tier_budget=12000),
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
    """The CacheGen codec's bytes and speed table (bench.codec, run as its command is)."""
    from bench import codec as codec_bench

    threads = torch.get_num_threads()  # bench.codec runs on one thread
    out = io.StringIO()
    argv = ["--files", "argparse.py", "--tokens", str(ctx.size.codec_tokens), "--chunk", "256",
            "--tables", "channel"]
    try:
        with contextlib.redirect_stdout(out):
            codec_bench.main(argv)
    finally:
        torch.set_num_threads(threads)
    return {"result": {"command": "python -m bench.codec " + " ".join(argv),
                       "table": out.getvalue().strip()}, "identical": None}


def serving(ctx: Context) -> dict:
    """Decode throughput against plain SGLang by workload and batch (bench.multilevel), the
    request types' share of tokens from drafting rounds (bench.request_types) on the VeriCache
    server, and that server's full-tier figures; one server at a time, stopped by PID."""
    from transformers import AutoTokenizer

    from bench import multilevel, request_types
    from bench.serving import COMMON, start_failure, vericache_figures
    from vericache_sglang import models
    from vericache_tools.server_process import ServerProcess, ServerStartError

    s = ctx.size
    tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir)
    loads = {w: p for w, p in multilevel.workloads(tokenizer, s.prompt_tokens,
                                                   s.new_tokens).items() if w in s.workloads}
    kinds = {name: batch for name, batch in request_types.batches(tokenizer, s.new_tokens).items()
             if any(name.startswith(word) for word in s.request_types)}
    every = multilevel.server_args("host", models.prepare().drafter)
    servers = {name: every[name] for name in ["plain SGLang", *s.servers]}
    throughput, kinds_out, figures, failures = {}, {}, None, {}
    for name, extra in servers.items():
        cli.log(f"  {name}: starting")
        try:
            with ServerProcess(ctx.model_dir, [*COMMON, *multilevel.BATCH,
                                               *request_types.METRICS, *extra]) as server:
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
                       "not_started": failures},
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
    return {"skipped": REMOTE_PREFIX, "identical": None}


SUITES: dict[str, Callable[[Context], dict]] = {
    "compressors": compressors, "drafting": drafting, "memory": memory, "codec": codec,
    "serving": serving, "full_tier": full_tier, "perfmodel": perfmodel,
    "remote_prefix": remote_prefix,
}
"""In run order: perfmodel reads drafting's and memory's results."""
