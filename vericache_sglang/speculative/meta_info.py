"""Per-request VeriCache figures in a response's `meta_info`, through SGLang's customized-info
channel (`Req.customized_info`, forwarded by the scheduler's output streamer).

That channel slices a value per emitted token unless the streamer calls its key request-level;
a figure about the whole request is declared so here, and is then sent once, when the request
finishes, as a one-element list (SGLang accumulates customized values into lists).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from vericache_sglang.integration.hooks import hook

READ_BYTES_KEY = "vericache_full_tier_read_bytes"
"""Full-KV bytes read from the host tier for the request: its prefix rows staged for its
prefill, verification and plain decode forwards, and its drafting windows."""

DRAFT_FORWARDS_KEY = "vericache_draft_forwards"
"""Level-1 forwards (the target over the compressed tier) the request took part in."""
DRAFTER_PROPOSED_KEY = "vericache_drafter_proposed"
"""Tokens the level-2 drafter proposed for the request (with --vericache-drafter)."""
DRAFTER_KEPT_KEY = "vericache_drafter_kept"
"""Of those, the tokens level 1 kept as drafts."""

EARLY_DRAFTS_KEY = "vericache_early_drafts"
"""Tokens drafted for the request before its stored prefix's exact KV had arrived
(`--vericache-early-drafting`)."""

REQUEST_LEVEL_KEYS = frozenset({READ_BYTES_KEY, DRAFT_FORWARDS_KEY, DRAFTER_PROPOSED_KEY,
                                DRAFTER_KEPT_KEY, EARLY_DRAFTS_KEY})
TARGET = ("sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
          ".is_request_level_customized_info_key")


def _request_level(original, streamer, key: str) -> bool:
    return key in REQUEST_LEVEL_KEYS or original(streamer, key)


def register() -> None:
    hook(TARGET, _request_level, HookType.AROUND)
