"""Drafting before a stored prefix's exact KV has arrived (`--vericache-early-drafting`).

A prefill whose prefix pages came from the store on their drafting level (`stores/pending.py`)
cannot run over the full KV until their exact part is written there. Meanwhile the worker
drafts over the compressed tier, which already holds those pages (installed from the stream):

1. one forward runs the prompt's uncached suffix over the compressed prefix, its K/V in the
   draft backend's scratch tail; its last position's token is the first draft;
2. one-token draft steps follow while the exact pages are still on their way (the number of
   steps is the time they still need, measured by asking after each step, capped at
   `MAX_EARLY_DRAFTS`).

Then the barrier writes the exact KV, and the suffix runs over it as one verification chain
(`prefill_over_exact`): the argmax at its last position is the first output token. The drafts
after it are the request's stash
(`Stash`): the following decode rounds verify them over the full KV instead of drafting,
`--vericache-max-draft-length` at a time, until one is rejected. So every emitted token still
comes from a forward over the exact KV. Only greedy requests without a grammar, penalties or
logprobs draft early (their drafts need no distribution); others wait at the barrier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from vericache_sglang.attention.draft import DraftAttnBackend
from vericache_sglang.speculative.forwards import (
    TargetForwards,
    chain_forward_batch,
    draft_forward_batch,
    extend_forward_batch,
)
from vericache_sglang.speculative.round import Round, room
from vericache_sglang.speculative.sampling import SamplingRows

logger = logging.getLogger(__name__)

MAX_EARLY_DRAFTS = 256
"""Drafts a request makes at most before its exact KV arrives."""
MAX_SUFFIX = 512
"""Longer uncached suffixes are not drafted over the compressed prefix (the scratch tail
holds the suffix too)."""


def can_draft_early(batch) -> bool:
    """Whether this prefill batch's requests may draft before the exact KV: whole prompts,
    greedy, without a grammar, penalties, logit processors or logprobs."""
    info = batch.sampling_info
    return (info.is_all_greedy and not batch.return_logprob and not batch.return_hidden_states
            and info.grammars is None
            and not (info.penalizer_orchestrator and info.penalizer_orchestrator.is_required)
            and info.logit_bias is None
            and all(req.custom_logit_processor is None and req.extend_end
                    == len(req.origin_input_ids) for req in batch.reqs)
            and 0 < max(batch.extend_lens) <= MAX_SUFFIX)


def draft_early(forwards: TargetForwards, backend: DraftAttnBackend, batch,
                waiting: Callable[[], bool]) -> list[list[int]]:
    """Each request's drafts after its prompt, made over the compressed prefix while
    `waiting()` says the exact KV is still on its way."""
    reqs = batch.reqs
    bs = len(reqs)
    device = batch.seq_lens.device
    prefix = list(batch.prefix_lens)
    suffix = list(batch.extend_lens)
    steps_max = max(suffix) + MAX_EARLY_DRAFTS
    committed = torch.tensor(prefix, dtype=torch.int64, device=device)
    req_to_token = forwards.model_runner.req_to_token_pool.req_to_token
    slots = batch.req_pool_indices.to(torch.int64)
    # Positions past the prompt have no slots yet: drafting writes nothing to the pool, so
    # any slot index serves as the forward's out_cache_loc.
    positions = (committed[:, None] + torch.arange(steps_max + 1, device=device)).clamp(
        max=req_to_token.shape[1] - 1)
    round_ = Round(
        k=steps_max, room=[steps_max] * bs, committed=committed,
        committed_cpu=committed.cpu(), slots=[req.kv.req_pool_idx for req in reqs],
        positions=positions, locs=req_to_token[slots[:, None], positions].to(torch.int64),
        tokens=[], grammar=None, penalties=None,
        rows=SamplingRows.from_sampling_info(batch.sampling_info), drafts=[True] * bs)
    drafts: list[list[int]] = [[] for _ in reqs]
    backend.begin_round(round_.slots, prefix, steps_max)
    try:
        requests = [i for i in range(bs) for _ in range(suffix[i])]
        steps = [s for i in range(bs) for s in range(suffix[i])]
        backend.set_rows(requests, steps)
        fb = draft_forward_batch(batch, round_, torch.tensor(requests), torch.tensor(steps),
                                 batch.input_ids.to(torch.int64))
        logits = forwards.draft_logits(backend, fb, bs)
        ends = torch.tensor(suffix).cumsum(0) - 1
        last = logits[ends.to(logits.device)].argmax(-1)
        for i, token in enumerate(last.tolist()):
            drafts[i].append(token)
        # More drafts than the longest request may emit would never be verified.
        wanted = min(MAX_EARLY_DRAFTS, max(room(reqs)))
        while waiting() and len(drafts[0]) < wanted:
            steps = [suffix[i] + len(drafts[i]) - 1 for i in range(bs)]
            backend.set_rows(list(range(bs)), steps)
            fb = draft_forward_batch(batch, round_, torch.arange(bs), torch.tensor(steps),
                                     last)
            last = forwards.draft_logits(backend, fb, bs).argmax(-1)
            for i, token in enumerate(last.tolist()):
                drafts[i].append(token)
    finally:
        backend.end_round()
    return drafts


def prefill_over_exact(forwards: TargetForwards, backend, batch) -> torch.Tensor | None:
    """The last position's logits [bs, V] of each request's uncached suffix, run over the
    exact KV as one verification chain (`backend`: the round's verify backend), its K/V
    written at the slots SGLang allocated for the prefill. Only the suffix's queries are
    computed, where SGLang's CPU extend attends the whole sequence as a square. None when the
    batch's suffixes differ in length (a chain has one width)."""
    width = batch.extend_lens[0]
    if any(n != width for n in batch.extend_lens):
        return None
    device = batch.seq_lens.device
    committed = torch.tensor(batch.prefix_lens, dtype=torch.int64, device=device)
    positions = (committed[:, None] + torch.arange(width, device=device)).reshape(-1)
    fb = chain_forward_batch(batch, batch.input_ids.to(torch.int64), committed,
                             committed.cpu(), positions, batch.out_cache_loc.to(torch.int64),
                             width)
    logits = forwards.logits(backend, fb).next_token_logits
    return logits.view(len(batch.reqs), width, -1)[:, -1]


class Stash:
    """Drafts made before the exact KV, per request, waiting for the rounds that verify them."""

    def __init__(self) -> None:
        self._drafts: dict[str, list[int]] = {}

    def keep(self, rid: str, drafts: list[int], first_token: int) -> None:
        """The prefill over the exact KV emitted `first_token`; `drafts` began there."""
        if drafts and drafts[0] == first_token and len(drafts) > 1:
            self._drafts[rid] = drafts[1:]
        else:
            self._drafts.pop(rid, None)

    def length(self, rids: list[str]) -> int:
        """Drafts a round can take from every one of these requests' stashes (0: draft)."""
        return min((len(self._drafts.get(rid, ())) for rid in rids), default=0)

    def take(self, rids: list[str], k: int, device) -> list[torch.Tensor]:
        """The next `k` drafts of each request, step by step [bs]."""
        return [torch.tensor([self._drafts[rid][j] for rid in rids], device=device)
                for j in range(k)]

    def advance(self, rid: str, k: int, accepted: int, bonus: int) -> None:
        """A round verified `k` stashed drafts of `rid`, accepted `accepted` and emitted
        `bonus` after them: keep what still continues the emitted text."""
        drafts = self._drafts.get(rid)
        if drafts is None:
            return
        if accepted == k and len(drafts) > k and drafts[k] == bonus:
            self._drafts[rid] = drafts[k + 1:]
        else:
            del self._drafts[rid]

    def forget(self, rid: str) -> None:
        self._drafts.pop(rid, None)

    def clear(self) -> None:
        self._drafts.clear()


def recompute_prefixes(forwards: TargetForwards, batch, failed: list[torch.Tensor]) -> None:
    """Some stored pages' exact KV will not come (a store fault): for each request of the
    prefill `batch` whose prefix holds one of their device slots, recompute its prefix from
    the first such page on, by one extend forward over the exact KV before it, written into
    its slots. The prefill that follows then reads exact KV only."""
    bad = torch.cat(failed).to(torch.int64).unique()
    req_to_token = forwards.model_runner.req_to_token_pool.req_to_token
    rows, starts = [], []
    for i, req in enumerate(batch.reqs):
        prefix = req_to_token[req.kv.req_pool_idx, :batch.prefix_lens[i]].to(torch.int64)
        hit = torch.isin(prefix, bad.to(prefix.device)).nonzero()
        if len(hit):
            rows.append(i)
            starts.append(int(hit[0]))
    if len(bad) and not rows:
        logger.error("VeriCache early drafting: %d device slots lost their exact KV outside "
                     "a prefill's prefixes", len(bad))
    if not rows:
        return
    device = batch.seq_lens.device
    ends = [batch.prefix_lens[i] for i in rows]
    pairs = list(zip(rows, starts, ends, strict=True))
    ids = torch.tensor([t for i, a, b in pairs for t in batch.reqs[i].origin_input_ids[a:b]],
                       dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(a, b, device=device) for _, a, b in pairs])
    locs = torch.cat([req_to_token[batch.reqs[i].kv.req_pool_idx, a:b].to(torch.int64)
                      for i, a, b in pairs])
    fb = extend_forward_batch(ids, batch.req_pool_indices[rows].to(device),
                              torch.tensor(ends, dtype=torch.int64, device=device),
                              torch.tensor(starts, dtype=torch.int64, device=device), locs,
                              positions)
    forwards.logits(forwards.model_runner.attn_backend, fb)
