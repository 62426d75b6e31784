"""Where a VeriCache round spends the scheduler's time: the model's forwards, or host work
around them (planning, page lookups, checking drafts, acceptance), sampled with py-spy
(not a test).

One server, one request: a long code context (cached first, so the timed request decodes)
and greedy new tokens. While it decodes, py-spy samples the scheduler process's threads; each
sample of the thread that runs the rounds is counted as

- **forward**: inside the model's forward (`sglang/srt/models/`, the logits processor): compute,
  which on a CPU includes the attention backends VeriCache adds;
- **round host work**: inside VeriCache's worker but outside any forward;
- **scheduler**: SGLang's own loop around the rounds.

Host milliseconds per round are round host work's samples over the request's verification
rounds. The script imports only `vericache_sglang`'s server process, prompts and models, so
it also runs against an older checkout of the package (a before/after comparison).

    python -m bench.round_profile --prompt-tokens 3000 --new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from transformers import AutoTokenizer

from vericache_sglang.prompts import stdlib_ids
from vericache_sglang.server_process import ServerProcess

SERVER = ["--dtype", "float32", "--chunked-prefill-size", "2048", "--random-seed", "0",
          "--enable-vericache", "--vericache-compressor", "kivi:bits=4",
          "--vericache-full-tier", "device"]
FORWARD_FILES = ("/sglang/srt/models/", "/sglang/srt/layers/logits_processor.py")
RATE = 200
"""py-spy samples per second."""


def scheduler_pid(server: ServerProcess) -> int:
    """The child process whose command line names SGLang's scheduler."""
    found = subprocess.run(["pgrep", "-g", str(server.proc.pid), "-f", "scheduler"],
                           capture_output=True, text=True).stdout.split()
    if not found:
        raise RuntimeError("no scheduler process found under the server")
    return int(found[0])


def classify(raw: str) -> Counter:
    """Samples by category, from py-spy's raw (collapsed) stacks of the busiest thread that
    runs VeriCache's worker."""
    by_thread: dict[str, Counter] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread, frames = frames[0], frames[1:]
        in_worker = any("vericache_sglang/" in f and "worker" in f for f in frames)
        if not in_worker:
            kind = "scheduler"
        elif any(any(name in f for name in FORWARD_FILES) for f in frames):
            kind = "forward"
        else:
            kind = "round host work"
        by_thread.setdefault(thread, Counter())[kind] += int(count)
    return max(by_thread.values(), key=lambda c: c["forward"] + c["round host work"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.round_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="HF model directory (default: the prepared demo model)")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--module", default="argparse", help="stdlib module of the context")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="more server arguments (e.g. --vericache-drafter none)")
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("bench.round_profile needs py-spy (pip install py-spy; setup.sh installs it)",
              file=sys.stderr)
        return 2
    if args.model is None:
        from vericache_sglang.models import prepare

        args.model = prepare().target
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = stdlib_ids(tokenizer, args.module, args.prompt_tokens, start=0)
    request = {"input_ids": ids, "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                      "max_new_tokens": args.new_tokens}}
    with ServerProcess(args.model, [*SERVER, *args.extra]) as server, \
            tempfile.TemporaryDirectory() as tmp:
        server.generate({**request, "sampling_params": {**request["sampling_params"],
                                                         "max_new_tokens": 1}})
        raw = Path(tmp) / "raw.txt"
        sampler = subprocess.Popen([spy, "record", "--pid", str(scheduler_pid(server)),
                                    "--rate", str(RATE), "--format", "raw", "--threads",
                                    "--output", str(raw)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attached
        began = time.monotonic()
        out = server.generate(request)
        seconds = time.monotonic() - began
        sampler.send_signal(signal.SIGINT)
        sampler.wait(timeout=60)
        samples = classify(raw.read_text())
    meta = out["meta_info"]
    rounds = meta.get("spec_verify_ct") or 0
    round_samples = samples["forward"] + samples["round host work"]
    result = {
        "server_args": [*SERVER, *args.extra], "prompt_tokens": len(ids),
        "new_tokens": len(out["output_ids"]), "seconds": round(seconds, 2),
        "verification_rounds": rounds, "samples": dict(samples),
        "host_share_of_rounds": samples["round host work"] / round_samples
        if round_samples else None,
        "host_ms_per_round": 1e3 * samples["round host work"] / RATE / rounds
        if rounds else None,
        "forward_ms_per_round": 1e3 * samples["forward"] / RATE / rounds if rounds else None,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
