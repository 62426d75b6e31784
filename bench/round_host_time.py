"""Host work per VeriCache round: the scheduler's time in a decode round outside the model's
forwards, for this checkout and, with `--checkout DIR`, another one (a before/after
comparison; not a test).

Each configuration starts a server whose scheduler loads `bench/round_timer.py` as an SGLang
plugin; it times every decode round and every model forward inside one. The workload is
`bench.multilevel`'s code continuation (a held-out stdlib context cut before its last
definition, 128 greedy tokens) at batch 1 and 4, sent once to warm the server and once timed,
from a flushed cache. Round host work = round time minus its forwards' time: its mean and
median per round, and the first round's (which compresses the prompt's pages); on a CPU a
forward's wall time is its compute. Outputs are compared between checkouts.

`python -m bench` runs it as its round_host_time suite, on this checkout alone (`run` gives the
rows).

    python -m bench.round_host_time --checkout /tmp/before --prompt-tokens 3000
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from bench import cli, multilevel
from bench.serving import COMMON, send_together
from bench.tables import table
from vericache_tools.server_args import VERICACHE
from vericache_tools.server_process import ServerProcess

CONFIGS = {
    "one level": [*VERICACHE, "--vericache-full-tier", "device", "--vericache-drafter", "none"],
    "ngram two-level": [*VERICACHE, "--vericache-full-tier", "device",
                        "--vericache-drafter", "ngram"],
}
ENTRY_POINT = "vericache_round_timer"


def plugin_dir(root: Path) -> Path:
    """A directory that declares `round_timer` as an SGLang plugin (a module and a dist-info
    with its `sglang.srt.plugins` entry point), for a server's PYTHONPATH."""
    shutil.copy(Path(__file__).with_name("round_timer.py"), root / f"{ENTRY_POINT}.py")
    info = root / f"{ENTRY_POINT}-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {ENTRY_POINT}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        f"[sglang.srt.plugins]\n{ENTRY_POINT} = {ENTRY_POINT}:register\n")
    return root


def measure(model: Path, args: list[str], payloads: list[dict], pythonpath: list[Path],
            work: Path) -> dict:
    """One server's timed batch: its rounds' totals and its outputs."""
    out = work / "totals.json"
    env = {"PYTHONPATH": os.pathsep.join(map(str, pythonpath)),
           "VERICACHE_ROUND_TIMER_OUT": str(out)}
    with ServerProcess(model, [*COMMON, *args], env=env) as server:
        send_together(server, payloads)  # warm-up: the same batch
        server.flush_cache()
        out.unlink(missing_ok=True)
        answers = send_together(server, payloads)
    totals = json.loads(out.read_text())
    rounds = totals["rounds"]
    host = totals["round_seconds"] - totals["forward_seconds_in_rounds"]
    return {
        "rounds": rounds,
        "host_ms_per_round": 1000 * host / rounds,
        "median_host_ms": 1000 * statistics.median(totals["host_seconds_by_round"]),
        "first_round_host_ms": 1000 * totals["host_seconds_by_round"][0],
        "forward_ms_per_round": 1000 * totals["forward_seconds_in_rounds"] / rounds,
        "host_share": host / totals["round_seconds"],
        "forwards_per_round": totals["forwards_in_rounds"] / rounds,
        "tokens": sum(a["meta_info"]["completion_tokens"] for a in answers),
        "outputs": [a["output_ids"] for a in answers],
    }


def run(model: Path, configs: list[str], workloads: list[str], prompt_tokens: int,
        new_tokens: int, checkout: Path | None = None) -> list[dict]:
    """One row per configuration, workload and checkout (`checkout`, when given, first as
    "before", then this one): its rounds' host and forward times and its outputs."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    loads = multilevel.workloads(tokenizer, prompt_tokens, new_tokens)
    checkouts = {"this checkout": []}
    if checkout is not None:
        checkouts = {"before": [checkout.resolve()], **checkouts}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plugins = plugin_dir(Path(tmp))
        for config in configs:
            for workload in workloads:
                for name, path in checkouts.items():
                    key = f"{config} | {workload} | {name}"
                    cli.log(f"{key} ...")
                    work = Path(tempfile.mkdtemp(dir=tmp))
                    rows.append({"config": config, "workload": workload, "checkout": name,
                                 **measure(model, CONFIGS[config], loads[workload],
                                           [*path, plugins], work)})
                    cli.log(f"{key}: {rows[-1]['host_ms_per_round']:.1f} host ms per round")
    return rows


def same_outputs(rows: list[dict]) -> list[bool]:
    """Per row, whether its outputs equalled those of the first checkout's row of the same
    configuration and workload."""
    first = {}
    for r in rows:
        first.setdefault((r["config"], r["workload"]), r["outputs"])
    return [r["outputs"] == first[(r["config"], r["workload"])] for r in rows]


def markdown(rows: list[dict]) -> str:
    return table(["config", "workload", "checkout", "rounds", "host ms / round",
                  "median host ms", "first round host ms", "forward ms / round", "host share",
                  "forwards / round", "same output"],
                 [[r["config"], r["workload"], r["checkout"], r["rounds"],
                   f"{r['host_ms_per_round']:.1f}", f"{r['median_host_ms']:.1f}",
                   f"{r['first_round_host_ms']:.1f}", f"{r['forward_ms_per_round']:.1f}",
                   f"{100 * r['host_share']:.1f}%", f"{r['forwards_per_round']:.1f}",
                   "yes" if same else "NO"] for r, same in zip(rows, same_outputs(rows),
                                                               strict=True)])


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.round_host_time", __doc__)
    cli.add_model(parser)
    parser.add_argument("--checkout", type=Path, default=None,
                        help="another checkout of this repository to compare with (run with "
                        "this environment, its package first on the path)")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--workloads", nargs="+", default=["code, batch 1", "code, batch 4"])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    rows = run(cli.model_dir(args.model), args.configs, args.workloads, args.prompt_tokens,
               args.new_tokens, args.checkout)
    print(markdown(rows))
    print(cli.invocation("bench.round_host_time", argv))
    if args.out is not None:
        args.out.write_text(json.dumps({"command": cli.invocation("bench.round_host_time", argv),
                                        "results": rows}, indent=1))
    return 0 if all(same_outputs(rows)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
