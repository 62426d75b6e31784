"""What the server benchmarks share: the arguments their servers start with, the requests they
send, and how their outputs are compared with plain SGLang's. Servers themselves start and stop
through `vericache_tools.server_process.ServerProcess` (127.0.0.1, stopped by PID)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vericache_tools.server_args import server_args
from vericache_tools.server_process import ServerProcess, ServerStartError

COMMON = server_args()
"""What every benchmark server starts with (`vericache_tools.server_args`)."""
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    """The model's full KV per token (all layers, K and V) at `dtype`, from its config.json."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2
            * DTYPE_BYTES[dtype])


def request(ids: list[int], new_tokens: int, extra: dict | None = None, *,
            ignore_eos: bool = True, **params) -> dict:
    """A /generate payload: greedy unless `params` say otherwise, `extra` beside the sampling
    parameters (logprobs, a custom logit processor)."""
    sampling = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": ignore_eos,
                **params}
    return {"input_ids": ids, "sampling_params": sampling, **(extra or {})}


def send_together(server: ServerProcess, payloads: list[dict]) -> list[dict]:
    """Every payload sent at once (one batch on the server), answers in payload order."""
    with ThreadPoolExecutor(len(payloads)) as pool:
        return list(pool.map(lambda p: server.generate(p, timeout=3600), payloads))


def chat_ids(tokenizer, text: str, system: str | None = None) -> list[int]:
    """A one-turn chat prompt in the model's template, ready for the answer."""
    turns = [{"role": "system", "content": system}] if system else []
    return tokenizer.apply_chat_template([*turns, {"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def first_difference(output: list[int], reference: list[int]) -> int:
    """How many leading tokens equal the reference's (the length of both if all do)."""
    for i, (a, b) in enumerate(zip(output, reference, strict=False)):
        if a != b:
            return i
    return min(len(output), len(reference))


def start_failure(error: ServerStartError) -> str:
    """One line saying why a server did not start (its log's last error line)."""
    errors = [line for line in str(error).splitlines() if "Error" in line]
    reason = (errors or str(error).strip().splitlines())[-1].strip()
    return f"does not start here: {reason[:160]}"


def vericache_figures(info: dict) -> dict | None:
    """From /server_info: VeriCache's device bytes per context token the budget holds, full-tier
    bytes read per emitted token, the share of fetch time hidden, and E (None: not VeriCache)."""
    states = [s.get("vericache_state") for s in info.get("internal_states", [])]
    if not states or not states[0]:
        return None
    state = states[0]
    return {"device_bytes_per_token": state["device_budget_bytes"] / info["max_total_num_tokens"],
            "read_per_token": state["decode_read_bytes_per_emitted_token"],
            "hidden": state["decode_fetch_hidden_fraction"],
            "device_bytes": state["device_bytes"]["total"],
            "budget": state["device_budget_bytes"],
            "E": state["totals"]["emitted_tokens"] / max(state["totals"]["verify_rounds"], 1)}
