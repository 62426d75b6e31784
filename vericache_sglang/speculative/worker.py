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
one-token steps make; sampled drafts follow the same q (`sampling.check_proposals`), so
verification and output are unchanged; only the forwards differ. Requests with a grammar
check proposals under the masks of each position (`grammar.py`).

A request with a grammar drafts and verifies under the same vocab masks (`grammar.py`), one
with penalties or logit bias under the penalty state of each chain position (`penalties.py`),
and returned logprobs come from the verify logits (`logprobs.py`). Requests a round cannot
serve (custom logit processors, some samplers; `eligibility.py`) take one plain step inside
it: SGLang's sampler chooses their token from the verify logits of chain position 0, so their
batch-mates still draft. Prefill runs the target model as usual.

The parts: `round.py` (a round's state), `forwards.py` (its forward batches and running them),
`drafting.py` (both levels), `verification.py` (verify and accept), `backends.py` (tiers and
attention backends), `statistics.py` (counts). This module plans each round and keeps the
bookkeeping SGLang's scheduler sees.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.runtime_context import get_exec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from vericache_sglang import startup
from vericache_sglang.attention import features as attention_features
from vericache_sglang.compress import parse_compressor_spec
from vericache_sglang.config import get_config
from vericache_sglang.cpu.few_rows import faster_row_counts
from vericache_sglang.metrics import RoundCounts, VeriCacheMetrics
from vericache_sglang.speculative.backends import RoundBackends
from vericache_sglang.speculative.drafter import build_drafter
from vericache_sglang.speculative.drafting import draft_stacked, draft_steps
from vericache_sglang.speculative.early import (
    EarlyDrafting,
    EarlyDrafts,
    Stash,
    can_draft_early,
    first_tokens,
    prefill_over_exact,
    recompute_prefixes,
)
from vericache_sglang.speculative.eligibility import drafting_rows
from vericache_sglang.speculative.forwards import (
    TargetForwards,
    prefill_sampling_forward_batch,
)
from vericache_sglang.speculative.grammar import RoundGrammar
from vericache_sglang.speculative.info import VeriCacheDraftInput
from vericache_sglang.speculative.meta_info import (
    DRAFT_FORWARDS_KEY,
    DRAFTER_KEPT_KEY,
    DRAFTER_PROPOSED_KEY,
    EARLY_DRAFTS_KEY,
    READ_BYTES_KEY,
)
from vericache_sglang.speculative.parking import Parking
from vericache_sglang.speculative.penalties import PenaltyStates, RoundPenalties
from vericache_sglang.speculative.policy import DraftLengthPolicy, RoundLengthPolicy
from vericache_sglang.speculative.round import Round, room
from vericache_sglang.speculative.sampling import SamplingRows
from vericache_sglang.speculative.statistics import WorkerStats, add_to_meta_info
from vericache_sglang.speculative.verification import judge, verify, write_logprobs
from vericache_sglang.stores.state import store_state

logger = logging.getLogger(__name__)


class VeriCacheWorker(BaseSpecWorker):
    """Lossless decoding over a compressed KV tier (see the module docstring)."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker, **_: Any):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        # SGLang's draft-worker slot stays empty: a level-2 draft model belongs to the drafter.
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = target_worker.device
        self.forwards = TargetForwards(target_worker)
        # What this server's store measures and holds; its storage backend, built after this
        # worker, finds the same state on the server's arguments (stores/state.py).
        self.store_state = store_state(server_args)
        config = get_config(server_args)
        self.compressor = parse_compressor_spec(config.vericache_compressor)
        self.policy = RoundLengthPolicy(
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
        self.placement = config.vericache_full_tier
        self.stash = Stash()
        # A prefill whose stored prefix is still arriving, waiting beside the running batch.
        self.parking = (Parking(self._context, self._may_draft_early, self._new_drafting,
                                self._drafting_goes_on, self.store_state.pending)
                        if config.vericache_early_drafting else None)
        # Built in init_attention_backends(), once the target's KV pools exist.
        self.backends: RoundBackends | None = None
        self._owners: dict[int, str] = {}  # request slot -> rid whose blocks the tier holds
        # Logged, reported in /server_info, and Prometheus counters with --enable-metrics.
        self.stats = WorkerStats(
            VeriCacheMetrics(server_args.served_model_name or server_args.model_path)
            if server_args.enable_metrics else None, self.store_state)
        if torch.device(self.device).type == "cpu":
            # Timed now, not in the first request's drafting forward (cpu/few_rows.py).
            logger.info("VeriCache worker: W @ X^T GEMM form in drafting forwards of %s rows",
                        sorted(faster_row_counts()) or "no")
        logger.info("VeriCache worker: compressor %s, draft length %d (%d..%d), drafter %s",
                    self.compressor.spec(), self.policy.initial, self.policy.minimum,
                    self.policy.maximum,
                    config.vericache_draft_model or config.vericache_drafter)

    # -- SGLang worker interface ---------------------------------------------------------------
    def init_attention_backends(self) -> None:
        refused = attention_features.refusal(self.model_runner, self.placement)
        if refused is not None:
            raise startup.scheduler_error(refused)
        logger.info("VeriCache attention: %s",
                    attention_features.describe(self.model_runner.model).summary())
        self.backends = RoundBackends(self.model_runner, self.server_args, self.compressor,
                                      self.placement, self.store_state)
        logger.info("VeriCache memory: %s", self.memory_report())

    def memory_report(self) -> dict[str, Any]:
        """Where each form of the KV lives and what it takes (startup log, `/server_info`)."""
        return self.backends.memory_report()

    def live_report(self) -> dict[str, Any]:
        """VeriCache's running state for `/server_info` (`internal_states`)."""
        allocator = self.model_runner.token_to_kv_pool_allocator
        stats, backends = self.stats, self.backends
        decode = stats.fetched["decode"]
        emitted = stats.totals.emitted_tokens + stats.totals.plain_decode_steps
        return {
            "full_tier": self.placement,
            "device_bytes": backends.device_bytes(stats.peak_round_bytes, self.stash.nbytes()),
            "device_budget_bytes": (None if backends.plan is None
                                    else backends.plan.device_budget_bytes),
            # A draft model's weights (less what it shares with the target) and its own KV:
            # outside the KV budget, as the target's weights are.
            "drafter_device_bytes": 0 if self.drafter is None else self.drafter.device_bytes(),
            "full_kv_tokens_used": self.model_runner.max_total_num_tokens
            - allocator.available_size(),
            "compressed_pool_pages_used": backends.pages_used,
            "peak_running_requests": stats.peak_running_requests,
            "full_tier_reads": {name: vars(fetch) for name, fetch in stats.fetched.items()},
            "decode_read_bytes_per_emitted_token": decode.bytes / emitted if emitted else 0.0,
            "decode_fetch_hidden_fraction": decode.hidden_fraction(),
            "totals": dict(vars(stats.totals)),
            **self.store_state.report(),
            "early_drafting": {**self.store_state.pending.snapshot(), **stats.early_report(),
                               **({} if self.parking is None else self.parking.totals),
                               "store_link_mbit": self.store_state.link.mbit()},
            "compressed_pages_quantized": backends.compressed_pages,
        }

    @property
    def spec_v2_attn_backends(self) -> tuple:
        return (self.model_runner.attn_backend, self.backends.draft, self.backends.verify)

    def clear_cache_pool(self) -> None:
        if self.backends is not None:
            self.backends.reset_tier()
        self._owners.clear()
        self.stash.clear()
        self.store_state.pending.clear()
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
        self.stash.forget(rid)
        self.penalty_states.forget(rid)
        if self.drafter is not None:
            self.drafter.forget(rid)
        self._publish_sizes()
        logger.debug("VeriCache totals after %s: %s", rid, self.stats.totals)

    def settle_round(self, *, row: int, emitted: int, accepted: int) -> None:
        """Count the tokens request `row` of the last step kept of its verified round: the
        scheduler calls this once it knows whether a stop string, stop token or grammar ended
        the request inside the run (`settle.py`)."""
        self.stats.settle(row, emitted, accepted, self.backends.compressed_pages)

    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None,
                                 **_: Any) -> GenerationBatchResult:
        del pp_proxy_tensors
        self.backends.tier.new_step()
        self._track_owners(batch)
        full = self.backends.full
        early = self._before_exact_kv(batch)
        try:
            if early is not None:
                result = self._prefill_after_drafting(batch, early)
                self._keep_early_drafts(batch, early, result)
            elif batch.forward_mode.is_decode():
                result = self._decode(batch)
                if self.parking is not None:
                    self.parking.between_rounds()
            elif batch.forward_mode.is_extend():
                result = self._prefill(batch)
            else:
                raise NotImplementedError(
                    f"VeriCache: unsupported forward mode {batch.forward_mode}")
        finally:
            if full is not None:
                full.finish()
        staging = self.backends.staging
        if staging is not None:
            fetch = staging.take_stats()
            decode = batch.forward_mode.is_decode()
            self.stats.fetched["decode" if decode else "prefill"].add(fetch)
            if self.stats.metrics is not None:
                self.stats.metrics.record_fetch(fetch, prefill=not decode)
            for row, nbytes in staging.take_request_bytes().items():
                add_to_meta_info(batch.reqs[row], READ_BYTES_KEY, nbytes)
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        return result

    # -- a stored prefix whose exact KV is still arriving (speculative/early.py) --------------
    def _before_exact_kv(self, batch) -> EarlyDrafts | None:
        """Write the exact KV of stored pages that arrived into their host pages and device
        slots. Before a forward reads a page still waiting (its context, `_context`), wait
        for it (the barrier, bounded by `--vericache-store-timeout`): a prefill that may
        drafts over the compressed tier meanwhile, and its drafts (per request) are returned.
        Pages in the context whose exact KV cannot come are recomputed first."""
        pending = self.store_state.pending
        if not pending.enabled:
            return None
        context = self._context(batch) if pending.waiting_in() else None
        drafts = None
        # Drafting a parked prefill began between the running batch's steps (parking.py).
        drafting = None if self.parking is None else self.parking.claim(batch)
        if context is not None and pending.waiting_in(context):
            began = time.perf_counter()
            if (drafting is None and pending.arriving_in(context)
                    and self._may_draft_early(batch)):
                drafting = self._new_drafting(batch)
            if drafting is not None:
                drafts = drafting.run(lambda: self._drafting_goes_on(context))
            seconds = time.perf_counter() - began
            settled = pending.settle(context=context, block=True)
            logger.info("VeriCache early drafting: %s drafts in %.2f s over the compressed "
                        "KV, then %.2f s waiting for the exact KV of %d pages",
                        "no" if drafts is None else sum(map(len, drafts.tokens)), seconds,
                        settled.waited_seconds, len(settled.writes) + len(settled.failed))
        else:
            if drafting is not None:  # parked until its exact KV was in
                drafts = drafting.finish()
            settled = pending.settle(context=context, block=False)
        self.store_state.write_settled(settled, self.model_runner.token_to_kv_pool, self.device)
        if settled.failed:
            recomputed = recompute_prefixes(self.forwards, batch,
                                            list(settled.failed.values()))
            pending.heal(recomputed, settled.failed, self._device_kv)
        return drafts

    def _may_draft_early(self, batch) -> bool:
        return can_draft_early(batch, drafting_rows(batch, self.model_runner.sampler,
                                                    get_exec().kernel.sampling_backend))

    def _new_drafting(self, batch) -> EarlyDrafting:
        # SGLang loads the prefix's host pages onto the device on its own stream; the drafting
        # forwards read them, so they wait for its layers as the prefill would (not yet run on
        # a GPU; on a CPU the load has run).
        self._target_worker.set_hicache_consumer(batch.hicache_consumer_index)
        return EarlyDrafting(self.forwards, self.backends.early_draft, batch)

    def _context(self, batch) -> torch.Tensor | None:
        """The device slots `batch`'s forward reads as exact KV that a stored page may hold:
        a prefill's cached prefixes. None for a decode: a running request's sequence never
        holds a waiting page, since its prefill waited for (or recomputed) every page in its
        prefix, and SGLang loads pages only into a prefill's prefix."""
        if not batch.forward_mode.is_extend():
            return None
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        rows = [req_to_token[req.kv.req_pool_idx, :n]
                for req, n in zip(batch.reqs, batch.prefix_lens, strict=True)]
        # On the host once: the registry compares it with its pages' slots there, at every
        # early draft step.
        return torch.cat(rows).to(torch.int64).cpu() if rows else None

    def _drafting_goes_on(self, context: torch.Tensor) -> bool:
        """Between early drafts: write the pages that arrived (their pool-level codes
        replace coarse ones, so later drafts read them), and say whether any page in the
        prefill's `context` still waits. Failed pages wait for the barrier, which recomputes
        them."""
        pending = self.store_state.pending
        settled = pending.settle(context=context, block=False, failures=False)
        self.store_state.write_settled(settled, self.model_runner.token_to_kv_pool, self.device)
        return pending.arriving_in(context)

    def _device_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """[2, L, n, H, D]: the full KV at device `slots`, on the host."""
        pool = self.model_runner.token_to_kv_pool
        index = slots.to(torch.int64).to(self.device)
        return torch.stack([torch.stack([buffer[index].cpu() for buffer in buffers])
                            for buffers in (pool.k_buffer, pool.v_buffer)])

    def _keep_early_drafts(self, batch, drafts: EarlyDrafts,
                           result: GenerationBatchResult) -> None:
        """Keep the drafts that follow each request's first token as its stash."""
        first = result.next_token_ids.reshape(-1).tolist()
        for req, chain, probs, token in zip(batch.reqs, drafts.tokens, drafts.probs, first,
                                            strict=True):
            self.stash.keep(req.rid, chain, token, probs)
            add_to_meta_info(req, EARLY_DRAFTS_KEY, len(chain))
        self.stats.add_early(sum(map(len, drafts.tokens)))

    # -- request lifetime ----------------------------------------------------------------------
    def _release(self, slot: int) -> None:
        self.backends.tier.release(slot)
        self._owners.pop(slot, None)

    def _track_owners(self, batch) -> None:
        """A request slot now serving another request must not keep the old one's blocks."""
        for req in batch.reqs:
            if self._owners.get(req.kv.req_pool_idx) != req.rid:
                self.backends.tier.release(req.kv.req_pool_idx)
                self._owners[req.kv.req_pool_idx] = req.rid

    def _publish_sizes(self) -> None:
        """Set the size gauges to what is held now: after a step, when a request's blocks are
        released, and after a flush emptied the pool (no step follows to update them)."""
        if self.backends is not None:
            self.stats.publish_sizes(self.backends.held_bytes(), self.backends.pages_used)

    # -- steps ---------------------------------------------------------------------------------
    def _prefill(self, batch) -> GenerationBatchResult:
        # Extend through the draft backend only to record prompt scores (its extend is exact);
        # the staged backend records them itself.
        backends = self.backends
        scoring = self.compressor.needs_scores and backends.full is None
        began = time.perf_counter()
        with (self.forwards.bound(backends.draft) if scoring
              else self.forwards.full_kv(backends.full)):
            result = self._target_worker.forward_batch_generation(batch)
        admission = self.store_state.admission
        if admission.enabled and batch.extend_num_tokens:
            # The store's read-or-recompute choice needs the prefill rate. On a GPU the forward
            # only queued its kernels: wait for them (with --vericache-store-reads auto only;
            # not yet run on a GPU). On a CPU the forward has run.
            if str(self.device).startswith("cuda"):
                torch.cuda.synchronize()
            admission.record_prefill(batch.extend_num_tokens, time.perf_counter() - began)
        return self._prefilled(batch, result)

    def _prefill_after_drafting(self, batch, drafts: EarlyDrafts) -> GenerationBatchResult:
        """The prefill of a batch that drafted before its exact KV: the suffix as a
        verification chain over the exact KV (`early.prefill_over_exact`), its first token
        SGLang's own sampler's from the last position's logits, or a sampled request's first
        draft kept by rejection sampling (`early.first_tokens`); SGLang's own prefill when
        the suffixes differ in length."""
        last = prefill_over_exact(self.forwards, self.backends.verify, batch)
        if last is None:
            return self._prefill(batch)
        raw = last.clone()  # the sampler changes its logits in place
        logits_output = LogitsProcessorOutput(next_token_logits=last)
        tokens = first_tokens(raw, self.model_runner.sample(
            logits_output, prefill_sampling_forward_batch(batch)), batch, drafts)
        return self._prefilled(batch, GenerationBatchResult(
            logits_output=logits_output, next_token_ids=tokens, can_run_cuda_graph=False))

    def _prefilled(self, batch, result: GenerationBatchResult) -> GenerationBatchResult:
        """A prefill's result, with the state the first round starts from."""
        result.new_seq_lens = batch.seq_lens
        result.next_draft_input = VeriCacheDraftInput(
            bonus_tokens=result.next_token_ids.reshape(-1).to(torch.int64),
            new_seq_lens=batch.seq_lens,
        )
        return result

    def _plain_decode(self, batch, committed: torch.Tensor, committed_cpu: torch.Tensor,
                      bonus: torch.Tensor) -> GenerationBatchResult:
        """One ordinary decode step (SGLang's own), for batches that return hidden states."""
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        slots = batch.req_pool_indices.to(torch.int64)
        batch.input_ids = bonus
        batch.out_cache_loc = req_to_token[slots, committed].to(torch.int64)
        batch.seq_lens = committed + 1
        batch.seq_lens_cpu = committed_cpu + 1
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        batch.spec_info = None
        with self.forwards.full_kv(self.backends.full):
            result = self._target_worker.forward_batch_generation(batch)
        next_tokens = result.next_token_ids.reshape(-1).to(torch.int64)
        logits_output = result.logits_output
        if logits_output.next_token_logprobs is not None:
            # Speculative results carry one row of logprobs per request (its accepted tokens).
            logits_output.next_token_logprobs = logits_output.next_token_logprobs.reshape(-1, 1)
        accept_lens = torch.ones_like(committed, dtype=torch.int32)
        return self._result(logits_output, next_tokens, accept_lens, committed + 1,
                            next_tokens, width=1, drafted=0, verified=[False] * len(batch.reqs))

    def _decode(self, batch) -> GenerationBatchResult:
        self.stats.peak_running_requests = max(self.stats.peak_running_requests,
                                               len(batch.reqs))
        state: VeriCacheDraftInput = batch.spec_info
        committed = batch.seq_lens.to(torch.int64)
        # SGLang keeps the committed lengths on the host too: no copy from the device.
        committed_cpu = (batch.seq_lens_cpu.to(torch.int64) if batch.seq_lens_cpu is not None
                         else committed.cpu())
        bonus = state.bonus_tokens.reshape(-1).to(torch.int64)
        if batch.return_hidden_states:
            return self._plain_decode(batch, committed, committed_cpu, bonus)
        began = time.perf_counter()
        backends = self.backends
        backends.draft.take_lookup_seconds()  # an early drafting's, before this round
        round_ = self._plan_round(batch, committed, committed_cpu, bonus)
        if round_.stashed:
            rids = [req.rid for req in batch.reqs]
            round_.tokens += self.stash.take(rids, round_.k, committed.device)
            if round_.rows.any_sampled:
                round_.draft_probs = self.stash.take_probs(
                    rids, round_.k, batch.sampling_info.vocab_size, committed.device)
            if round_.grammar is not None:
                round_.grammar.replay(round_.tokens)
        elif self.drafter is not None and round_.k > 0:
            draft_stacked(self.forwards, backends.draft, self.drafter, self.drafter_policy,
                          batch, round_)
        else:
            draft_steps(self.forwards, backends.draft, batch, round_)
        self.stats.peak(round_.round_buffer_bytes)
        logits_output = verify(self.forwards, backends.verify, batch, round_)
        if backends.full is not None:
            self.stats.peak(backends.full.round_buffer_bytes())
        result = self._accept(batch, round_, logits_output)
        # The policy weighs what the draft length costs: not the compression of pages new to
        # the pool (a request's first drafting round pays it at any length), nor a stashed
        # round, which verifies drafts made before it.
        seconds = time.perf_counter() - began - backends.draft.take_lookup_seconds()
        if not round_.stashed:
            self.policy.record_round(len(batch.reqs), round_.k, seconds)
        return result

    def _plan_round(self, batch, committed: torch.Tensor, committed_cpu: torch.Tensor,
                    bonus: torch.Tensor) -> Round:
        """The round's draft length (from the requests that draft; 0 without any) and where
        its tokens' K/V go (the slots SGLang reserved beyond each request's committed
        length)."""
        drafts = drafting_rows(batch, self.model_runner.sampler,
                               get_exec().kernel.sampling_backend)
        rooms = room(batch.reqs)
        drafting = [i for i, d in enumerate(drafts) if d]
        k = (min(self.policy.batch_length([batch.reqs[i].rid for i in drafting], len(rooms)),
                 max(rooms[i] for i in drafting) - 1) if drafting else 0)
        # Drafts made before the exact KV (early.py): verified without drafting, while every
        # request of the batch has some and drafts.
        stashed = (len(drafting) == len(rooms)
                   and self.stash.length([req.rid for req in batch.reqs]))
        if stashed:
            k = min(stashed, self.max_draft_length, max(rooms) - 1)
        if k == 0:  # a plain step for every request: SGLang's sampler takes each token
            drafts = [False] * len(drafts)
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        positions = committed[:, None] + torch.arange(k + 1, device=committed.device)
        locs = req_to_token[batch.req_pool_indices.to(torch.int64)[:, None], positions]
        slots = [req.kv.req_pool_idx for req in batch.reqs]
        if self.backends.full is not None:
            # The full KV starts streaming now, behind the draft steps.
            self.backends.full.prefetch(slots, committed_cpu.tolist(), k + 1)
        bs = len(rooms)
        return Round(
            k=k, room=rooms, committed=committed, committed_cpu=committed_cpu, slots=slots,
            positions=positions, locs=locs.to(torch.int64), tokens=[bonus],
            grammar=RoundGrammar.for_batch(batch.reqs, batch.sampling_info.vocab_size, k + 1),
            penalties=RoundPenalties.for_batch(self.penalty_states, batch),
            rows=SamplingRows.from_sampling_info(batch.sampling_info), drafts=drafts,
            forwards=[0] * bs, proposed=[0] * bs, kept=[0] * bs, stashed=bool(stashed) and k > 0,
        )

    def _accept(self, batch, round_: Round, logits_output) -> GenerationBatchResult:
        """Emit what verification chose, and keep the round's bookkeeping: draft lengths,
        the full tier's committed chain, logprobs and per-request figures."""
        k, width = round_.k, round_.k + 1
        verdict = judge(self.model_runner, batch, round_, logits_output)
        for i in verdict.plain:
            round_.forwards[i] = round_.proposed[i] = round_.kept[i] = 0
        accepted = verdict.accepted
        if k > 0:
            # The draft length policy runs on the host: one copy of the round's counts.
            for req, a, drafts in zip(batch.reqs, accepted.tolist(), round_.drafts,
                                      strict=True):
                if drafts:
                    self.policy.update(req.rid, k, a)
        # A request with less room than the batch's draft length emits only what fits, so
        # its statistics count only drafts it emits (target[j] is draft j+1 for j < accepted).
        accepted = accepted.clamp(max=torch.tensor(round_.room, device=accepted.device) - 1)
        accept_lens = (accepted + 1).to(torch.int32)
        if self.backends.full is not None:
            self.backends.full.commit_chain(round_.locs, accept_lens)
        if batch.return_logprob:
            write_logprobs(batch, round_, logits_output, verdict)
        new_bonus = verdict.target.gather(1, accepted[:, None]).squeeze(1)
        if round_.stashed:
            for req, a, b in zip(batch.reqs, accepted.tolist(), new_bonus.tolist(),
                                 strict=True):
                self.stash.advance(req.rid, k, a, b)
                self.stats.add_stashed(k, a)
        else:  # a stash no longer follows what this round emitted
            for req in batch.reqs:
                self.stash.forget(req.rid)
        for i, req in enumerate(batch.reqs):
            add_to_meta_info(req, DRAFT_FORWARDS_KEY, round_.forwards[i])
            if self.drafter is not None:
                add_to_meta_info(req, DRAFTER_PROPOSED_KEY, round_.proposed[i])
                add_to_meta_info(req, DRAFTER_KEPT_KEY, round_.kept[i])
        self.stats.add(RoundCounts(draft_forwards=sum(round_.forwards),
                                   drafter_proposed=sum(round_.proposed),
                                   drafter_kept=sum(round_.kept)),
                       self.backends.compressed_pages)
        return self._result(logits_output, verdict.target.to(torch.int64).reshape(-1),
                            accept_lens, round_.committed + accept_lens, new_bonus,
                            width=width, drafted=k, verified=round_.drafts)

    def _result(self, logits_output, output_ids: torch.Tensor, accept_lens: torch.Tensor,
                new_seq_lens: torch.Tensor, bonus: torch.Tensor, *, width: int,
                drafted: int, verified: list[bool]) -> GenerationBatchResult:
        """The step's result for the scheduler; `verified` says which requests' runs were
        verified rounds of `drafted` drafts (the others took a plain step)."""
        self.stats.count_step(drafted, verified, self.backends.compressed_pages,
                              0 if self.parking is None
                              else int(self.parking.totals["prefills_parked"]))
        self._publish_sizes()
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
