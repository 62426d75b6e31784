"""`VERICACHE` as an SGLang speculative algorithm, and the server settings it needs.

`register()` adds the algorithm to SGLang's registry (every process that resolves server
arguments or builds the scheduler must call it; the plugin entry point runs in each of them).
`configure(server_args)` switches a not-yet-resolved record over to it when VeriCache is
enabled: the algorithm, the overlap scheduler off, and the draft-width fields SGLang sizes its
per-request KV reservation from (verify width = longest draft + 1 root token).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec

logger = logging.getLogger(__name__)

ALGORITHM = "VERICACHE"


def get_config(server_args: Any):
    """The record's VeriCache settings (imported late: the plugin module imports this one)."""
    from vericache_sglang.plugin import get_config as plugin_config

    return plugin_config(server_args)


class VeriCacheSpecAlgo(CustomSpecAlgo):
    """SGLang's view of VERICACHE: a chain drafter that shares the target's KV pool.

    Also provides the `SpeculativeAlgorithm` methods SGLang 0.5.23's scheduler calls on any
    algorithm but `CustomSpecAlgo` lacks.
    """

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

    def handle_server_args(self, server_args: Any) -> None:
        """Fill the speculative fields VERICACHE needs that the user left unset."""
        config = get_config(server_args)
        longest = config.vericache_max_draft_length
        if server_args.speculative_num_draft_tokens is None:
            server_args.speculative_num_draft_tokens = longest + 1
        if server_args.speculative_num_steps is None:
            server_args.speculative_num_steps = longest
        if server_args.speculative_eagle_topk is None:
            server_args.speculative_eagle_topk = 1
        server_args.enable_mixed_chunk = False


def _worker_class(server_args: Any) -> type:
    from vericache_sglang.spec.worker import VeriCacheWorker

    return VeriCacheWorker


def register() -> None:
    """Register VERICACHE with SGLang (idempotent)."""
    if get_spec(ALGORITHM) is None:
        SpeculativeAlgorithm.register(
            ALGORITHM, supports_overlap=False, spec_class=VeriCacheSpecAlgo
        )(_worker_class)


def configure(server_args: Any) -> None:
    """Point an unresolved ServerArgs record with VeriCache enabled at VERICACHE."""
    config = get_config(server_args)
    if not config.enable_vericache:
        return
    if server_args.speculative_algorithm not in (None, ALGORITHM):
        raise SystemExit(
            "vericache: error: --enable-vericache replaces speculative decoding; do not also "
            f"pass --speculative-algorithm {server_args.speculative_algorithm}"
        )
    longest = config.vericache_max_draft_length
    server_args.speculative_algorithm = ALGORITHM
    server_args.speculative_num_draft_tokens = longest + 1
    server_args.speculative_num_steps = longest
    server_args.speculative_eagle_topk = 1
    server_args.disable_overlap_schedule = True
    server_args.enable_mixed_chunk = False
