"""Per-request VeriCache figures in a response's `meta_info`, through SGLang's customized-info
channel (`Req.customized_info`, forwarded by the scheduler's output streamer).

That channel slices a value per emitted token unless the streamer calls its key request-level;
a figure about the whole request is declared so here, and is then sent once, when the request
finishes, as a one-element list (SGLang accumulates customized values into lists).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

READ_BYTES_KEY = "vericache_full_tier_read_bytes"
"""Full-KV bytes read from the host tier for the request: its prefix rows staged for its
prefill, verification and plain decode forwards, and its drafting windows."""

REQUEST_LEVEL_KEYS = frozenset({READ_BYTES_KEY})
TARGET = ("sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
          ".is_request_level_customized_info_key")


def _request_level(original, streamer, key: str) -> bool:
    return key in REQUEST_LEVEL_KEYS or original(streamer, key)


def register() -> None:
    HookRegistry.register(TARGET, _request_level, HookType.AROUND)
