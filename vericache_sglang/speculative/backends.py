"""The tiers and attention backends a VeriCache worker runs its forwards through, wired once
the target's KV pools exist, and the device memory they hold.

Drafting reads the compressed tier (a page pool for prefix-stable compressors, else
request-owned blocks); verification and every other forward over the full KV read SGLang's
pool, or, with the full KV in host memory, the staging area the staged backend fills.

Verification runs through the server's own attention backend where that backend verifies a
chain of any width in place (SGLang's Triton, FlashInfer and FA3 backends, the ones its EAGLE and
NGRAM workers verify with; FA3 through the verify input's per-request layout), else through
`VerifyAttnBackend`, torch_native's extension (the CPU backends have no TARGET_VERIFY path).
"""

from __future__ import annotations

import logging
from typing import Any

from vericache_sglang.attention.draft import DraftAttnBackend
from vericache_sglang.attention.features import describe
from vericache_sglang.attention.full_tier import StagedFullKVAttnBackend
from vericache_sglang.attention.verify import VerifyAttnBackend
from vericache_sglang.compress import Compressor
from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.config import get_config
from vericache_sglang.stores.state import StoreState
from vericache_sglang.tiers.budget import DevicePlan, device_plan
from vericache_sglang.tiers.compressed import CompressedTier
from vericache_sglang.tiers.compressed_pool import CompressedPagePool, follow_frees, pool_pages
from vericache_sglang.tiers.staging import StagingArea

logger = logging.getLogger(__name__)

NATIVE_VERIFY_BACKENDS = ("triton", "flashinfer", "fa3")
"""SGLang decode attention backends whose TARGET_VERIFY forward reads a chain of
`spec_info.draft_token_num` tokens per request (FA3: `spec_info.ragged_verify_layout`),
causally, from the KV pool by index."""


def verifies_natively(decode_backend: str | None, placement: str) -> bool:
    """Whether verification runs through the server's attention backend: it must verify a
    chain natively, and the full KV must be in SGLang's device pool (with the host tier it is
    in staging slots only the staged backend maps)."""
    return placement == "device" and decode_backend in NATIVE_VERIFY_BACKENDS


class RoundBackends:
    """The compressed tier, the staging area and the backends of draft and verify forwards."""

    def __init__(self, runner, server_args, compressor: Compressor, placement: str,
                 store_state: StoreState) -> None:
        self.runner = runner
        self.compressor = compressor
        self.placement = placement
        self.plan: DevicePlan | None = device_plan(server_args)
        self.staging: StagingArea | None = None
        if placement == "host":
            if self.plan is None:
                raise RuntimeError("VeriCache: the device budget was not planned")
            self.staging = StagingArea(runner.token_to_kv_pool,
                                       unit_tokens=self.plan.staging_unit_tokens,
                                       depth=self.plan.staging_units, device=runner.device)
        self.tier = CompressedTier(compressor)
        self.pool: CompressedPagePool | None = None
        if compressor.prefix_stable:
            pages = (self.plan.compressed_pool_pages if self.plan is not None
                     else pool_pages(compressor, runner.max_total_num_tokens))
            self.pool = CompressedPagePool(compressor, runner.token_to_kv_pool, num_pages=pages,
                                           windowed_layers=describe(runner.model).windowed)
            self.pool.follow(runner.token_to_kv_pool_allocator)
            if get_config(server_args).vericache_early_drafting:
                # A page waiting for its exact KV is never written where SGLang freed it.
                follow_frees(runner.token_to_kv_pool_allocator, store_state.pending.released,
                             store_state.pending.clear)
            if self.staging is not None:
                self.pool.on_read = self.staging.record_direct
        store_state.reloaded.accept(self.pool)  # a reloaded prefix's pages, decoded by the store
        self.draft = DraftAttnBackend(runner, self.tier, self.pool, self.staging)
        # A prefill drafting over a stored prefix between other requests' rounds keeps its
        # scratch tail across them (speculative/parking.py): a backend of its own.
        self.early_draft = (DraftAttnBackend(runner, self.tier, self.pool, self.staging)
                            if get_config(server_args).vericache_early_drafting else None)
        # With the full KV in host memory: the backend of every forward over the full KV
        # (prefill, verification, plain decode).
        self.full: StagedFullKVAttnBackend | None = None
        decode_backend = getattr(runner, "decode_attention_backend_str", None)
        if self.staging is not None:
            observer = self.draft.observe_prompt if compressor.needs_scores else None
            self.full = StagedFullKVAttnBackend(runner, self.staging, observer,
                                                triton_verify=decode_backend == "triton")
            self.verify = self.full
        elif verifies_natively(decode_backend, placement):
            self.verify = runner.attn_backend
        else:
            self.verify = VerifyAttnBackend(runner)
        logger.info("VeriCache verification: %s", self.verify_kernel)

    @property
    def verify_kernel(self) -> str:
        """The backend verification runs through, and its kernel where that differs."""
        name = type(self.verify).__name__
        if self.full is not None and self.full.triton_verify:
            return f"{name} (SGLang's Triton extend kernel)"
        return name

    def reset_tier(self) -> None:
        """Drop every request-owned block (a cache flush)."""
        self.tier = CompressedTier(self.compressor)
        for backend in (self.draft, self.early_draft):
            if backend is not None:
                backend.tier = self.tier

    @property
    def compressed_pages(self) -> int:
        """Pool pages compressed so far."""
        return 0 if self.pool is None else self.pool.compressed_pages

    @property
    def pages_used(self) -> int:
        return 0 if self.pool is None else self.pool.used_pages

    def memory_report(self) -> dict[str, Any]:
        """Where each form of the KV lives and what it takes, measured from tensor storages:
        for the startup log and `/server_info`."""
        full_pool = self.runner.token_to_kv_pool
        full_bytes = storage_bytes([*full_pool.k_buffer, *full_pool.v_buffer])
        tokens = self.runner.max_total_num_tokens
        report: dict[str, Any] = {
            "full_tier": self.placement,
            "verify_backend": self.verify_kernel,
            "full_kv_pool_bytes": full_bytes,
            "full_kv_pool_tokens": tokens,
            "full_kv_bytes_per_token": full_bytes / (tokens + 1),  # SGLang pads one slot
        }
        if self.plan is not None:
            report["device_budget_bytes"] = self.plan.device_budget_bytes
            report["max_running_requests"] = self.runner.req_to_token_pool.size
        if self.staging is not None:
            report.update({
                "staging_bytes": self.staging.allocated_bytes(),
                "staging_units": self.staging.depth,
                "staging_unit_tokens": self.staging.unit_tokens,
                "window_reserve_bytes": self.plan.window_bytes,
            })
        if self.pool is not None:
            pool_bytes = self.pool.allocated_bytes()
            report.update({
                "compressed_pool_bytes": pool_bytes,
                "compressed_pool_pages": self.pool.num_pages,
                "compressed_page_tokens": self.pool.group,
                "compressed_bytes_per_token": pool_bytes / (self.pool.num_pages
                                                            * self.pool.group),
                # Sliding-window layers, read exactly within their window: no pages.
                "compressed_pool_windowed_layers": sorted(self.pool.windowed_layers),
            })
        return report

    def held_bytes(self) -> int:
        """Bytes the compressed KV holds on the device now: the pool's used pages, the
        request-owned blocks and the current round's buffers."""
        pool = 0 if self.pool is None else self.pool.held_bytes()
        early = 0 if self.early_draft is None else self.early_draft.round_buffer_bytes()
        return pool + self.tier.nbytes() + self.draft.round_buffer_bytes() + early

    def device_bytes(self, peak_round_bytes: int, stash_bytes: int) -> dict[str, int]:
        """Device bytes VeriCache allocated, measured from storages: the compressed pool (all
        its pages), the staging area, the largest round buffers seen (drafting windows
        and tails, the verify chain), and the q of sampled early drafts still stashed; with
        host placement their sum stays within the budget."""
        report = {
            "compressed_pool": 0 if self.pool is None else self.pool.allocated_bytes(),
            "staging": 0 if self.staging is None else self.staging.allocated_bytes(),
            "peak_round_buffers": peak_round_bytes,
            "request_blocks": self.tier.nbytes(),
            "early_draft_stash": stash_bytes,
        }
        report["total"] = sum(report.values())
        return report
