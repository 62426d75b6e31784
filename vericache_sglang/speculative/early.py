"""Drafting before a stored prefix's exact KV has arrived (`--vericache-early-drafting`).

A prefill whose prefix pages came from the store on their drafting level (`stores/pending.py`)
cannot run over the full KV until their exact part is written there. Meanwhile the worker
drafts over the compressed tier, which already holds those pages (installed from the stream):

1. one forward runs the prompt's uncached suffix over the compressed prefix, its K/V in the
   draft backend's scratch tail; its last position's token is the first draft;
2. one-token draft steps follow while the exact pages are still on their way (the number of
   steps is the time they still need, measured by asking after each step, capped at
   `MAX_EARLY_DRAFTS`): one after each step of the running batch while the prefill is parked
   beside it (`parking.py`), back to back at the barrier when nothing else runs.

Drafts are chosen as a round's are (`sampling.draft_tokens`): greedy requests take the
token their sampler would, sampled requests draw from the draft distribution q, which is
kept for verification, and a grammar masks every draft step (its matcher advances over the
drafts and is rolled back after them).

Then the barrier writes the exact KV, and the suffix runs over it as one verification chain
(`prefill_over_exact`): SGLang's own sampler takes the first output token from the logits at
its last position, as in its own prefill (grammar mask, temperature, filters); a sampled
request's first draft is instead kept or replaced by rejection sampling there
(`first_tokens`). When that token is the first draft, the drafts after it are the request's
stash (`Stash`): the following decode rounds verify them over the full KV instead of drafting,
`--vericache-max-draft-length` at a time (greedy: the longest prefix the sampler would choose;
sampled: rejection sampling against the kept q), until one is rejected. So every emitted token
still comes from a forward over the exact KV. Requests with a seed, penalties, a logit bias, a
custom logit processor or logprobs wait at the barrier without drafting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vericache_sglang.attention.draft import DraftAttnBackend
from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.speculative.forwards import (
    TargetForwards,
    chain_forward_batch,
    draft_forward_batch,
    extend_forward_batch,
)
from vericache_sglang.speculative.grammar import RoundGrammar
from vericache_sglang.speculative.round import Round, room
from vericache_sglang.speculative.sampling import (
    SamplingRows,
    draft_tokens,
    filtered_probs,
    sample_against_draft,
    softmax_probs,
)

MAX_EARLY_DRAFTS = 256
"""Drafts a request makes at most before its exact KV arrives."""
MAX_EARLY_SAMPLED_DRAFTS = 64
"""The same for a batch with sampled requests: each of their drafts keeps its distribution q
(vocabulary-sized) until verified."""
MAX_SUFFIX = 512
"""Longer uncached suffixes are not drafted over the compressed prefix (the scratch tail
holds the suffix too)."""


def can_draft_early(batch, drafting: list[bool]) -> bool:
    """Whether this prefill batch's requests may draft before the exact KV: whole prompts
    whose rounds would draft (`drafting`: `eligibility.drafting_rows`), greedy or sampled,
    without a seed, penalties, a logit bias or logprobs."""
    info = batch.sampling_info
    # Seeded requests (deterministic inference) wait: no test yet compares their output
    # with plain SGLang's through this path.
    return (all(drafting) and info.sampling_seed is None
            and not batch.return_logprob and not batch.return_hidden_states
            and not (info.penalizer_orchestrator and info.penalizer_orchestrator.is_required)
            and info.logit_bias is None
            and all(req.extend_end == len(req.origin_input_ids) for req in batch.reqs)
            and 0 < max(batch.extend_lens) <= MAX_SUFFIX)


@dataclass
class EarlyDrafts:
    """Each request's drafts after its prompt, and for sampled requests the distribution q
    each was drawn from ([V], None for the others)."""

    tokens: list[list[int]]
    probs: list[list[torch.Tensor] | None]


class EarlyDrafting:
    """One prefill batch's drafting over the compressed prefix while its exact KV is on its
    way, a step at a time, so that the steps can run between the running batch's rounds
    (`parking.py`) or back to back at the barrier. `backend` is this drafting's own: its
    scratch tail lives across the rounds that run in between."""

    def __init__(self, forwards: TargetForwards, backend: DraftAttnBackend, batch) -> None:
        self.batch = batch
        self._forwards = forwards
        self._backend = backend
        reqs = batch.reqs
        bs = len(reqs)
        device = batch.seq_lens.device
        self._device = device
        self._suffix = list(batch.extend_lens)
        self._rows = SamplingRows.from_sampling_info(batch.sampling_info)
        self._sampled = self._rows.sampled.tolist()
        cap = MAX_EARLY_SAMPLED_DRAFTS if any(self._sampled) else MAX_EARLY_DRAFTS
        # More drafts than the longest request may emit would never be verified.
        self._wanted = min(cap, max(room(reqs)))
        steps_max = max(self._suffix) + self._wanted  # the scratch tail holds them all
        prefix = list(batch.prefix_lens)
        self._committed = torch.tensor(prefix, dtype=torch.int64, device=device)
        req_to_token = forwards.model_runner.req_to_token_pool.req_to_token
        slots = batch.req_pool_indices.to(torch.int64)
        # Positions past the prompt have no slots yet: drafting writes nothing to the pool,
        # so any slot index serves as the forward's out_cache_loc.
        positions = (self._committed[:, None]
                     + torch.arange(steps_max + 1, device=device)).clamp(
            max=req_to_token.shape[1] - 1)
        self._round = Round(
            k=steps_max, room=[steps_max] * bs, committed=self._committed,
            committed_cpu=self._committed.cpu(), slots=[req.kv.req_pool_idx for req in reqs],
            positions=positions, locs=req_to_token[slots[:, None], positions].to(torch.int64),
            tokens=[], grammar=None, penalties=None, rows=self._rows, drafts=[True] * bs)
        self._grammar = RoundGrammar.for_batch(reqs, batch.sampling_info.vocab_size,
                                               self._wanted + 1)
        self.drafts = EarlyDrafts([[] for _ in reqs], [[] if s else None for s in self._sampled])
        self._last: torch.Tensor | None = None
        backend.begin_round(self._round.slots, prefix, steps_max)

    @property
    def done(self) -> bool:
        """Whether the batch has drafted all it may."""
        return len(self.drafts.tokens[0]) >= self._wanted

    def step(self) -> None:
        """One drafting forward: the first runs the prompts' uncached suffixes over the
        compressed prefix (their last positions give the first drafts), each later one a
        token per request."""
        bs = len(self.batch.reqs)
        if self._last is None:
            requests = [i for i in range(bs) for _ in range(self._suffix[i])]
            steps = [s for i in range(bs) for s in range(self._suffix[i])]
            self._backend.set_rows(requests, steps)
            fb = draft_forward_batch(self.batch, self._round, requests, steps,
                                     self._suffix_ids())
            logits = self._forwards.draft_logits(self._backend, fb, bs)
            ends = torch.tensor(self._suffix).cumsum(0) - 1
            self._last = self._choose(logits[ends.to(logits.device)],
                                      [n - 1 for n in self._suffix])
            return
        steps = [self._suffix[i] + len(self.drafts.tokens[i]) - 1 for i in range(bs)]
        self._backend.set_rows(list(range(bs)), steps)
        fb = draft_forward_batch(self.batch, self._round, list(range(bs)), steps, self._last)
        self._last = self._choose(self._forwards.draft_logits(self._backend, fb, bs), steps)

    def _suffix_ids(self) -> torch.Tensor:
        """The prompts' uncached suffixes, one after the other. Until the scheduler runs the
        batch (a parked batch), they are still in SGLang's host staging."""
        ids = self.batch.input_ids
        if ids is None:
            ids = self.batch.prefill_input_ids_cpu.to(self._device)
        return ids.to(torch.int64)

    def _choose(self, logits: torch.Tensor, steps: list[int]) -> torch.Tensor:
        """Each request's next draft from its logits [bs, V] at suffix step `steps[i]`."""
        if self._grammar is not None:
            self._grammar.constrain_draft(logits, len(self.drafts.tokens[0]))
        token, q = draft_tokens(logits, self._rows,
                                self._committed + torch.tensor(steps, device=self._device))
        for i, t in enumerate(token.tolist()):
            self.drafts.tokens[i].append(t)
            if self._sampled[i]:
                # Its own row: a view would keep the step's whole [bs, V] (greedy rows too)
                # alive in the stash.
                self.drafts.probs[i].append(q[i].clone())
        if self._grammar is not None:
            self._grammar.advance(token)
        return token

    def finish(self) -> EarlyDrafts:
        """The drafts; the scratch tail is dropped and the grammar rolled back."""
        self._backend.end_round()
        if self._grammar is not None:
            self._grammar.finish_drafting()
        return self.drafts

    def run(self, waiting: Callable[[], bool]) -> EarlyDrafts:
        """Draft back to back while `waiting()` says the exact KV is still on its way (the
        first step always runs), then finish."""
        try:
            if self._last is None:
                self.step()
            while waiting() and not self.done:
                self.step()
        finally:
            drafts = self.finish()
        return drafts


def first_tokens(logits: torch.Tensor, tokens: torch.Tensor, batch,
                 drafts: EarlyDrafts) -> torch.Tensor:
    """Each request's first output token [bs]: `tokens`, SGLang's sampler's from the prefill's
    last logits (`logits`: a copy taken before the sampler masked them), but for sampled
    requests their first draft kept or replaced by speculative rejection sampling against p
    there (`sample_against_draft`). Either way the token follows p; the draft survives, and
    with it the stash, with probability sum(min(p, q)) instead of sum(p q)."""
    rows = SamplingRows.from_sampling_info(batch.sampling_info)
    if not rows.any_sampled:
        return tokens
    grammar = RoundGrammar.for_batch(batch.reqs, batch.sampling_info.vocab_size, 1)
    if grammar is not None:  # the mask SGLang's sampler applied (nothing drafted yet)
        grammar.constrain_draft(logits, 0)
    p = filtered_probs(softmax_probs(logits, rows), rows)
    q = torch.stack([probs[0] if probs else p.new_zeros(p.shape[-1])
                     for probs in drafts.probs])
    first = torch.tensor([chain[0] for chain in drafts.tokens], device=tokens.device)
    return torch.where(rows.sampled, sample_against_draft(p, q, first), tokens.reshape(-1))


def prefill_over_exact(forwards: TargetForwards, backend, batch) -> torch.Tensor | None:
    """The last position's logits [bs, V] of each request's uncached suffix (not yet masked
    or sampled), run over the exact KV as one verification chain (`backend`: the round's
    verify backend), its K/V written at the slots SGLang allocated for the prefill. Only the
    suffix's queries are computed, where SGLang's CPU extend attends the whole sequence as a
    square. None when the batch's suffixes differ in length (a chain has one width)."""
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
    """Drafts made before the exact KV, per request, waiting for the rounds that verify them;
    for a sampled request also the distribution q each was drawn from."""

    def __init__(self) -> None:
        self._drafts: dict[str, list[int]] = {}
        self._probs: dict[str, list[torch.Tensor]] = {}

    def keep(self, rid: str, drafts: list[int], first_token: int,
             probs: list[torch.Tensor] | None = None) -> None:
        """The prefill over the exact KV emitted `first_token`; `drafts` began there
        (`probs`: their q, a sampled request's)."""
        self.forget(rid)
        if drafts and drafts[0] == first_token and len(drafts) > 1:
            self._drafts[rid] = drafts[1:]
            if probs is not None:
                self._probs[rid] = probs[1:]

    def length(self, rids: list[str]) -> int:
        """Drafts a round can take from every one of these requests' stashes (0: draft)."""
        return min((len(self._drafts.get(rid, ())) for rid in rids), default=0)

    def take(self, rids: list[str], k: int, device) -> list[torch.Tensor]:
        """The next `k` drafts of each request, step by step [bs]."""
        return [torch.tensor([self._drafts[rid][j] for rid in rids], device=device)
                for j in range(k)]

    def take_probs(self, rids: list[str], k: int, vocab: int, device) -> list[torch.Tensor]:
        """q of the next `k` drafts, step by step [bs, V] (float32, as `draft_tokens` makes
        them): zeros for requests that do not sample (verification reads q only for the ones
        that do)."""
        zeros = torch.zeros(vocab, device=device)
        return [torch.stack([self._probs[rid][j] if rid in self._probs else zeros
                             for rid in rids]) for j in range(k)]

    def advance(self, rid: str, k: int, accepted: int, bonus: int) -> None:
        """A round verified `k` stashed drafts of `rid`, accepted `accepted` and emitted
        `bonus` after them: keep what still continues the emitted text. (A sampled request's
        later drafts were drawn from their q given the drafts before them, independently of
        verification's draws, so they remain valid drafts after a bonus equal to the next.)"""
        drafts = self._drafts.get(rid)
        if drafts is None:
            return
        if accepted == k and len(drafts) > k and drafts[k] == bonus:
            self._drafts[rid] = drafts[k + 1:]
            if rid in self._probs:
                self._probs[rid] = self._probs[rid][k + 1:]
        else:
            self.forget(rid)

    def nbytes(self) -> int:
        """Device bytes the kept q hold, from their storages (each counted once)."""
        return storage_bytes(q for probs in self._probs.values() for q in probs)

    def forget(self, rid: str) -> None:
        self._drafts.pop(rid, None)
        self._probs.pop(rid, None)

    def clear(self) -> None:
        self._drafts.clear()
        self._probs.clear()


def recompute_prefixes(forwards: TargetForwards, batch,
                       failed: list[torch.Tensor]) -> torch.Tensor:
    """Some stored pages' exact KV will not come (a store fault, `failed`: their device
    slots, each inside the prefill `batch`'s prefixes): for each request whose prefix holds
    one of them, recompute its prefix from the first such slot on, by one extend forward over
    the exact KV before it, written into its slots. The prefill that follows then reads exact
    KV only. Returns the slots recomputed."""
    bad = torch.cat(failed).to(torch.int64).unique()
    req_to_token = forwards.model_runner.req_to_token_pool.req_to_token
    rows, starts = [], []
    for i, req in enumerate(batch.reqs):
        prefix = req_to_token[req.kv.req_pool_idx, :batch.prefix_lens[i]].to(torch.int64)
        hit = torch.isin(prefix, bad.to(prefix.device)).nonzero()
        if len(hit):
            rows.append(i)
            starts.append(int(hit[0]))
    if not rows:
        return torch.empty(0, dtype=torch.int64)
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
    return locs.cpu()
