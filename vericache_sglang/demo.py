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
from vericache_sglang.prompts import stdlib_source
from vericache_sglang.server_process import ServerProcess

NOT_BUILT_YET = (
    "Not built yet: a remote full tier, "
    "the pinned host pool and copy stream of the host tier on a GPU, drafting for requests "
    "with penalties or returned logprobs (they decode one plain step at a time), and the "
    "overlap scheduler."
)


def vericache_stats(meta: dict) -> dict:
    """Per-request drafting statistics from SGLang's speculative counters in meta_info."""
    rounds = meta.get("spec_verify_ct", 0)
    if not rounds:
        return {}
    accepted = meta.get("spec_num_correct_drafts", 0)
    return {
        "verification_rounds": rounds,
        "drafted_tokens": round(meta.get("spec_cap_length", 0) * rounds),
        "accepted_tokens": accepted,
        "tokens_per_round": round((meta["completion_tokens"] - 1) / rounds, 2),
    }


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
    parser.add_argument("--dtype", default=None,
                        help="--dtype for the server (default: float32 without a GPU, where "
                        "bf16 matmuls are emulated and slower; else the model's)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--context-chars", type=int, default=9000,
                        help="characters of textwrap.py used as the long prompt")
    args = parser.parse_args(argv)

    model = models.prepare().target
    print(f"model: {model}")
    dtype = args.dtype or ("auto" if nvidia_gpu_present() else "float32")
    server = ServerProcess(model, [
        "--dtype", dtype,
        "--enable-vericache",
        "--vericache-compressor", args.compressor,
        "--vericache-draft-length", str(args.draft_length),
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
        print("VeriCache statistics:", vericache_stats(meta) or "none (no verification round ran)")
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
