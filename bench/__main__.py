"""Every benchmark, as a suite, at one size, into one JSON file and PNG plots.

    python -m bench --size smallest --out OUT_DIR     # minutes on a CPU; what the tests run
    python -m bench --size small --out docs/benchmarks
    python -m bench --size full --only serving full_tier --out OUT_DIR

Suites (bench/suites.py), each calling its script's functions and getting its figures back as
data: compressors (bench.compress_quality), drafting (E by draft length, bench.spec_offline),
memory (bench.memory), codec (bench.codec), store (bench.store), cpu_gemm (bench.cpu_gemm),
device_check (bench.device_check), perfmodel (the model's predicted GPU speed-up at this run's
E and compression), serving (throughput against plain SGLang by workload and batch, request
types, the full tier's figures: bench.multilevel, bench.request_types), spec_decode,
logprob_drift, round_host_time, full_tier, window_cap, placement (each bench.<suite>) and
remote_prefix (time to the n-th token over a shaped link, bench.remote_prefix). A size that
does not run a suite, or a machine that cannot, records why. OUT_DIR gets bench-<time>.json
(the machine, the git commit, the command, each suite's results or why it was skipped,
whether its outputs equalled their reference's) and the plots. Exit status 1 if any compared
output differed.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

from tqdm import tqdm

from bench import cli
from bench.docs_section import replace_section
from bench.plots import draw
from bench.report import markdown
from bench.suites import SIZES, SUITES, Context

ROOT = Path(__file__).resolve().parents[1]
SECTION = "bench-run"


def machine() -> dict:
    """What the numbers were measured on."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(memory_gb, 1),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "sglang": version("sglang"), "platform": platform.platform()}


def git_commit() -> dict:
    """The commit measured, and whether the working tree differed from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench", __doc__)
    parser.add_argument("--size", choices=SIZES, default="smallest",
                        help="how much every suite measures (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True,
                        help="folder for the JSON file and the plots")
    parser.add_argument("--only", nargs="+", choices=SUITES, metavar="SUITE",
                        help=f"run only these suites, of {', '.join(SUITES)}")
    parser.add_argument("--write-docs", type=Path, default=None,
                        help=f"markdown file whose {SECTION} section gets the run's summary")
    cli.add_model(parser)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    record = {"command": cli.invocation("bench", argv), "size": args.size,
              "started_utc": stamp, "machine": machine(), "git": git_commit(), "suites": {}}
    ctx = Context(SIZES[args.size], cli.model_dir(args.model), record["suites"])
    chosen = [name for name in SUITES if not args.only or name in args.only]
    with tqdm(chosen, desc="bench", unit="suite", file=sys.stderr) as bar:
        for name in bar:
            bar.set_description(f"bench: {name}")
            suite_began = time.monotonic()
            record["suites"][name] = {**SUITES[name](ctx),
                                      "seconds": round(time.monotonic() - suite_began, 1)}
    record["plots"] = [p.name for p in draw(record["suites"], args.out)]
    record["seconds"] = round(time.monotonic() - began, 1)
    different = [name for name, s in record["suites"].items() if s.get("identical") is False]
    record["identical"] = not different
    path = args.out / f"bench-{stamp}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    cli.log(f"wrote {path} and {len(record['plots'])} plots in {record['seconds']:.0f} s")
    if args.write_docs:
        replace_section(args.write_docs, SECTION, markdown(record))
    if different:
        print(f"!!! outputs differ from plain decoding in: {', '.join(different)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
