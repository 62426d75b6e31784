"""The VeriCache speculative worker: draft on the compressed tier, verify over the full KV.

One decode round for a request with committed KV length L and last emitted token t0 (whose KV
is not written yet):

1. Draft: k one-token forwards of the target model itself through `DraftAttnBackend`, which
   reads the committed prefix from the compressed tier and the round's own drafts exactly from
   a scratch tail. Greedy: d1..dk. Sampled requests draw d_j from the draft distribution q_j
   (`sampling.py`). Nothing is written to the KV pool.
2. Verify: one TARGET_VERIFY forward of [t0, d1..dk] at positions L..L+k over the full KV
   (`VerifyAttnBackend`), writing their K/V into the slots SGLang reserved beyond L.
3. Accept the longest prefix d1..da equal to the full model's argmax, plus the full model's
   next token (the bonus): a + 1 tokens are emitted, L grows by a + 1, and the bonus is the
   next round's t0. The emitted tokens are exactly the full model's greedy tokens. Slots
   past the new committed length stay reserved but unreferenced; the next round rewrites them.
   Sampled requests are verified by speculative rejection sampling instead (`sampling.py`):
   their emitted tokens follow exactly the distribution plain SGLang samples from.

With a level-2 drafter (`--vericache-drafter`, `drafter.py`), step 1 makes k drafts with
fewer forwards: the drafter proposes a few tokens, one forward of the target over the
compressed tier checks [last draft, proposals], keeps a prefix of the proposals and adds a
token of its own, until the draft has k tokens. Greedy and seeded drafts are exactly those
one-token steps make; sampled drafts follow the same q (`sampling.check_proposal`), so
verification and output are unchanged; only the forwards differ. Requests with a grammar
check proposals under the masks of each position (`grammar.py`).

A request with a grammar drafts and verifies under the same vocab masks (`grammar.py`), one
with penalties or logit bias under the penalty state of each chain position (`penalties.py`),
and returned logprobs come from the verify logits (`logprobs.py`). Requests a round cannot
serve (custom logit processors, some samplers; `eligibility.py`) take one plain step inside
it: SGLang's sampler chooses their token from the verify logits of chain position 0, so their
batch-mates still draft. Prefill runs the target model as usual.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.environ import envs
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.runtime_context import get_exec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from vericache_sglang.attention.draft import DraftAttnBackend
from vericache_sglang.attention.full_tier import StagedFullKVAttnBackend
from vericache_sglang.attention.verify import VerifyAttnBackend
from vericache_sglang.compress import parse_compressor_spec
from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.config import get_config
from vericache_sglang.cpu.few_rows import faster_row_counts, few_row_linear
from vericache_sglang.metrics import RoundCounts, VeriCacheMetrics
from vericache_sglang.speculative.drafter import build_drafter
from vericache_sglang.speculative.eligibility import drafting_rows
from vericache_sglang.speculative.grammar import RoundGrammar
from vericache_sglang.speculative.info import VeriCacheDraftInput, VeriCacheVerifyInput
from vericache_sglang.speculative.logprobs import chain_logprobs, take_first_positions
from vericache_sglang.speculative.meta_info import (
    DRAFT_FORWARDS_KEY,
    DRAFTER_KEPT_KEY,
    DRAFTER_PROPOSED_KEY,
    READ_BYTES_KEY,
)
from vericache_sglang.speculative.penalties import PenaltyStates, RoundPenalties
from vericache_sglang.speculative.policy import DraftLengthPolicy
from vericache_sglang.speculative.sampling import (
    SamplingRows,
    check_proposal,
    draft_tokens,
    verify_tokens,
)
from vericache_sglang.stores.pages import STORE_STATS
from vericache_sglang.tiers.budget import DevicePlan, device_plan
from vericache_sglang.tiers.compressed import CompressedTier
from vericache_sglang.tiers.compressed_pool import CompressedPagePool, pool_pages
from vericache_sglang.tiers.staging import FetchStats, StagingArea

logger = logging.getLogger(__name__)


@dataclass
class _Round:
    """One decode round of a batch, from planning to acceptance."""

    k: int
    """Draft length of the batch."""
    room: list[int]
    """New tokens each request may still emit."""
    committed: torch.Tensor
    """[bs] committed KV length (the bonus token's position)."""
    committed_cpu: torch.Tensor
    positions: torch.Tensor
    """[bs, k + 1] positions of the chain t0, d1..dk."""
    locs: torch.Tensor
    """[bs, k + 1] full-pool slots the chain's K/V go to when verified."""
    tokens: list[torch.Tensor]
    """t0 (the last emitted token), then each drafted token [bs]."""
    grammar: RoundGrammar | None
    penalties: RoundPenalties | None
    rows: SamplingRows
    drafts: list[bool]
    """Requests whose drafts are offered to verification; the others take one plain step
    (`eligibility.py`): their drafts are made but never offered."""
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)
    """q of each draft step, for the requests that sample."""
    round_buffer_bytes: int = 0
    """Bytes of the drafting buffers at the round's last step."""
    forwards: list[int] = field(default_factory=list)
    """Level-1 (compressed-tier) forwards each request took part in."""
    proposed: list[int] = field(default_factory=list)
    """Tokens the level-2 drafter proposed for each request."""
    kept: list[int] = field(default_factory=list)
    """Of those, the tokens level 1 kept as drafts."""

    def chain(self) -> torch.Tensor:
        """[bs, k + 1]: t0, d1..dk."""
        return torch.stack(self.tokens, dim=1)


class VeriCacheWorker(BaseSpecWorker):
    """Lossless decoding over a compressed KV tier (see the module docstring)."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker, **_: Any):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = target_worker.device
        config = get_config(server_args)
        self.compressor = parse_compressor_spec(config.vericache_compressor)
        self.policy = DraftLengthPolicy(
            initial=config.vericache_draft_length,
            minimum=config.vericache_min_draft_length,
            maximum=config.vericache_max_draft_length,
            adaptive=config.vericache_min_draft_length < config.vericache_max_draft_length,
        )
        self.max_draft_length = config.vericache_max_draft_length
        self.penalty_states = PenaltyStates(self.model_runner.model_config.vocab_size,
                                            self.device)
        # Level 2: a cheaper proposer under the compressed-KV drafter, with its own lengths.
        embedding = getattr(self.model_runner.model, "get_input_embeddings", None)
        self.drafter = build_drafter(
            config.vericache_drafter, config.vericache_drafter_max_length,
            model_path=config.vericache_draft_model, device=self.device,
            dtype=self.model_runner.dtype,
            target_embedding=embedding().weight if embedding is not None else None)
        self.drafter_policy = DraftLengthPolicy(
            initial=config.vericache_drafter_max_length,
            minimum=config.vericache_drafter_min_length,
            maximum=config.vericache_drafter_max_length,
            adaptive=config.vericache_drafter_min_length < config.vericache_drafter_max_length,
        )
        # Compatibility fields read by SGLang's speculative infrastructure.
        self.speculative_num_draft_tokens = self.max_draft_length + 1
        self.speculative_num_steps = self.max_draft_length
        self.topk = 1
        # Built in init_attention_backends(), once the target's KV pools exist.
        self.tier: CompressedTier | None = None
        self.pool: CompressedPagePool | None = None
        self.draft_backend: DraftAttnBackend | None = None
        self.verify_backend: VerifyAttnBackend | None = None
        # With the full KV in host memory: the staging area and the backend of every forward
        # over the full KV (prefill, verification, plain decode).
        self.placement = config.vericache_full_tier
        self.plan: DevicePlan | None = None
        self.staging: StagingArea | None = None
        self.full_backend: StagedFullKVAttnBackend | None = None
        # Full-tier reads of prefill forwards, and of decoding (drafting windows, pages being
        # compressed, verification).
        self.fetched = {"prefill": FetchStats(), "decode": FetchStats()}
        self.peak_round_bytes = 0
        self.peak_running_requests = 0
        self._owners: dict[int, str] = {}  # request slot -> rid whose blocks the tier holds
        # Cumulative over all requests, for the logs (per-request figures go to meta_info),
        # and as Prometheus counters with --enable-metrics.
        self.totals = RoundCounts()
        self._pages_reported = 0  # pool pages compressed that /metrics already counts
        self._settling: list[bool] = []  # per request of the last step: a verified round
        self.metrics = (VeriCacheMetrics(server_args.served_model_name or server_args.model_path)
                        if server_args.enable_metrics else None)
        if torch.device(self.device).type == "cpu":
            # Timed now, not in the first request's drafting forward (cpu/few_rows.py).
            logger.info("VeriCache worker: W @ X^T GEMM form in drafting forwards of %s rows",
                        sorted(faster_row_counts()) or "no")
        logger.info("VeriCache worker: compressor %s, draft length %d (%d..%d), drafter %s",
                    self.compressor.spec(), self.policy.initial, self.policy.minimum,
                    self.policy.maximum,
                    config.vericache_draft_model or config.vericache_drafter)

    # -- SGLang worker interface ---------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Scheduler-facing methods this wrapper lacks belong to the target worker.
        if name == "_target_worker":
            raise AttributeError(name)
        return getattr(self._target_worker, name)

    @property
    def draft_worker(self) -> None:
        # Drafting runs the target model itself; there is no draft model.
        return None

    def init_attention_backends(self) -> None:
        runner = self.model_runner
        self.plan = device_plan(self.server_args)
        if self.placement == "host":
            if self.plan is None:
                raise RuntimeError("VeriCache: the device budget was not planned")
            self.staging = StagingArea(runner.token_to_kv_pool,
                                       unit_tokens=self.plan.staging_unit_tokens,
                                       depth=self.plan.staging_units, device=runner.device)
        self.tier = CompressedTier(self.compressor)
        if self.compressor.prefix_stable:
            pages = (self.plan.compressed_pool_pages if self.plan is not None
                     else pool_pages(self.compressor, runner.max_total_num_tokens))
            self.pool = CompressedPagePool(self.compressor, runner.token_to_kv_pool,
                                           num_pages=pages)
            self.pool.follow(runner.token_to_kv_pool_allocator)
            if self.staging is not None:
                self.pool.on_read = self.staging.record_direct
        self.draft_backend = DraftAttnBackend(runner, self.tier, self.pool, self.staging)
        if self.staging is not None:
            observer = (self.draft_backend.observe_prompt if self.compressor.needs_scores
                        else None)
            self.full_backend = StagedFullKVAttnBackend(runner, self.staging, observer)
            self.verify_backend = self.full_backend
        else:
            self.verify_backend = VerifyAttnBackend(runner)
        logger.info("VeriCache memory: %s", self.memory_report())

    def memory_report(self) -> dict[str, Any]:
        """Where each form of the KV lives and what it takes, measured from tensor storages:
        for the startup log and `/server_info`."""
        full_pool = self.model_runner.token_to_kv_pool
        full_bytes = storage_bytes([*full_pool.k_buffer, *full_pool.v_buffer])
        tokens = self.model_runner.max_total_num_tokens
        report: dict[str, Any] = {
            "full_tier": self.placement,
            "full_kv_pool_bytes": full_bytes,
            "full_kv_pool_tokens": tokens,
            "full_kv_bytes_per_token": full_bytes / (tokens + 1),  # SGLang pads one slot
        }
        if self.plan is not None:
            report["device_budget_bytes"] = self.plan.device_budget_bytes
            report["max_running_requests"] = self.model_runner.req_to_token_pool.size
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
            })
        return report

    def held_bytes(self) -> int:
        """Bytes the compressed KV holds on the device now: the pool's used pages, the
        request-owned blocks and the current round's buffers."""
        pool = 0 if self.pool is None else self.pool.held_bytes()
        return pool + self.tier.nbytes() + self.draft_backend.round_buffer_bytes()

    def device_bytes(self) -> dict[str, int]:
        """Device bytes VeriCache allocated, measured from storages: the compressed pool (all
        its pages), the staging area, and the largest round buffers seen (drafting windows
        and tails, the verify chain); with host placement their sum stays within the budget."""
        report = {
            "compressed_pool": 0 if self.pool is None else self.pool.allocated_bytes(),
            "staging": 0 if self.staging is None else self.staging.allocated_bytes(),
            "peak_round_buffers": self.peak_round_bytes,
            "request_blocks": self.tier.nbytes(),
        }
        report["total"] = sum(report.values())
        return report

    def live_report(self) -> dict[str, Any]:
        """VeriCache's running state for `/server_info` (`internal_states`)."""
        allocator = self.model_runner.token_to_kv_pool_allocator
        decode = self.fetched["decode"]
        emitted = self.totals.emitted_tokens + self.totals.plain_decode_steps
        store = STORE_STATS.snapshot()
        return {
            "full_tier": self.placement,
            "device_bytes": self.device_bytes(),
            "device_budget_bytes": None if self.plan is None else self.plan.device_budget_bytes,
            # A draft model's weights (less what it shares with the target) and its own KV:
            # outside the KV budget, as the target's weights are.
            "drafter_device_bytes": 0 if self.drafter is None else self.drafter.device_bytes(),
            "full_kv_tokens_used": self.model_runner.max_total_num_tokens
            - allocator.available_size(),
            "compressed_pool_pages_used": 0 if self.pool is None else self.pool.used_pages,
            "peak_running_requests": self.peak_running_requests,
            "full_tier_reads": {name: vars(stats) for name, stats in self.fetched.items()},
            "decode_read_bytes_per_emitted_token": decode.bytes / emitted if emitted else 0.0,
            "decode_fetch_hidden_fraction": decode.hidden_fraction(),
            "totals": dict(vars(self.totals)),
            "disk_faults": store["faults"],
            "store_io": store["io"],
        }

    @property
    def spec_v2_attn_backends(self) -> tuple:
        return (self.model_runner.attn_backend, self.draft_backend, self.verify_backend)

    def clear_cache_pool(self) -> None:
        if self.tier is not None:
            self.tier = CompressedTier(self.compressor)
            self.draft_backend.tier = self.tier
        self._owners.clear()
        if self.drafter is not None:
            self.drafter.reset()
        self._publish_sizes()

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        """Release a finished request's compressed blocks and policy state."""
        del natural_stop
        for slot in [s for s, owner in self._owners.items() if owner == rid]:
            self._release(slot)
        self.policy.forget(rid)
        self.drafter_policy.forget(rid)
        self.penalty_states.forget(rid)
        if self.drafter is not None:
            self.drafter.forget(rid)
        self._publish_sizes()
        logger.debug("VeriCache totals after %s: %s", rid, self.totals)

    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None,
                                 **_: Any) -> GenerationBatchResult:
        del pp_proxy_tensors
        self._track_owners(batch)
        try:
            if batch.forward_mode.is_decode():
                result = self._decode(batch)
            elif batch.forward_mode.is_extend():
                result = self._prefill(batch)
            else:
                raise NotImplementedError(
                    f"VeriCache: unsupported forward mode {batch.forward_mode}")
        finally:
            if self.full_backend is not None:
                self.full_backend.finish()
        if self.staging is not None:
            stats = self.staging.take_stats()
            self.fetched["decode" if batch.forward_mode.is_decode() else "prefill"].add(stats)
            if self.metrics is not None:
                self.metrics.record_fetch(stats, prefill=not batch.forward_mode.is_decode())
            self._attribute_reads(batch.reqs)
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        return result

    # -- request lifetime ----------------------------------------------------------------------
    def _attribute_reads(self, reqs: list) -> None:
        """Add each request's full-tier bytes of this forward to its `meta_info` figure."""
        for row, nbytes in self.staging.take_request_bytes().items():
            _add_to_meta_info(reqs[row], READ_BYTES_KEY, nbytes)

    def _release(self, slot: int) -> None:
        self.tier.release(slot)
        self._owners.pop(slot, None)

    def _track_owners(self, batch) -> None:
        """A request slot now serving another request must not keep the old one's blocks."""
        for req, slot in zip(batch.reqs, batch.req_pool_indices.tolist(), strict=True):
            if self._owners.get(slot) != req.rid:
                self.tier.release(slot)
                self._owners[slot] = req.rid

    # -- forwards ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _bound(self, backend, forward_batch: ForwardBatch | None = None) -> Iterator[None]:
        """Run the target model's forwards through `backend` (planning and layers alike)."""
        runner = self.model_runner
        saved = runner.attn_backend, runner.decode_cuda_graph_runner
        runner.attn_backend, runner.decode_cuda_graph_runner = backend, None
        try:
            with forward_context(ForwardContext(attn_backend=backend), forward_batch=forward_batch):
                yield
        finally:
            runner.attn_backend, runner.decode_cuda_graph_runner = saved

    def _forward(self, backend, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits [tokens, vocab] of a forward built here, run through `backend`."""
        self.model_runner.kv_index_translator.bind_own_plan(forward_batch)
        with self._bound(backend, forward_batch):
            result = self._target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch, is_verify=True
            )
        return result.logits_output

    def _full_kv(self) -> contextlib.AbstractContextManager:
        """Where a plain forward over the full KV runs: SGLang's own attention, or, with the
        full KV in host memory, the staged backend."""
        if self.full_backend is not None:
            return self._bound(self.full_backend)
        return contextlib.nullcontext()

    def _prefill(self, batch) -> GenerationBatchResult:
        # Extend through the draft backend only to record prompt scores (its extend is exact);
        # the staged backend records them itself.
        scoring = self.compressor.needs_scores and self.full_backend is None
        with self._bound(self.draft_backend) if scoring else self._full_kv():
            result = self._target_worker.forward_batch_generation(batch)
        result.new_seq_lens = batch.seq_lens
        result.next_draft_input = VeriCacheDraftInput(
            bonus_tokens=result.next_token_ids.reshape(-1).to(torch.int64),
            new_seq_lens=batch.seq_lens,
        )
        return result

    def _drafting_rows(self, batch) -> list[bool]:
        return drafting_rows(batch, self.model_runner.sampler,
                             get_exec().kernel.sampling_backend)

    def _plain_decode(self, batch, committed: torch.Tensor, bonus: torch.Tensor):
        """One ordinary decode step (SGLang's own), for batches that return hidden states."""
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        slots = batch.req_pool_indices.to(torch.int64)
        batch.input_ids = bonus
        batch.out_cache_loc = req_to_token[slots, committed].to(torch.int64)
        batch.seq_lens = committed + 1
        batch.seq_lens_cpu = committed.cpu() + 1
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        batch.spec_info = None
        with self._full_kv():
            result = self._target_worker.forward_batch_generation(batch)
        next_tokens = result.next_token_ids.reshape(-1).to(torch.int64)
        logits_output = result.logits_output
        if logits_output.next_token_logprobs is not None:
            # Speculative results carry one row of logprobs per request (its accepted tokens).
            logits_output.next_token_logprobs = logits_output.next_token_logprobs.reshape(-1, 1)
        accept_lens = torch.ones_like(committed, dtype=torch.int32)
        return self._result(logits_output, next_tokens, accept_lens, committed + 1,
                            next_tokens, width=1, drafted=0, verified=[False] * len(batch.reqs))

    @staticmethod
    def _room(batch) -> list[int]:
        """New tokens each request may still emit before max_new_tokens (a round emits at
        most drafts + 1)."""
        return [
            1 << 30 if req.sampling_params.max_new_tokens is None
            else max(1, req.sampling_params.max_new_tokens - len(req.output_ids))
            for req in batch.reqs
        ]

    def _decode(self, batch) -> GenerationBatchResult:
        self.peak_running_requests = max(self.peak_running_requests, len(batch.reqs))
        state: VeriCacheDraftInput = batch.spec_info
        committed = batch.seq_lens.to(torch.int64)
        bonus = state.bonus_tokens.reshape(-1).to(torch.int64)
        if batch.return_hidden_states:
            return self._plain_decode(batch, committed, bonus)
        round_ = self._plan_round(batch, committed, bonus, self._drafting_rows(batch))
        if self.drafter is not None and round_.k > 0:
            self._draft_stacked(batch, round_)
        else:
            self._draft(batch, round_)
        logits = self._verify(batch, round_)
        return self._accept(batch, round_, logits)

    def _plan_round(self, batch, committed: torch.Tensor, bonus: torch.Tensor,
                    drafts: list[bool]) -> _Round:
        """The round's draft length (from the requests that draft; 0 without any) and where
        its tokens' K/V go (the slots SGLang reserved beyond each request's committed
        length)."""
        room = self._room(batch)
        drafting = [i for i, d in enumerate(drafts) if d]
        k = (min(self.policy.batch_length([batch.reqs[i].rid for i in drafting]),
                 max(room[i] for i in drafting) - 1) if drafting else 0)
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        positions = committed[:, None] + torch.arange(k + 1, device=committed.device)
        locs = req_to_token[batch.req_pool_indices.to(torch.int64)[:, None], positions]
        if self.full_backend is not None:
            # The full KV starts streaming now, behind the draft steps.
            self.full_backend.prefetch(batch.req_pool_indices.tolist(),
                                       committed.cpu().tolist(), k + 1)
        return _Round(
            k=k, room=room, committed=committed, committed_cpu=committed.cpu(),
            positions=positions, locs=locs.to(torch.int64), tokens=[bonus],
            grammar=RoundGrammar.for_batch(batch.reqs, batch.sampling_info.vocab_size, k + 1),
            penalties=RoundPenalties.for_batch(self.penalty_states, batch),
            rows=SamplingRows.from_sampling_info(batch.sampling_info), drafts=drafts,
            forwards=[0] * len(room), proposed=[0] * len(room), kept=[0] * len(room),
        )

    def _draft(self, batch, round_: _Round) -> None:
        """k one-token forwards over the compressed KV (under each request's grammar, if it has
        one), appending d1..dk to `round_.tokens` and each step's q to `round_.draft_probs`."""
        bs, grammar, penalties = len(batch.reqs), round_.grammar, round_.penalties
        self.draft_backend.begin_round(batch.req_pool_indices.tolist(),
                                       round_.committed_cpu.tolist(), round_.k)
        round_.forwards = [round_.k] * bs
        try:
            for step in range(round_.k):
                self.draft_backend.set_step(step)
                logits = self._draft_forward(batch, round_, torch.arange(bs),
                                             torch.full((bs,), step), round_.tokens[-1])
                if penalties is not None:
                    penalties.penalize(logits, list(range(bs)), [step] * bs,
                                       round_.chain()[:, 1:].tolist())
                if grammar is not None:
                    grammar.constrain_draft(logits, step)
                if penalties is not None:
                    penalties.bias(logits, list(range(bs)))
                token, q = draft_tokens(logits, round_.rows, round_.positions[:, step])
                round_.tokens.append(token)
                round_.draft_probs.append(q)
                if grammar is not None:
                    grammar.advance(token)
            round_.round_buffer_bytes = self.draft_backend.round_buffer_bytes()
            self.peak_round_bytes = max(self.peak_round_bytes, round_.round_buffer_bytes)
        finally:
            self.draft_backend.end_round()
            if grammar is not None:
                grammar.finish_drafting()

    def _draft_forward(self, batch, round_: _Round, requests: torch.Tensor,
                       steps: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [rows, V] of one forward over the compressed tier whose rows are the tokens
        at committed length + `steps[r]` of request `requests[r]` (`draft_backend` was told
        the same rows)."""
        device = round_.committed.device
        requests, steps = requests.to(device), steps.to(device)
        positions = round_.committed[requests] + steps
        lens_cpu = positions.cpu() + 1
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(requests), input_ids=input_ids,
            req_pool_indices=batch.req_pool_indices[requests], seq_lens=positions + 1,
            out_cache_loc=round_.locs[requests, steps], seq_lens_sum=int(lens_cpu.sum()),
            seq_lens_cpu=lens_cpu, positions=positions,
            spec_algorithm=SpeculativeAlgorithm.NONE, spec_info=None,
            capture_hidden_mode=CaptureHiddenMode.NULL, return_hidden_states_before_norm=False,
        )
        # Drafts are checked again over the full KV, so their forward may take the faster
        # few-row GEMM form (cpu/few_rows.py); verification keeps SGLang's.
        with few_row_linear(device):
            if len(requests) <= len(batch.reqs):
                return self._forward(self.draft_backend, fb).next_token_logits
            # More rows than the scheduler's batch: SGLang's eager runner would copy them into
            # input buffers sized for its largest decode batch; run them from their own
            # tensors, SGLang's no-copy eager mode.
            with envs.SGLANG_EAGER_INPUT_NO_COPY.override(True):
                return self._forward(self.draft_backend, fb).next_token_logits

    def _draft_stacked(self, batch, round_: _Round) -> None:
        """Level 2 proposes, level 1 checks: each forward over the compressed tier runs a
        request's last draft and the drafter's proposals after it, keeps a prefix of the
        proposals and appends a token of level 1's own (`sampling.check_proposal`: greedy and
        seeded requests get exactly the drafts one-token steps make, sampling requests drafts
        that follow level 1's distribution q, recorded for verification), until every request
        has k drafts. Rejected proposals' K/V stay in the round's scratch tail past the
        request's draft and are overwritten by its next forward; nothing reaches the KV pool."""
        reqs, k, bs, grammar = batch.reqs, round_.k, len(batch.reqs), round_.grammar
        rids = [req.rid for req in reqs]
        self.drafter.observe(reqs)
        depth = self.drafter.context
        bases = [[*req.origin_input_ids[-depth:], *req.output_ids[-depth:]][-depth:]
                 for req in reqs]
        base_lens = [len(req.origin_input_ids) + len(req.output_ids) for req in reqs]
        chains: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]  # q of each draft (sampling)
        last = round_.tokens[0].tolist()
        self.draft_backend.begin_round(batch.req_pool_indices.tolist(),
                                       round_.committed_cpu.tolist(), k)
        try:
            active = list(range(bs))
            while active:
                lengths = [min(self.drafter_policy.length(rids[i]), k - len(chains[i]) - 1)
                           for i in active]
                proposals = (self.drafter.propose(
                    [rids[i] for i in active], [(bases[i] + chains[i])[-depth:] for i in active],
                    [base_lens[i] + len(chains[i]) for i in active], lengths)
                    if any(lengths) else [[] for _ in active])
                requests, steps, ids = [], [], []
                for i, proposal in zip(active, proposals, strict=True):
                    for j, token in enumerate([last[i], *proposal]):
                        requests.append(i)
                        steps.append(len(chains[i]) + j)
                        ids.append(token)
                self.draft_backend.set_rows(requests, steps)
                device = round_.committed.device
                logits = self._draft_forward(batch, round_, torch.tensor(requests),
                                             torch.tensor(steps), torch.tensor(ids, device=device))
                if round_.penalties is not None:
                    offered = dict(zip(active, proposals, strict=True))
                    round_.penalties.penalize(logits, requests, steps,
                                              [chain + offered.get(i, [])
                                               for i, chain in enumerate(chains)])
                if grammar is not None:
                    grammar.constrain_proposals(logits, [
                        (i, len(chains[i]), proposal)
                        for i, proposal in zip(active, proposals, strict=True)])
                if round_.penalties is not None:
                    round_.penalties.bias(logits, requests)
                row = 0
                for i, proposal in zip(active, proposals, strict=True):
                    width = len(proposal) + 1
                    added, q = check_proposal(
                        logits[row : row + width],
                        round_.rows.take(torch.full((width,), i, device=device)),
                        round_.committed[i] + len(chains[i])
                        + torch.arange(width, device=device), proposal)
                    row += width
                    kept = len(added) - 1
                    if grammar is not None:
                        grammar.settle_proposal(i, kept, added[-1])
                    chains[i] += added
                    last[i] = added[-1]
                    if q is not None:
                        probs[i].extend(q)
                    round_.forwards[i] += 1
                    if proposal:
                        round_.proposed[i] += len(proposal)
                        round_.kept[i] += kept
                        self.drafter_policy.update(rids[i], len(proposal), kept)
                active = [i for i in active if len(chains[i]) < k]
            round_.round_buffer_bytes = self.draft_backend.round_buffer_bytes()
            self.peak_round_bytes = max(self.peak_round_bytes, round_.round_buffer_bytes)
        finally:
            self.draft_backend.end_round()
            if grammar is not None:
                grammar.finish_drafting()
        device = round_.committed.device
        round_.tokens.extend(torch.tensor([chain[step] for chain in chains], device=device)
                             for step in range(k))
        if round_.rows.any_sampled:
            # Verification reads q only for the requests that sample; the others get zeros.
            zeros = logits.new_zeros(logits.shape[-1])
            round_.draft_probs = [torch.stack([q[step] if q else zeros for q in probs])
                                  for step in range(k)]

    def _verify(self, batch, round_: _Round):
        """One TARGET_VERIFY forward of [t0, d1..dk] over the full KV: the full model's logits
        at every position of the chain."""
        bs, width = len(batch.reqs), round_.k + 1
        chain = round_.chain()
        fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=chain.reshape(-1),
            req_pool_indices=batch.req_pool_indices, seq_lens=round_.committed,
            out_cache_loc=round_.locs.reshape(-1),
            seq_lens_sum=int(round_.committed_cpu.sum()), seq_lens_cpu=round_.committed_cpu,
            positions=round_.positions.reshape(-1), spec_algorithm=batch.spec_algorithm,
            spec_info=VeriCacheVerifyInput(draft_token_num=width,
                                           positions=round_.positions.reshape(-1)),
            capture_hidden_mode=CaptureHiddenMode.NULL, return_hidden_states_before_norm=False,
        )
        logits_output = self._forward(self.verify_backend, fb)
        logits = logits_output.next_token_logits
        requests = [i for i in range(bs) for _ in range(width)]
        if round_.penalties is not None:
            round_.penalties.penalize(logits, requests, list(range(width)) * bs,
                                      chain[:, 1:].tolist())
        if round_.grammar is not None:
            round_.grammar.constrain_verify(logits)
        if round_.penalties is not None:
            round_.penalties.bias(logits, requests)
        if self.full_backend is not None:
            self.peak_round_bytes = max(self.peak_round_bytes,
                                        self.full_backend.round_buffer_bytes())
        return logits_output

    def _accept(self, batch, round_: _Round, logits_output) -> GenerationBatchResult:
        """Accept the longest prefix the full model would have chosen itself (greedy and seeded
        requests) or rejection sample (the others), plus the full model's next token; the
        requests that do not draft emit SGLang's sampler's token at chain position 0."""
        bs, k, width = len(batch.reqs), round_.k, round_.k + 1
        chain = round_.chain()
        accepted, target = verify_tokens(
            logits_output.next_token_logits.view(bs, width, -1), chain[:, 1:],
            torch.stack(round_.draft_probs, dim=1)
            if round_.draft_probs and round_.rows.any_sampled else None,
            round_.rows, round_.positions,
        )
        plain = [i for i, drafts in enumerate(round_.drafts) if not drafts]
        first = None
        if plain:
            tokens, first = self._sample_first_position(batch, round_, logits_output)
            rows = torch.tensor(plain, device=accepted.device)
            accepted[rows] = 0
            target[rows, 0] = tokens[rows].to(target.dtype)
            for i in plain:
                round_.forwards[i] = round_.proposed[i] = round_.kept[i] = 0
        if k > 0:
            for req, a, drafts in zip(batch.reqs, accepted.tolist(), round_.drafts,
                                      strict=True):
                if drafts:
                    self.policy.update(req.rid, k, a)
        # A request with less room than the batch's draft length emits only what fits, so
        # its statistics count only drafts it emits (target[j] is draft j+1 for j < accepted).
        accepted = accepted.clamp(max=torch.tensor(round_.room, device=accepted.device) - 1)
        accept_lens = (accepted + 1).to(torch.int32)
        if self.full_backend is not None:
            self.full_backend.commit_chain(round_.locs, accept_lens)
        if batch.return_logprob:
            chain_logprobs(logits_output.next_token_logits, round_.rows, target,
                           batch.top_logprobs_nums, batch.token_ids_logprobs
                           ).write_output_to(logits_output)
            if first is not None:
                take_first_positions(logits_output, first, plain, width)
        new_bonus = target.gather(1, accepted[:, None]).squeeze(1)
        for i, req in enumerate(batch.reqs):
            _add_to_meta_info(req, DRAFT_FORWARDS_KEY, round_.forwards[i])
            if self.drafter is not None:
                _add_to_meta_info(req, DRAFTER_PROPOSED_KEY, round_.proposed[i])
                _add_to_meta_info(req, DRAFTER_KEPT_KEY, round_.kept[i])
        self._add(RoundCounts(draft_forwards=sum(round_.forwards),
                              drafter_proposed=sum(round_.proposed),
                              drafter_kept=sum(round_.kept)))
        return self._result(logits_output, target.to(torch.int64).reshape(-1), accept_lens,
                            round_.committed + accept_lens, new_bonus, width=width, drafted=k,
                            verified=round_.drafts)

    def _sample_first_position(self, batch, round_: _Round, logits_output
                               ) -> tuple[torch.Tensor, LogitsProcessorOutput]:
        """SGLang's own sampler (custom logit processors, logprobs) over the verify logits of
        chain position 0, the logits a plain decode step samples from: every request's
        plain-step token [bs] and the sampler's output (logprobs)."""
        bs, width = len(batch.reqs), round_.k + 1
        first = LogitsProcessorOutput(next_token_logits=logits_output.next_token_logits
                                      .view(bs, width, -1)[:, 0].clone())
        lens_cpu = round_.committed_cpu + 1
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=round_.tokens[0],
            req_pool_indices=batch.req_pool_indices, seq_lens=round_.committed + 1,
            out_cache_loc=round_.locs[:, 0], seq_lens_sum=int(lens_cpu.sum()),
            seq_lens_cpu=lens_cpu, positions=round_.committed,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            # The round's grammar masks, penalties and bias are already on these logits.
            sampling_info=dataclasses.replace(
                batch.sampling_info, grammars=None, penalizer_orchestrator=None,
                acc_additive_penalties=None, acc_scaling_penalties=None, logit_bias=None),
            return_logprob=batch.return_logprob, top_logprobs_nums=batch.top_logprobs_nums,
            token_ids_logprobs=batch.token_ids_logprobs,
        )
        return self.model_runner.sample(first, fb), first

    def _result(self, logits_output, output_ids: torch.Tensor, accept_lens: torch.Tensor,
                new_seq_lens: torch.Tensor, bonus: torch.Tensor, *, width: int,
                drafted: int, verified: list[bool]) -> GenerationBatchResult:
        """The step's result for the scheduler; `verified` says which requests' runs were
        verified rounds of `drafted` drafts (the others took a plain step)."""
        self._count(drafted, verified)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=output_ids,
            accept_lens=accept_lens,
            # Reported per request as meta_info["spec_cap_length"]: mean drafts per round.
            cap_lens=torch.tensor([drafted if v else 0 for v in verified], dtype=torch.int32),
            next_draft_input=VeriCacheDraftInput(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=width,
            speculative_output_stride=width,
            num_non_draft_tokens_per_req=1,
            new_seq_lens=new_seq_lens,
            can_run_cuda_graph=False,
        )

    def _count(self, drafted: int, verified: list[bool]) -> None:
        """Count the step's rounds, drafts and plain steps; its emitted tokens are counted as
        the scheduler settles them (`settle_round`)."""
        self._settling = verified
        rounds = sum(verified)
        self._add(RoundCounts(verify_rounds=rounds, drafted_tokens=drafted * rounds,
                              plain_decode_steps=len(verified) - rounds))
        if self.metrics is not None:
            self.metrics.record_store(STORE_STATS.snapshot())
        self._publish_sizes()

    def settle_round(self, *, row: int, emitted: int, accepted: int) -> None:
        """Count the tokens request `row` of the last step kept of its verified round: the
        scheduler calls this once it knows whether a stop string, stop token or grammar ended
        the request inside the run (`settle.py`)."""
        if self._settling[row]:
            self._add(RoundCounts(accepted_drafts=accepted, emitted_tokens=emitted))

    def _add(self, counts: RoundCounts) -> None:
        self.totals.add(counts)
        if self.metrics is not None:
            compressed = 0 if self.pool is None else self.pool.compressed_pages
            self.metrics.record(counts, pages_compressed=compressed - self._pages_reported)
            self._pages_reported = compressed

    def _publish_sizes(self) -> None:
        """Set the size gauges to what is held now: after a step, when a request's blocks are
        released, and after a flush emptied the pool (no step follows to update them)."""
        if self.metrics is not None:
            self.metrics.set_sizes(self.held_bytes(),
                                   pages_used=0 if self.pool is None else self.pool.used_pages)


def _add_to_meta_info(req, key: str, amount: int) -> None:
    """Add to one of the request's `meta_info` figures (request-level keys of `meta_info.py`,
    reported once, when the request finishes). A streamed response's first chunk would carry
    the figure as it stood after prefill, so streams get none."""
    if req.stream:
        return
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info.setdefault(key, [0])[0] += amount
