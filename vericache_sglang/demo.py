"""The main job on the built-in demo model: serve with `--enable-vericache`, ask, report, stop.

`python -m vericache_sglang.demo` starts a real SGLang server on SmolLM2-135M-Instruct with
VeriCache enabled, sends a long-context request (a Python standard-library module, ~2,000+
tokens) and a chat request, prints the answers with VeriCache's settings and statistics, and
stops the server.
"""

from __future__ import annotations

import argparse
import sys
import time

from vericache_sglang import models
from vericache_sglang.cpu.finder import nvidia_gpu_present
from vericache_sglang.speculative.meta_info import (
    DRAFT_FORWARDS_KEY,
    DRAFTER_KEPT_KEY,
    DRAFTER_PROPOSED_KEY,
)
from vericache_tools.prompts import stdlib_source
from vericache_tools.server_process import ServerProcess

NOT_BUILT_YET = (
    "Not built yet: a remote full tier, a server streaming the host tier's full KV on a GPU "
    "(its copy engine is built and passed the device check; the server path has not run "
    "there), drafting for requests with a custom logit processor (they take one plain step "
    "per round; their batch still drafts), and the overlap scheduler."
)


def vericache_stats(meta: dict) -> dict:
    """Per-request drafting statistics by level: SGLang's speculative counters in meta_info
    (level 0, the full-KV verification) and VeriCache's (level 1, the target over the
    compressed tier; level 2, the cheap drafter)."""
    rounds = meta.get("spec_verify_ct", 0)
    if not rounds:
        return {}
    drafted = round(meta.get("spec_cap_length", 0) * rounds)
    stats = {
        "level 0 (full KV)": {
            "verification_forwards": rounds,
            "drafts_accepted": f"{meta.get('spec_num_correct_drafts', 0)}/{drafted}",
            "tokens_per_verification": round((meta["completion_tokens"] - 1) / rounds, 2),
        },
    }
    if DRAFT_FORWARDS_KEY in meta:
        forwards = meta[DRAFT_FORWARDS_KEY][0]
        stats["level 1 (compressed KV)"] = {
            "drafting_forwards": forwards,
            "drafts_per_forward": round(drafted / forwards, 2) if forwards else 0,
        }
    if DRAFTER_PROPOSED_KEY in meta:
        stats["level 2 (drafter)"] = {
            "proposals_kept": f"{meta[DRAFTER_KEPT_KEY][0]}/{meta[DRAFTER_PROPOSED_KEY][0]}"}
    return stats


def long_context_prompt(max_chars: int) -> str:
    """The start of a real standard-library module, for the model to continue."""
    return stdlib_source("textwrap")[:max_chars]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vericache_sglang.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compressor", default="kivi:bits=4,group=32,residual=128",
                        help="--vericache-compressor for the server (default: %(default)s)")
    parser.add_argument("--draft-length", type=int, default=16,
                        help="--vericache-draft-length for the server (default: %(default)s)")
    parser.add_argument("--drafter", default="ngram", choices=["none", "ngram", "model"],
                        help="--vericache-drafter for the server; 'model' serves the distilled "
                        "drafter built from the package's weights as --vericache-draft-model "
                        "(default: %(default)s)")
    parser.add_argument("--dtype", default=None,
                        help="--dtype for the server (default: float32 without a GPU, where "
                        "bf16 matmuls are emulated and slower; else the model's)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--context-chars", type=int, default=9000,
                        help="characters of textwrap.py used as the long prompt")
    args = parser.parse_args(argv)

    prepared = models.prepare()
    model = prepared.target
    print(f"model: {model}")
    drafter = (["--vericache-draft-model", str(prepared.drafter)] if args.drafter == "model"
               else ["--vericache-drafter", args.drafter])
    dtype = args.dtype or ("auto" if nvidia_gpu_present() else "float32")
    server = ServerProcess(model, [
        "--dtype", dtype,
        "--enable-vericache",
        "--vericache-compressor", args.compressor,
        "--vericache-draft-length", str(args.draft_length),
        *drafter,
    ])
    print(f"starting SGLang with --enable-vericache on {server.url} (log: {server.log_path}) ...")
    with server:
        print(f"server healthy after {server.startup_seconds:.1f} s")
        info = server.server_info()
        settings = dict(info["vericache"])
        memory = settings.pop("memory", {})
        print("VeriCache settings (/server_info):")
        for key, value in settings.items():
            print(f"  {key}: {value}")
        print("KV memory by placement, measured from the pools' tensors (/server_info):")
        for key, value in memory.items():
            print(f"  {key}: {round(value, 1) if isinstance(value, float) else value}")

        prompt = long_context_prompt(args.context_chars)
        began = time.monotonic()
        out = server.generate({
            "text": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": args.max_new_tokens},
        })
        seconds = time.monotonic() - began
        meta = out["meta_info"]
        print(f"\n--- long-context request: textwrap.py, {meta['prompt_tokens']} prompt tokens ---")
        print(prompt[-300:] + "\033[1m" + out["text"] + "\033[0m")
        print(f"--- {meta['completion_tokens']} tokens in {seconds:.1f} s "
              f"({meta['completion_tokens'] / seconds:.1f} tokens/s incl. prefill) ---")
        levels = vericache_stats(meta)
        print("VeriCache statistics by level:" if levels
              else "VeriCache statistics: none (no verification round ran)")
        for level, figures in levels.items():
            print(f"  {level}: {figures}")
        state = server.server_info()["internal_states"][0].get("vericache_state", {})
        if state:
            print(f"device bytes held {state['device_bytes']['total']} of a "
                  f"{state['device_budget_bytes']}-byte budget; full KV read while decoding: "
                  f"{state['decode_read_bytes_per_emitted_token']:.0f} B per emitted token, "
                  f"{state['decode_fetch_hidden_fraction']:.0%} of the copy time hidden")
        print(f"\n{NOT_BUILT_YET}")
    print("server stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
