"""A run's JSON record as markdown: the machine, the command, each suite's time and headline
numbers, for the generated section of docs/benchmarks.md (the figures are embedded beside it)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from bench import tables


def _compressors(s: dict) -> str:
    return tables.table(
        ["compressor", "ratio vs bf16", "attention error",
         f"greedy tokens matched (of {s['new_tokens']})"],
        [[f"`{r['spec']}`", f"{r['ratio_vs_bf16']:.2f}x", f"{r['attention_error']:.4f}",
          "/".join(map(str, r["matched"]))] for r in s["result"]], "lrrr")


def _serving(s: dict) -> str:
    r = s["result"]
    parts = [tables.table(
        ["server", "workload", "decode tok/s", "vs plain", "E", "outputs = plain"],
        [[t["server"], t["workload"], f"{t['tok_s']:.2f}", f"{t['vs_plain']:.2f}x",
          "-" if t["E"] is None else f"{t['E']:.1f}", t["identical"]] for t in r["throughput"]],
        "llrrrl")]
    if r["request_types"]:
        parts.append(tables.table(
            ["request type (VeriCache server)", "tokens from rounds", "plain steps",
             "share from rounds", "E"],
            [[name, k["emitted"], k["plain"], f"{k['share']:.0%}",
              "-" if k["E"] is None else f"{k['E']:.2f}"]
             for name, k in r["request_types"].items()], "lrrrr"))
    f = r["full_tier"]
    if f:
        parts.append(f"VeriCache server, host tier (`/server_info`): "
                     f"{f['device_bytes_per_token']:.0f} device bytes per context token the "
                     f"budget holds (plain SGLang: the full KV, 46,080 in float32), "
                     f"{f['read_per_token'] / 2**20:.1f} MiB of full KV read per emitted "
                     f"token, {f['hidden']:.0%} of fetch time hidden, E {f['E']:.1f}.")
    parts += [f"{name}: {why}" for name, why in r["not_started"].items()]
    return "\n\n".join(parts)


def _perfmodel(s: dict) -> str:
    m = s["result"]
    rows = [r for r in m["rows"] if r["context"] in (8192, 32768, 131072)]
    return (f"{m['model']} on {m['hardware']}, k={m['k']}, E={m['E']:.2f} and compressed "
            f"{m['compressed_ratio']:.2f} of the full KV from this run:\n\n" + tables.table(
                ["batch", "context", "VeriCache / plain", "VeriCache / streamed",
                 "VeriCache / offloaded", "plain fits"],
                [[r["batch"], f"{r['context']:,}", f"{r['speedup_vs_plain']:.2f}x",
                  f"{r['speedup_vs_streamed']:.2f}x", f"{r['speedup_vs_offloaded']:.2f}x",
                  "yes" if r["plain_fits"] else "no"] for r in rows], "rrrrrl"))


def _script(name: str) -> Callable[[dict], str]:
    """A suite shown as its script prints its results (`bench.NAME.markdown`)."""
    def detail(s: dict) -> str:
        return importlib.import_module(f"bench.{name}").markdown(s["result"])

    return detail


DETAIL = {"compressors": _compressors, "serving": _serving, "perfmodel": _perfmodel,
          **{name: _script(name) for name in (
              "codec", "store", "cpu_gemm", "spec_decode", "logprob_drift", "round_host_time",
              "window_cap", "placement", "remote_prefix")}}
"""Suites whose numbers are a table here (the others are their figures, or the JSON alone)."""


def markdown(record: dict) -> str:
    m, git = record["machine"], record["git"]
    lines = [
        f"`{record['command']}` ({record['size']} size), {record['seconds']:.0f} s in all, at "
        f"commit `{(git['commit'] or 'unknown')[:12]}`" + (" with uncommitted changes" if
                                                          git["dirty"] else "") + ", on "
        f"{m['cpu']} ({m['cores']} cores, {m['memory_gb']:g} GiB, GPU: {m['gpu'] or 'none'}), "
        f"Python {m['python']}, torch {m['torch']}, SGLang {m['sglang']}. Outputs identical to "
        f"plain decoding (the kernels': to the torch reference) wherever a suite compares: "
        f"**{'yes' if record['identical'] else 'NO'}**.",
        "",
        tables.table(["suite", "seconds", "outputs compared", "note"],
                     [[name, s["seconds"],
                       {None: "-", True: "identical", False: "**DIFFER**"}[s["identical"]],
                       s.get("skipped", "")] for name, s in record["suites"].items()], "lrll"),
    ]
    for name, detail in DETAIL.items():
        if "result" in record["suites"].get(name, {}):
            lines += ["", f"**{name}**", "", detail(record["suites"][name])]
    return "\n" + "\n".join(lines) + "\n"
