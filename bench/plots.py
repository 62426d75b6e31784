"""The run's figures, drawn from its JSON results (matplotlib, no display needed): one PNG per
question the report answers, so docs/benchmarks.md embeds what a run wrote."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def e_by_draft_length(drafting: dict, path: Path) -> Path:
    """E against k per compressor, under the k + 1 a round can emit at most."""
    fig, ax = plt.subplots(figsize=(6, 4))
    lines = defaultdict(list)
    for r in drafting["result"]:
        lines[r["spec"]].append((r["k"], r["E"]))
    ks = sorted({k for points in lines.values() for k, _ in points})
    ax.plot(ks, [k + 1 for k in ks], "k:", label="k + 1 (every draft accepted)")
    for spec, points in lines.items():
        ax.plot(*zip(*sorted(points), strict=True), "o-", label=spec)
    ax.set(xlabel="draft length k", ylabel="E (tokens per verification)",
           title=f"E by draft length ({drafting['prompt']}, {drafting['new_tokens']} tokens)")
    ax.set_xticks(ks)
    ax.legend()
    return _save(fig, path)


def device_bytes(memory: dict, path: Path) -> Path:
    """Device bytes per context token while drafting, per compressor, against plain SGLang's
    full KV (one layer, bf16)."""
    rows = memory["result"]
    labels = ["plain SGLang (full KV)"] + [r["spec"] for r in rows]
    values = [rows[0]["full_per_token"]] + [r["per_token"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 0.45 * len(labels) + 1.2))
    bars = ax.barh(labels, values, color=["grey"] + ["tab:blue"] * len(rows))
    ax.bar_label(bars, fmt="%.0f", padding=2)
    ax.invert_yaxis()
    ax.set(xlabel="device bytes per context token (one layer, bf16)",
           title="Drafting's device memory against the full KV")
    return _save(fig, path)


def throughput(serving: dict, path: Path) -> Path:
    """Decode tok/s of each server as a ratio to plain SGLang, by workload and batch."""
    rows = [r for r in serving["result"]["throughput"] if r["server"] != "plain SGLang"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    servers = list(dict.fromkeys(r["server"] for r in rows))
    width = 0.8 / max(len(servers), 1)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, server in enumerate(servers):
        ratio = {r["workload"]: r["vs_plain"] for r in rows if r["server"] == server}
        xs = [j + i * width for j in range(len(workloads))]
        bars = ax.bar(xs, [ratio.get(w, 0) for w in workloads], width, label=server)
        ax.bar_label(bars, fmt="%.2fx", padding=2)
    ax.axhline(1.0, color="k", linestyle=":", label="plain SGLang")
    ax.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(workloads))],
                  workloads)
    ax.set(ylabel="decode tok/s / plain SGLang's", title="Throughput against plain SGLang (CPU)")
    ax.legend()
    return _save(fig, path)


def predicted_speedup(perfmodel: dict, path: Path) -> Path:
    """The performance model's VeriCache speed against context, per batch: over plain SGLang
    with the full KV in HBM (hollow where that does not fit) and over the full KV streamed from
    host memory every step (what runs when it does not)."""
    m = perfmodel["result"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    by_batch = defaultdict(list)
    for r in m["rows"]:
        by_batch[r["batch"]].append(r)
    for ax, against, fits in ((axes[0], "plain", "plain_fits"),
                              (axes[1], "streamed", "streamed_fits")):
        for batch, rows in by_batch.items():
            line, = ax.plot([r["context"] for r in rows],
                            [r[f"speedup_vs_{against}"] for r in rows], "-",
                            label=f"batch {batch}")
            for r in rows:
                ax.plot(r["context"], r[f"speedup_vs_{against}"], "o", color=line.get_color(),
                        fillstyle="full" if r[fits] else "none")
        ax.axhline(1.0, color="k", linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="context tokens per request", ylabel=f"VeriCache / {against} tok/s",
               title=f"over {against} SGLang" if against == "plain"
               else "over the full KV streamed from host")
        ax.legend(title=f"hollow: {against} does not fit", fontsize=8)
    fig.suptitle(f"Model prediction, not a measurement: {m['model']} on {m['hardware']}, "
                 f"VeriCache host tier, k={m['k']}, E={m['E']:.1f}, compressed "
                 f"{m['compressed_ratio']:.2f} of the full KV", fontsize=10)
    return _save(fig, path)


def time_to_token(remote_prefix: dict, path: Path) -> Path:
    """Seconds to the n-th token of a request over a stored prefix against the emulated link's
    rate, one line per configuration (one panel per batch size): where reading the prefix beats
    recomputing it, and what VeriCache's coded pages gain over HiCache's full KV."""
    args, rows = remote_prefix["result"]["args"], remote_prefix["result"]["results"]["rows"]
    batches = sorted({r["batch"] for r in rows})
    rates = sorted({r["rate_mbit"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        for config in dict.fromkeys(r["config"] for r in rows):
            points = sorted((r["rate_mbit"], r["mark_s"]) for r in rows
                            if r["config"] == config and r["batch"] == batch
                            and r["mark_s"] is not None)
            if points:
                ax.plot(*zip(*points, strict=True), "o-", label=config)
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{rate:g}" for rate in rates])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set(xlabel="link Mbit/s (emulated)",
               ylabel=f"seconds until {args['mark_token']} tokens", title=f"batch {batch}")
        ax.legend()
    fig.suptitle(f"Time until {args['mark_token']} output tokens over a stored "
                 f"{args['prefix_tokens']}-token prefix: recomputed, or read through a shaped "
                 f"link ({args['dtype']}, one run)", fontsize=10)
    return _save(fig, path)


PLOTS = {"drafting": ("e_by_draft_length.png", e_by_draft_length),
         "memory": ("device_bytes.png", device_bytes),
         "serving": ("throughput.png", throughput),
         "perfmodel": ("predicted_speedup.png", predicted_speedup),
         "remote_prefix": ("time_to_token.png", time_to_token)}
"""Suite -> (file name, drawing); a suite that was skipped draws nothing."""


def draw(suites: dict[str, dict], folder: Path) -> list[Path]:
    """Every figure whose suite has results, written into `folder`."""
    return [draw_one(suites[name], folder / file) for name, (file, draw_one) in PLOTS.items()
            if "result" in suites.get(name, {})]
