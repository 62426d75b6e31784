"""Choosing draft tokens and verifying them so that every request's output is exactly SGLang's.

A round drafts k tokens with the target model reading the compressed tier (next-token
distributions q_1..q_k) and scores them in one forward over the full KV (p_1..p_{k+1}). The
emitted tokens must follow exactly the distribution plain SGLang samples from: the full
model's logits through the request's temperature, top-k, top-p and min-p as SGLang's sampler
applies them. Three kinds of request may share a batch:

* greedy (top_k == 1, SGLang's encoding of temperature 0): draft argmax q_j, keep the longest
  prefix equal to argmax p_j, then emit argmax p (exactly plain greedy decoding's tokens);
* seeded (`--enable-deterministic-inference` gives every request a `sampling_seed`): the same
  scheme with argmax replaced by SGLang's seeded sampler, a deterministic function of
  (distribution, seed, position). Drafts use the seed's noise at their own positions, so the
  emitted tokens are plain SGLang's seeded tokens one for one;
* sampled: speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft
  d_j ~ q_j; accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection
  emit a token drawn from norm(max(0, p_j - q_j)), and if all k are accepted draw the bonus
  from p_{k+1}. Each emitted token is then distributed exactly as p given the tokens before it.

Unseeded draws use torch's default generator, as SGLang's own unseeded sampling does
(`--random-seed` seeds it). Filtering follows SGLang's `pytorch` sampling backend (the CPU
backend); `rows_sampler_supported` says for which requests these functions reproduce SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.kernels.ops.sampling import softmax as sglang_softmax
from sglang.srt.layers.sampler import (
    Sampler,
    sampling_from_probs_torch,
    top_k_top_p_min_p_sampling_from_probs_torch,
)


@dataclass(frozen=True)
class SamplingRows:
    """One row of sampling parameters per request (or per verified token), as SGLang's
    sampler reads them from `SamplingBatchInfo`."""

    temperatures: torch.Tensor
    """[n] float; SGLang stores 1.0 for greedy requests."""
    top_ks: torch.Tensor
    """[n] int; 1 means greedy, `TOP_K_ALL` no top-k."""
    top_ps: torch.Tensor
    """[n] float."""
    min_ps: torch.Tensor
    """[n] float."""
    need_filter: bool = False
    """Whether any row uses top-k, top-p or min-p (SGLang's `simple_sampling_case` is not)."""
    need_min_p: bool = False
    """Whether any row uses min-p."""
    seeds: torch.Tensor | None = None
    """[n] int64 under deterministic inference (seeded rows), else None (sampled rows)."""
    all_greedy: bool = False
    """Whether every row is greedy (known on the host: no device sync to branch on it)."""

    @classmethod
    def from_sampling_info(cls, info) -> SamplingRows:
        """The rows of a batch's `SamplingBatchInfo`."""
        return cls(
            temperatures=info.temperatures.reshape(-1), top_ks=info.top_ks, top_ps=info.top_ps,
            min_ps=info.min_ps,
            need_filter=bool(info.need_top_k_sampling or info.need_top_p_sampling
                             or info.need_min_p_sampling),
            need_min_p=bool(info.need_min_p_sampling), seeds=info.sampling_seed,
            all_greedy=bool(info.is_all_greedy),
        )

    @property
    def greedy(self) -> torch.Tensor:
        """[n] bool: rows SGLang decodes greedily."""
        return self.top_ks <= 1

    @property
    def any_sampled(self) -> bool:
        """Whether some row needs rejection sampling (random draws, no seed)."""
        return not self.all_greedy and self.seeds is None

    @property
    def sampled(self) -> torch.Tensor:
        """[n] bool: the rows that need rejection sampling."""
        return ~self.greedy if self.any_sampled else torch.zeros_like(self.greedy)

    def repeat(self, times: int) -> SamplingRows:
        """Each row `times` times in a row: the rows of a verify forward's tokens."""
        return self.take(torch.arange(len(self.top_ks), device=self.top_ks.device)
                         .repeat_interleave(times))

    def take(self, index: torch.Tensor) -> SamplingRows:
        """Rows `index` [m] of these (a row may repeat)."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return SamplingRows(pick(self.temperatures), pick(self.top_ks), pick(self.top_ps),
                            pick(self.min_ps), self.need_filter, self.need_min_p,
                            pick(self.seeds), self.all_greedy)


def rows_sampler_supported(sampler, info, backend: str | None) -> list[bool]:
    """For each row of the batch: whether the functions here choose its tokens exactly as
    `sampler` (the model runner's SGLang `Sampler`) would. Logit-changing features
    (penalties, bias, grammars, custom processors) are the caller's to check; this covers the
    sampler itself and the steps SGLang's `ModelRunner.sample` adds around it. Most limits
    hold for the whole batch; only filtering on a fused backend leaves the greedy rows."""
    rows = len(info.temperatures)
    if (type(sampler) is not Sampler  # a registered custom sampler backend
            or getattr(info, "has_watermark_candidates", False)  # rewrites logits
            or getattr(info, "sampling_mask_batch_indices", None) is not None):  # supports
        return [False] * rows
    if info.is_all_greedy:
        return [True] * rows
    if sampler.use_ascend_backend or sampler.rl_on_policy_target is not None:
        return [False] * rows  # these sample from temperature-scaled logits (or bf16 logprobs)
    if info.sampling_seed is not None and info.need_min_p_sampling:
        return [False] * rows  # SGLang's seeded sampler rejects min-p
    needs_filter = (info.need_top_k_sampling or info.need_top_p_sampling
                    or info.need_min_p_sampling)
    # Filtering is reproduced as the pytorch backend does it; flashinfer's fused kernels
    # (the CUDA default) could differ at cut-off ties and orders min-p after top-p, and
    # filter every sampled row of a batch that needs it.
    if not needs_filter or backend == "pytorch":
        return [True] * rows
    return (info.top_ks.reshape(-1) <= 1).tolist()


def softmax_probs(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """softmax(logits / temperature) [n, V], the way SGLang's sampler computes it (before
    top-k/top-p/min-p), without modifying `logits`."""
    scaled = logits / rows.temperatures.view(-1, 1)
    if rows.seeds is not None:  # deterministic inference uses torch's softmax
        return torch.softmax(scaled, dim=-1)
    return sglang_softmax(scaled)


def filtered_probs(probs: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """The distribution [n, V] SGLang's sampler draws from: `probs` cut by top-k, top-p and
    min-p exactly as SGLang's pytorch backend cuts them (its own function does the cutting),
    renormalized."""
    if not rows.need_filter:
        return probs
    # SGLang's function also draws a token (from the default generator); only its filtered,
    # sorted weights and their token ids are used here.
    _, weights, token_ids, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        probs, rows.top_ks, rows.top_ps, rows.min_ps, rows.need_min_p, None,
        torch.zeros(len(probs), dtype=torch.int64, device=probs.device),
        return_filtered_probs=True,
    )
    out = torch.zeros_like(probs).scatter_(1, token_ids.to(torch.int64), weights)
    return out / out.sum(dim=-1, keepdim=True)


def _seeded_tokens(probs: torch.Tensor, rows: SamplingRows,
                   positions: torch.Tensor) -> torch.Tensor:
    """SGLang's seeded sampler (deterministic inference) on unfiltered `probs` [n, V]."""
    if not rows.need_filter:
        tokens = sampling_from_probs_torch(probs, rows.seeds, positions)
    else:
        tokens = top_k_top_p_min_p_sampling_from_probs_torch(
            probs, rows.top_ks, rows.top_ps, rows.min_ps, rows.need_min_p, rows.seeds,
            positions,
        )
    return tokens.reshape(-1).to(torch.int64)


def chosen_tokens(logits: torch.Tensor, rows: SamplingRows,
                  positions: torch.Tensor) -> torch.Tensor:
    """The token [n] a greedy or seeded row takes from `logits` [n, V] at `positions` [n]
    (the position of the token whose logits these are); rows that sample get the argmax,
    which callers replace."""
    tokens = torch.argmax(logits, dim=-1).to(torch.int64)
    if rows.seeds is None or rows.all_greedy:
        return tokens
    seeded = _seeded_tokens(softmax_probs(logits, rows), rows, positions)
    return torch.where(rows.greedy, tokens, seeded)


def draft_tokens(logits: torch.Tensor, rows: SamplingRows,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft step: each request's draft token [bs] from the draft logits [bs, V], and the
    draft distribution q [bs, V] verification needs (None when no row samples)."""
    tokens = chosen_tokens(logits, rows, positions)
    if not rows.any_sampled:
        return tokens, None
    q = filtered_probs(softmax_probs(logits, rows), rows)
    drawn = torch.multinomial(q, num_samples=1).squeeze(1)
    return torch.where(rows.sampled, drawn, tokens), q


def check_proposals(logits: torch.Tensor, rows: SamplingRows, positions: torch.Tensor,
                    proposals: list[list[int]]
                    ) -> list[tuple[list[int], torch.Tensor | None]]:
    """Level 1's check of each request's deterministic proposal (a point mass).

    logits [sum of w_r, V]: level 1's logits at each request's last draft and at each of its
    proposed tokens (request r owns the next w_r = len(proposals[r]) + 1 rows), with the rows'
    sampling `rows` and `positions` (of the tokens whose logits these are). Returns, per
    request, the tokens level 1 adds to its draft (a kept prefix of the proposal and one token
    of its own) and, for a request that samples, the distribution q each added token follows
    ([added, V], what verification needs), else None.

    Greedy and seeded requests keep the proposed tokens equal to their own choice: the draft is
    the one one-token steps make; their kept prefixes are found with tensor operations over
    all rows and reach the host in one copy (the drafter proposes from host tokens). A
    sampling request keeps proposed p with probability q(p) and at the first rejection draws
    from q without p (speculative sampling against a point mass), so each added token follows
    q exactly given the tokens before it; sampling requests draw one by one, in order.
    """
    device = logits.device
    sizes = [len(p) + 1 for p in proposals]
    widths = torch.tensor(sizes, device=device)
    starts = widths.cumsum(0) - widths
    request = torch.repeat_interleave(torch.arange(len(proposals), device=device), widths,
                                      output_size=sum(sizes))
    offset = torch.arange(sum(sizes), device=device) - starts[request]
    # The proposed token each row's logits are checked against; none (-1) after the last.
    proposed = torch.tensor([t for p in proposals for t in (*p, -1)], device=device)
    chosen = chosen_tokens(logits, rows, positions)
    # Kept: the offset of each request's first row whose choice differs from the proposal.
    kept = torch.full_like(widths, max(sizes)).scatter_reduce_(
        0, request, torch.where(chosen == proposed, max(sizes), offset), "amin")
    kept_host, own = torch.stack([kept, chosen[starts + kept]]).tolist()
    sampled = (rows.sampled[starts].tolist() if rows.any_sampled
               else [False] * len(proposals))
    checked, begin = [], 0
    for r, proposal in enumerate(proposals):
        end = begin + len(proposal) + 1
        if sampled[r]:
            checked.append(_sample_proposal(
                logits[begin:end], rows.take(torch.arange(begin, end, device=device)), proposal))
        else:
            checked.append(([*proposal[: kept_host[r]], own[r]], None))
        begin = end
    return checked


def _sample_proposal(logits: torch.Tensor, rows: SamplingRows,
                     proposal: list[int]) -> tuple[list[int], torch.Tensor]:
    """A sampling request's check: keep proposed p with probability q(p), at the first
    rejection draw from q without p."""
    q = filtered_probs(softmax_probs(logits, rows), rows)
    added = []
    for j, token in enumerate(proposal):
        if torch.rand(()) < q[j, token]:
            added.append(token)
            continue
        rest = q[j].clone()
        rest[token] = 0
        added.append(int(torch.multinomial(rest / rest.sum(), 1)))
        return added, q[: j + 1]
    added.append(int(torch.multinomial(q[len(proposal)], 1)))
    return added, q[: len(proposal) + 1]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis: what a rejected draft is replaced from, so that
    accepted and replaced tokens together follow p. Where p <= q everywhere (p == q up to
    rounding, so no draft can be rejected but through rounding) it is p itself."""
    residual = (p - q).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                     uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling of one round.

    p [bs, k+1, V]: the full model's distributions at the k drafts and after them;
    q [bs, k, V]: the draft distributions the drafts [bs, k] were drawn from;
    uniforms [bs, k] in [0, 1): the acceptance draws (drawn here when None).
    Returns (accepted [bs], tokens [bs, k+1]): each request emits its first `accepted`
    drafts and then tokens[accepted], drawn from the residual at the first rejection or from
    p_{k+1} when every draft is accepted.
    """
    bs, k = drafts.shape
    rows = torch.arange(bs, device=p.device)
    if k == 0:
        accepted = torch.zeros(bs, dtype=torch.int64, device=p.device)
        emitted_from = p[:, 0]
    else:
        index = drafts.unsqueeze(-1)
        p_draft = p[:, :k].gather(2, index).squeeze(-1)
        q_draft = q.gather(2, index).squeeze(-1)  # > 0: each draft was drawn from q
        if uniforms is None:
            uniforms = torch.rand(bs, k, device=p.device)
        # u < p/q, i.e. accepted with probability min(1, p/q), without dividing.
        accept = uniforms.float() * q_draft.float() < p_draft.float()
        accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
        # At the bonus position (accepted == k) there is no draft: q counts as zero there.
        q_at = q[rows, accepted.clamp(max=k - 1)] * (accepted < k).to(q.dtype)[:, None]
        emitted_from = residual_distribution(p[rows, accepted], q_at)
    emitted = torch.multinomial(emitted_from, num_samples=1).squeeze(1)
    tokens = torch.cat([drafts, emitted[:, None]], dim=1)
    tokens[rows, accepted] = emitted
    return accepted, tokens


def sample_against_draft(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """One position of speculative rejection sampling, with no bonus after it: keep each
    draft [n] (drawn from q [n, V]) with probability min(1, p/q), else draw from the
    residual. The token [n] follows p [n, V], and equals the draft with probability
    sum(min(p, q)), where an independent draw from p would with only sum(p q)."""
    _, tokens = rejection_sample(torch.stack([p, p], dim=1), q[:, None], drafts[:, None])
    return tokens[:, 0]


def verify_tokens(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                  rows: SamplingRows, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept or reject one round's drafts [bs, k] from the verify logits [bs, k+1, V] at
    token positions [bs, k+1]; `draft_probs` [bs, k, V] stacks `draft_tokens`' q of each step
    (None when no row samples, or k == 0).

    Returns (accepted [bs], tokens [bs, k+1]): a request emits tokens[:accepted + 1] (its
    accepted drafts, then the full model's own token). Greedy and seeded rows accept the
    longest prefix the full model would have chosen itself; sampled rows are rejection
    sampled."""
    bs, width, vocab = logits.shape
    flat_rows = rows.repeat(width)
    flat_logits = logits.reshape(bs * width, vocab)
    tokens = chosen_tokens(flat_logits, flat_rows, positions.reshape(-1)).view(bs, width)
    matches = (drafts == tokens[:, :-1]).to(torch.int64)
    accepted = matches.cumprod(dim=1).sum(dim=1)
    if not rows.any_sampled:
        return accepted, tokens
    if draft_probs is None:  # k == 0: the round only samples the full model's next token
        draft_probs = logits.new_zeros(bs, 0, vocab)
    p = filtered_probs(softmax_probs(flat_logits, flat_rows), flat_rows).view(bs, width, vocab)
    sampled_accepted, sampled_tokens = rejection_sample(p, draft_probs, drafts)
    sampled = rows.sampled
    return (torch.where(sampled, sampled_accepted, accepted),
            torch.where(sampled[:, None], sampled_tokens, tokens))
