"""`VERICACHE` as an SGLang speculative algorithm, and the server settings it needs.

`register()` adds the algorithm through SGLang's public `SpeculativeAlgorithm.register` (every
process that resolves server arguments or builds the scheduler must call it; the plugin entry
point runs in each of them). `configure(server_args)` checks a not-yet-resolved record with
VeriCache enabled and switches it over to the algorithm (and, on CUDA, picks the sampling
backend, which SGLang resolves before any speculative hook). The settings the algorithm implies
(the overlap scheduler off, the draft-width fields SGLang sizes its per-request KV reservation
from: verify width = longest draft + 1 root token, the decode log interval) are SGLang's own
seam: `VeriCacheSpecAlgo.handle_server_args`, which SGLang's resolution runs and declares as
this algorithm's (`record_foreign_defaults`).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.plugins.hook_registry import HookType
from sglang.srt.runtime_context import get_platform
from sglang.srt.speculative.spec_info import CustomSpecAlgo, SpeculativeAlgorithm

from vericache_sglang import startup
from vericache_sglang.config import get_config
from vericache_sglang.integration.hooks import hook
from vericache_sglang.speculative import parking, settle
from vericache_sglang.speculative.drafter import check_draft_model

logger = logging.getLogger(__name__)

ALGORITHM = "VERICACHE"


class VeriCacheSpecAlgo(CustomSpecAlgo):
    """SGLang's view of VERICACHE: a chain drafter that shares the target's KV pool.

    Also provides the `SpeculativeAlgorithm` methods SGLang 0.5.23's scheduler calls on any
    algorithm but `CustomSpecAlgo` lacks.
    """

    def handle_server_args(self, server_args: Any) -> None:
        """The SGLang settings VERICACHE implies. SGLang calls this while resolving the
        arguments (`handle_speculative_decoding`) on a recorder, and declares every write as
        this algorithm's resolution."""
        longest = get_config(server_args).vericache_max_draft_length
        server_args.speculative_num_draft_tokens = longest + 1
        server_args.speculative_num_steps = longest
        server_args.speculative_eagle_topk = 1
        server_args.disable_overlap_schedule = True
        if server_args.decode_log_interval == DEFAULT_DECODE_LOG_INTERVAL:
            # SGLang takes decode stats (its log line and gauges such as
            # sglang:num_running_reqs) every that many decode forwards, counted from the last
            # /flush_cache. A VeriCache forward emits a round of ~20 tokens, so at 40 a request
            # could run and finish with the gauges never set; every forward is about as often,
            # in tokens, as plain's 40.
            server_args.decode_log_interval = 1

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def get_platform_worker_cls(self) -> None:
        return None

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens,
                         needs_confidence_relay)


def _worker_class(server_args: Any) -> type:
    from vericache_sglang.speculative.worker import VeriCacheWorker

    return VeriCacheWorker


def _registered() -> bool:
    try:
        SpeculativeAlgorithm.from_string(ALGORITHM)
    except ValueError:
        return False
    return True


ROW_HEADROOM_TARGET = ("sglang.srt.mem_cache.allocation_sizing."
                       "get_req_to_token_extra_context_len")
"""How far past the context length a request's row of slot indices reaches."""


def _row_holds_the_decode_reserve(original) -> int:
    """AROUND `ROW_HEADROOM_TARGET`: every decode step SGLang reserves twice the verify width
    of KV slots past a request's committed length and writes them into its row. The row reaches
    only one verify width + 4 past the context length (SGLang widens it to the reserve for its
    own UNO algorithm only), so a request within a verify width of the context length overran
    its row and the step crashed. Widen it for VERICACHE too."""
    from sglang.srt.mem_cache.allocation_sizing import (
        get_alloc_page_size,
        get_alloc_reserve_per_decode,
    )
    from sglang.srt.runtime_context import get_spec

    extra = original()
    if get_spec().speculative_algorithm == ALGORITHM:
        extra = max(extra, get_alloc_reserve_per_decode() + get_alloc_page_size() - 1)
    return extra


def register() -> None:
    """Register VERICACHE with SGLang (idempotent), and widen its requests' slot rows."""
    if not _registered():
        SpeculativeAlgorithm.register(
            ALGORITHM, supports_overlap=False, spec_class=VeriCacheSpecAlgo
        )(_worker_class)
        hook(ROW_HEADROOM_TARGET, _row_holds_the_decode_reserve, HookType.AROUND)
        settle.register()
        parking.register()


def configure(server_args: Any) -> None:
    """Point an unresolved ServerArgs record with VeriCache enabled at VERICACHE."""
    config = get_config(server_args)
    if not config.enable_vericache:
        return
    if server_args.speculative_algorithm not in (None, ALGORITHM):
        raise startup.error(
            "--enable-vericache replaces speculative decoding; do not also "
            f"pass --speculative-algorithm {server_args.speculative_algorithm}"
        )
    if server_args.speculative_algorithm == ALGORITHM:
        return  # configured already
    _refuse_what_vericache_sets(server_args)
    if config.vericache_draft_model is not None:
        try:
            check_draft_model(config.vericache_draft_model,
                              server_args.tokenizer_path or server_args.model_path)
        except ValueError as e:
            raise startup.error(f"--vericache-draft-model: {e}") from None
    longest = config.vericache_max_draft_length
    if server_args.context_length is not None and longest + 1 >= server_args.context_length:
        raise startup.error(
            f"--vericache-max-draft-length {longest} leaves no room in --context-length "
            f"{server_args.context_length}: a round needs that many + 1 positions")
    server_args.speculative_algorithm = ALGORITHM  # handle_server_args sets the rest
    if server_args.sampling_backend is None and get_platform().has_flashinfer:
        # SGLang's default on CUDA is flashinfer, whose fused top-k/top-p/min-p kernels a
        # round does not reproduce: under it those requests take plain steps. (Here, not in
        # handle_server_args: SGLang resolves this default before the speculative hook.)
        server_args.sampling_backend = "pytorch"
        logger.info("VeriCache: --sampling-backend pytorch, so that top-k, top-p and min-p "
                    "requests draft too (pass --sampling-backend flashinfer to keep SGLang's "
                    "default; those requests then take plain decode steps)")


DEFAULT_DECODE_LOG_INTERVAL = 40
"""SGLang's default --decode-log-interval."""

SET_BY_VERICACHE = {
    "speculative_num_draft_tokens": "the draft length comes from --vericache-draft-length and "
    "its bounds",
    "speculative_num_steps": "the draft length comes from --vericache-draft-length and its bounds",
    "speculative_eagle_topk": "VeriCache drafts one chain per request",
    "enable_mixed_chunk": "VeriCache runs prefill and decode in separate batches",
}
"""SGLang arguments VERICACHE decides (`VeriCacheSpecAlgo.handle_server_args` sets the draft
fields; mixed chunking stays off), with why a user's value could not be honoured."""

QUANTIZED_KV_DTYPES = ("fp8", "mxfp8", "nvfp4", "fp4")

GRAMMAR_BACKENDS_WITHOUT_ROLLBACK = ("outlines",)
"""SGLang grammar backends whose grammar objects lack `rollback`: a round advances a request's
grammar over its drafts and must undo that (`grammar.py`)."""


def _refuse_what_vericache_sets(server_args: Any) -> None:
    """One line for a user's value VeriCache would otherwise override without a word."""
    for name, why in SET_BY_VERICACHE.items():
        if getattr(server_args, name) not in (None, False):
            flag = "--" + name.replace("_", "-")
            raise startup.error(f"{flag} cannot be combined with --enable-vericache: {why}")
    if str(server_args.kv_cache_dtype).startswith(QUANTIZED_KV_DTYPES):
        raise startup.error(
            f"--kv-cache-dtype {server_args.kv_cache_dtype} with --enable-vericache is not "
            "supported yet: the full KV verification reads is the model's own precision "
            "(use --kv-cache-dtype auto; the compressed tier is VeriCache's quantized form)")
    for flag, size in (("--tp-size", server_args.tp_size), ("--pp-size", server_args.pp_size)):
        if size > 1:
            raise startup.error(
                f"{flag} {size} with --enable-vericache is not supported yet: the compressed "
                "pool, the drafting rounds and the stores run on one device (serve with "
                f"{flag} 1)")
    if server_args.grammar_backend in GRAMMAR_BACKENDS_WITHOUT_ROLLBACK:
        raise startup.error(
            f"--grammar-backend {server_args.grammar_backend} cannot be combined with "
            "--enable-vericache: its grammars cannot roll back a rejected draft "
            "(use xgrammar, the default, or llguidance)")
    if not server_args.disable_overlap_schedule:
        logger.info("VeriCache runs without SGLang's overlap scheduler: a round starts from the "
                    "tokens the previous round verified")
