"""Drafting a round's k tokens over the compressed tier: one-token steps of the target model
(level 1), or a level-2 drafter's proposals checked by level 1 (stacked drafting).

Nothing here writes the KV pool: the drafts' own K/V live in the draft backend's scratch tail
for the round (`attention/draft.py`). Each function fills `round_.tokens` with d1..dk, and
`round_.draft_probs` with q of each step for the requests that sample (`sampling.py`).
"""

from __future__ import annotations

from functools import partial

import torch

from vericache_sglang.attention.draft import DraftAttnBackend
from vericache_sglang.speculative.drafter import Drafter
from vericache_sglang.speculative.forwards import TargetForwards, draft_forward_batch
from vericache_sglang.speculative.grammar import RoundGrammar
from vericache_sglang.speculative.policy import DraftLengthPolicy
from vericache_sglang.speculative.round import Round
from vericache_sglang.speculative.sampling import check_proposals, draft_tokens


def draft_steps(forwards: TargetForwards, backend: DraftAttnBackend, batch,
                round_: Round) -> None:
    """k one-token forwards over the compressed KV (under each request's grammar, if it has
    one)."""
    bs, grammar = len(batch.reqs), round_.grammar
    every = list(range(bs))
    backend.begin_round(round_.slots, round_.committed_host, round_.k)
    round_.forwards = [round_.k] * bs
    try:
        for step in range(round_.k):
            backend.set_step(step)
            fb = draft_forward_batch(batch, round_, every, [step] * bs, round_.tokens[-1])
            logits = forwards.draft_logits(backend, fb, bs)
            round_.constrain(logits, every, [step] * bs,
                             partial(RoundGrammar.constrain_draft, logits=logits, step=step))
            token, q = draft_tokens(logits, round_.rows, round_.positions[:, step])
            round_.tokens.append(token)
            round_.draft_probs.append(q)
            if grammar is not None:
                grammar.advance(token)
        round_.round_buffer_bytes = backend.round_buffer_bytes()
    finally:
        backend.end_round()
        if grammar is not None:
            grammar.finish_drafting()


def draft_stacked(forwards: TargetForwards, backend: DraftAttnBackend, drafter: Drafter,
                  policy: DraftLengthPolicy, batch, round_: Round) -> None:
    """Level 2 proposes, level 1 checks: each forward over the compressed tier runs a
    request's last draft and the drafter's proposals after it, keeps a prefix of the
    proposals and appends a token of level 1's own (`sampling.check_proposals`: greedy and
    seeded requests get exactly the drafts one-token steps make, sampling requests drafts
    that follow level 1's distribution q, recorded for verification), until every request
    has k drafts. Rejected proposals' K/V stay in the round's scratch tail past the
    request's draft and are overwritten by its next forward; nothing reaches the KV pool.

    The drafter proposes from host tokens, so each forward's kept tokens come to the host
    (one copy per forward, `check_proposals`)."""
    reqs, k, bs, grammar = batch.reqs, round_.k, len(batch.reqs), round_.grammar
    rids = [req.rid for req in reqs]
    drafter.observe(reqs)
    depth = drafter.context
    bases = [[*req.origin_input_ids[-depth:], *req.output_ids[-depth:]][-depth:]
             for req in reqs]
    base_lens = [len(req.origin_input_ids) + len(req.output_ids) for req in reqs]
    chains: list[list[int]] = [[] for _ in reqs]
    probs: list[list[torch.Tensor]] = [[] for _ in reqs]  # q of each draft (sampling)
    last = round_.tokens[0].tolist()
    device = round_.committed.device
    backend.begin_round(round_.slots, round_.committed_host, k)
    try:
        active = list(range(bs))
        while active:
            lengths = [min(policy.length(rids[i]), k - len(chains[i]) - 1) for i in active]
            proposals = (drafter.propose(
                [rids[i] for i in active], [(bases[i] + chains[i])[-depth:] for i in active],
                [base_lens[i] + len(chains[i]) for i in active], lengths)
                if any(lengths) else [[] for _ in active])
            requests, steps, ids = [], [], []
            for i, proposal in zip(active, proposals, strict=True):
                for j, token in enumerate([last[i], *proposal]):
                    requests.append(i)
                    steps.append(len(chains[i]) + j)
                    ids.append(token)
            backend.set_rows(requests, steps)
            fb = draft_forward_batch(batch, round_, requests, steps,
                                     torch.tensor(ids, device=device))
            logits = forwards.draft_logits(backend, fb, bs)
            offered = dict(zip(active, proposals, strict=True))
            round_.constrain(
                logits, requests, steps,
                partial(RoundGrammar.constrain_proposals, logits=logits, checks=[
                    (i, len(chains[i]), proposal)
                    for i, proposal in zip(active, proposals, strict=True)]),
                [chain + offered.get(i, []) for i, chain in enumerate(chains)])
            rows = round_.rows.take(torch.tensor(requests, device=device))
            checked = check_proposals(logits, rows, fb.positions, proposals)
            for i, proposal, (added, q) in zip(active, proposals, checked, strict=True):
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
                    policy.update(rids[i], len(proposal), kept)
            active = [i for i in active if len(chains[i]) < k]
        round_.round_buffer_bytes = backend.round_buffer_bytes()
    finally:
        backend.end_round()
        if grammar is not None:
            grammar.finish_drafting()
    round_.tokens.extend(torch.tensor([chain[step] for chain in chains], device=device)
                         for step in range(k))
    if round_.rows.any_sampled:
        # Verification reads q only for the requests that sample; the others get zeros.
        zeros = logits.new_zeros(logits.shape[-1])
        round_.draft_probs = [torch.stack([q[step] if q else zeros for q in probs])
                              for step in range(k)]
