"""Speculative sampling (`vericache_sglang.speculative.sampling`) on plain tensors (no server,
no model).

* One round of rejection sampling emits exactly the full model's distribution: computed
  exactly (one and two draft positions), checked by a seeded Monte-Carlo run, and over whole
  multi-round generations of a small Markov "model" driven the way the worker drives it.
* Greedy requests keep the greedy rule (longest prefix equal to the argmax, plus the argmax),
  also in a batch with sampled requests; seeded requests emit plain seeded sampling's tokens.
* Temperature, top-k, top-p and min-p give the distribution SGLang's own sampler draws from.

Random draws are seeded, so every run computes the same statistics. The chi-square tests
reject at p < 1e-4: under a correct implementation a fresh seed would fail one of them with
probability below 1e-3 (at most 10 such tests).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from scipy import stats
from sglang.srt.layers import sampler as sglang_sampler
from sglang.srt.sampling.sampling_params import TOP_K_ALL

from tests.support.servers import vericache_server_args
from vericache_sglang.speculative import algorithm
from vericache_sglang.speculative.sampling import (
    SamplingRows,
    check_proposals,
    chosen_tokens,
    draft_tokens,
    filtered_probs,
    rejection_sample,
    residual_distribution,
    rows_sampler_supported,
    sample_against_draft,
    softmax_probs,
    verify_tokens,
)

ALPHA = 1e-4  # per chi-square test; see the module docstring


def make_rows(temperatures, top_ks=None, top_ps=None, min_ps=None, seeds=None) -> SamplingRows:
    """Rows as `SamplingBatchInfo.from_schedule_batch` builds them from request parameters
    (temperature 0 becomes temperature 1 with top_k 1, as SGLang's SamplingParams does)."""
    n = len(temperatures)
    top_ks = list(top_ks or [TOP_K_ALL] * n)
    temps = list(temperatures)
    for i, t in enumerate(temps):
        if t == 0:
            temps[i], top_ks[i] = 1.0, 1
    top_ps = list(top_ps or [1.0] * n)
    min_ps = list(min_ps or [0.0] * n)
    info = SimpleNamespace(
        temperatures=torch.tensor(temps).view(-1, 1),
        top_ks=torch.tensor(top_ks, dtype=torch.int32), top_ps=torch.tensor(top_ps),
        min_ps=torch.tensor(min_ps),
        is_all_greedy=all(k <= 1 for k in top_ks),
        need_top_k_sampling=any(k != TOP_K_ALL for k in top_ks),
        need_top_p_sampling=any(p != 1.0 for p in top_ps),
        need_min_p_sampling=any(m > 0 for m in min_ps),
        sampling_seed=None if seeds is None else torch.tensor(seeds, dtype=torch.int64),
    )
    return SamplingRows.from_sampling_info(info)


def chi2_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Goodness of fit of counts to probabilities; cells expecting fewer than 5 are pooled."""
    observed = observed.double().flatten()
    expected = expected_probs.double().flatten()
    expected = expected / expected.sum() * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    assert (obs[~keep] == 0).all(), "a draw fell where the distribution has no mass"
    if int(keep.sum()) == 1:
        return 1.0  # a single possible outcome, and every draw took it
    return float(stats.chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue)


def random_pair(gen: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random p and q with some zero entries each (so supports differ)."""
    p = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
    q = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
    p[torch.rand(vocab, generator=gen) < 0.25] = 0
    q[torch.rand(vocab, generator=gen) < 0.25] = 0
    p[0] += 1e-3
    q[1] += 1e-3
    return p / p.sum(), q / q.sum()


def accept_prob(p: torch.Tensor, q: torch.Tensor, x: int) -> torch.Tensor:
    return torch.clamp(p[x] / q[x], max=1.0)


# -- exactness of one round ----------------------------------------------------------------

def test_one_draft_emits_p_exactly():
    """P(emit x) = q(x) min(1, p(x)/q(x)) + P(reject) residual(x) equals p(x), for random
    pairs (different supports), identical pairs and disjoint supports."""
    gen = torch.Generator().manual_seed(0)
    pairs = [random_pair(gen, 7) for _ in range(300)]
    p = torch.tensor([0.5, 0.5, 0, 0], dtype=torch.float64)
    pairs += [(p, p.clone()), (p, p.flip(0))]
    for p, q in pairs:
        emitted = torch.zeros_like(p)
        rejected = torch.zeros((), dtype=p.dtype)
        for d in range(len(p)):
            if q[d] > 0:
                emitted[d] += q[d] * accept_prob(p, q, d)
                rejected += q[d] * (1 - accept_prob(p, q, d))
        emitted += rejected * residual_distribution(p, q)
        torch.testing.assert_close(emitted, p, atol=1e-12, rtol=0)


def test_two_drafts_emit_p_exactly():
    """Two draft positions whose distributions depend on the first draft: the first two
    emitted tokens follow p1(x1) p2(x2 | x1) exactly (after a first rejection the second token
    comes from the next round, exact by the one-draft case)."""
    gen = torch.Generator().manual_seed(1)
    vocab = 5
    for _ in range(30):
        p1, q1 = random_pair(gen, vocab)
        p2, q2 = zip(*[random_pair(gen, vocab) for _ in range(vocab)], strict=True)
        joint = torch.zeros(vocab, vocab, dtype=torch.float64)
        for d1 in range(vocab):
            if q1[d1] == 0:
                continue
            a1 = accept_prob(p1, q1, d1)
            # d1 rejected: x1 from the residual, x2 from p2(. | x1).
            res1 = residual_distribution(p1, q1)
            joint += q1[d1] * (1 - a1) * res1[:, None] * torch.stack(p2)
            # d1 accepted: x2 is d2 accepted, or the residual of p2, q2 given d1.
            for d2 in range(vocab):
                if q2[d1][d2] > 0:
                    a2 = accept_prob(p2[d1], q2[d1], d2)
                    joint[d1, d2] += q1[d1] * a1 * q2[d1][d2] * a2
                    joint[d1] += (q1[d1] * a1 * q2[d1][d2] * (1 - a2)
                                  * residual_distribution(p2[d1], q2[d1]))
        torch.testing.assert_close(joint, p1[:, None] * torch.stack(p2), atol=1e-12, rtol=0)


def test_acceptance_rule_and_prefix():
    """d_j is accepted iff u_j < p(d_j)/q(d_j); only the leading run of acceptances counts, the
    emitted token sits right after it and comes from the residual (here a single token)."""
    p = torch.tensor([[[0.2, 0.8, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    q = torch.tensor([[[0.4, 0.6, 0.0], [1.0, 0.0, 0.0]]])
    drafts = torch.tensor([[0, 0]])  # p/q = 0.5 at the first draft, 0.5 at the second
    accepted, tokens = rejection_sample(p, q, drafts, torch.tensor([[0.49, 0.2]]))
    assert accepted.tolist() == [2] and tokens.tolist() == [[0, 0, 2]]  # bonus from p3
    accepted, tokens = rejection_sample(p, q, drafts, torch.tensor([[0.49, 0.51]]))
    assert accepted.tolist() == [1] and tokens[0, :2].tolist() == [0, 1]  # residual p2 - q2
    accepted, tokens = rejection_sample(p, q, drafts, torch.tensor([[0.51, 0.0]]))
    assert accepted.tolist() == [0] and tokens[0, 0] == 1  # residual of p1 - q1 is token 1


def test_rejection_sampling_monte_carlo():
    """200,000 seeded rounds with two drafts (second-position distributions depend on the
    first draft): the first two emitted tokens fit p1(x1) p2(x2 | x1), and the first draft is
    accepted at the rate sum(min(p1, q1)) = 1 - TV(p1, q1)."""
    gen = torch.Generator().manual_seed(2)
    vocab, n = 5, 200_000
    p1, q1 = (t.float() for t in random_pair(gen, vocab))
    pairs = [random_pair(gen, vocab) for _ in range(vocab)]
    p2 = torch.stack([p for p, _ in pairs]).float()  # [d1, vocab]
    q2 = torch.stack([q for _, q in pairs]).float()
    p3 = torch.softmax(torch.randn(vocab, vocab, vocab, generator=gen), dim=-1)
    torch.manual_seed(3)
    d1 = torch.multinomial(q1, n, replacement=True)
    d2 = torch.multinomial(q2[d1], 1).squeeze(1)
    p = torch.stack([p1.expand(n, vocab), p2[d1], p3[d1, d2]], dim=1)
    q = torch.stack([q1.expand(n, vocab), q2[d1]], dim=1)
    accepted, tokens = rejection_sample(p, q, torch.stack([d1, d2], dim=1))
    x1 = tokens[:, 0]
    # After a rejection at the first draft the next round emits x2 from p2(. | x1).
    x2 = torch.where(accepted >= 1, tokens[:, 1], torch.multinomial(p2[x1], 1).squeeze(1))
    counts = torch.bincount(x1 * vocab + x2, minlength=vocab * vocab)
    assert chi2_pvalue(counts, p1[:, None] * p2) > ALPHA
    rate = float((accepted >= 1).double().mean())
    expected = float(torch.minimum(p1, q1).sum())
    assert abs(rate - expected) < 5 * (expected * (1 - expected) / n) ** 0.5


def test_a_first_draft_sampled_against_p():
    """An early-drafting request's first token (`early.first_tokens`): 200,000 drafts from q
    kept or replaced against p give tokens that fit p, equal to the draft at the rate
    sum(min(p, q))."""
    gen = torch.Generator().manual_seed(4)
    vocab, n = 6, 200_000
    p, q = (t.float() for t in random_pair(gen, vocab))
    torch.manual_seed(5)
    drafts = torch.multinomial(q, n, replacement=True)
    tokens = sample_against_draft(p.expand(n, vocab), q.expand(n, vocab), drafts)
    assert chi2_pvalue(torch.bincount(tokens, minlength=vocab), p) > ALPHA
    rate = float((tokens == drafts).double().mean())
    expected = float(torch.minimum(p, q).sum())
    assert abs(rate - expected) < 5 * (expected * (1 - expected) / n) ** 0.5


# -- whole generations, driven like the worker drives the functions ---------------------------

VOCAB, POSITIONS = 6, 8


def markov_model(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [position, last token, vocab] of a full model and of a lossy draft of it."""
    gen = torch.Generator().manual_seed(seed)
    full = 1.5 * torch.randn(POSITIONS, VOCAB, VOCAB, generator=gen)
    return full, full + 0.8 * torch.randn(POSITIONS, VOCAB, VOCAB, generator=gen)


def generate(full: torch.Tensor, draft: torch.Tensor, rows: SamplingRows, t0: torch.Tensor,
             new_tokens: int, k: int) -> tuple[torch.Tensor, int, int]:
    """Each batch row generates `new_tokens` tokens after `t0` in rounds of k drafts, as
    `VeriCacheWorker._decode` does: draft_tokens per step, one verify_tokens per round.
    Returns (tokens [n, new_tokens], drafts accepted, rounds)."""
    n = len(t0)
    out = torch.full((n, new_tokens + k + 1), -1, dtype=torch.int64)
    count = torch.zeros(n, dtype=torch.int64)  # emitted so far = position of the last token
    last = t0.clone()
    total_accepted = rounds = 0
    arange = torch.arange(n)
    while bool((count < new_tokens).any()):
        positions = count[:, None] + torch.arange(k + 1)
        at = positions.clamp(max=POSITIONS - 1)
        chain, qs = [last], []
        for step in range(k):
            token, q = draft_tokens(draft[at[:, step], chain[-1]], rows, positions[:, step])
            chain.append(token)
            qs.append(q)
        chain = torch.stack(chain, dim=1)
        logits = full[at, chain]  # [n, k+1, vocab]: verify logits at every chain token
        accepted, tokens = verify_tokens(
            logits, chain[:, 1:], torch.stack(qs, dim=1) if rows.any_sampled else None,
            rows, positions)
        for j in range(k + 1):
            keep = (j <= accepted) & (count + j < out.shape[1])
            out[arange[keep], (count + j)[keep]] = tokens[keep, j]
        total_accepted += int(accepted.sum())
        rounds += 1
        count += accepted + 1
        last = tokens[arange, accepted]
    return out[:, :new_tokens], total_accepted, rounds


def sequence_probs(full: torch.Tensor, rows: SamplingRows, t0: int, length: int) -> torch.Tensor:
    """Exact probability of every token sequence of `length` under the full model, through the
    request's sampling transforms: [vocab] * length."""
    one = SamplingRows(rows.temperatures[:1].expand(VOCAB), rows.top_ks[:1].expand(VOCAB),
                       rows.top_ps[:1].expand(VOCAB), rows.min_ps[:1].expand(VOCAB),
                       rows.need_filter, rows.need_min_p)
    probs = torch.ones(())
    prev = torch.tensor([t0])
    for pos in range(length):
        step = filtered_probs(softmax_probs(full[pos], one), one).double()  # [last, vocab]
        probs = probs.unsqueeze(-1) * step[prev.reshape(-1)].reshape(*probs.shape, VOCAB)
        prev = torch.arange(VOCAB).expand(*probs.shape)
    return probs


@pytest.mark.parametrize("params", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 4, "top_p": 0.9},
    {"temperature": 1.3, "min_p": 0.1},
])
def test_generations_follow_the_full_model(params):
    """30,000 sampled generations of 3 tokens (rounds of 3 drafts on a lossy draft model):
    the empirical distribution of whole sequences fits the full model's exactly computed
    one; drafts were both accepted and rejected."""
    n = 30_000
    full, draft = markov_model(4)
    rows = make_rows([params["temperature"]] * n, [params.get("top_k", TOP_K_ALL)] * n,
                     [params.get("top_p", 1.0)] * n, [params.get("min_p", 0.0)] * n)
    torch.manual_seed(5)
    tokens, accepted, rounds = generate(full, draft, rows, torch.zeros(n, dtype=torch.int64),
                                        new_tokens=3, k=3)
    assert 0 < accepted < 3 * n * rounds
    index = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    counts = torch.bincount(index, minlength=VOCAB**3)
    assert chi2_pvalue(counts, sequence_probs(full, rows, 0, 3)) > ALPHA


def test_greedy_rows_keep_the_greedy_rule_next_to_sampled_rows():
    """A batch mixing greedy requests (temperature 0, or top_k 1 at any temperature) with
    sampled ones: every greedy row emits the full model's argmax chain, whatever the drafts."""
    n = 400
    full, draft = markov_model(6)
    temps = [0.0, 1.0, 0.8, 1.0] * (n // 4)
    top_ks = [TOP_K_ALL, TOP_K_ALL, 1, 3] * (n // 4)
    rows = make_rows(temps, top_ks)
    torch.manual_seed(7)
    tokens, _, _ = generate(full, draft, rows, torch.arange(n) % VOCAB, new_tokens=6, k=4)
    greedy = rows.greedy
    last = torch.arange(n) % VOCAB
    for pos in range(6):
        last = torch.argmax(full[pos, last], dim=-1)
        assert torch.equal(tokens[greedy, pos], last[greedy])
    assert (tokens[~greedy] != tokens[~greedy][0]).any()  # the others really sample


def test_all_greedy_verify_is_the_longest_argmax_prefix():
    """An all-greedy batch takes exactly the rule the worker always had."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 4, 11, generator=gen)
    target = torch.argmax(logits, dim=-1)
    drafts = target[:, :-1].clone()
    drafts[1, 0] += 1
    drafts[2, 2] += 1
    drafts[3, 1] += 1
    rows = make_rows([0.0] * 5)
    accepted, tokens = verify_tokens(logits, drafts, None, rows, torch.zeros(5, 4, dtype=int))
    old = (drafts == target[:, :-1]).to(torch.int32).cumprod(dim=1).sum(dim=1)
    assert accepted.tolist() == old.tolist() == [3, 0, 2, 1, 3]
    assert torch.equal(tokens, target)
    token, q = draft_tokens(logits[:, 0], rows, torch.zeros(5, dtype=int))
    assert q is None and torch.equal(token, target[:, 0])


def test_no_drafts_samples_the_next_token_from_p():
    """A round without drafts (one token left to generate) still samples the sampled rows."""
    full, _ = markov_model(9)
    n = 20_000
    rows = make_rows([1.0] * n)
    torch.manual_seed(10)
    logits = full[0, 2].expand(n, 1, VOCAB)
    accepted, tokens = verify_tokens(logits, torch.zeros(n, 0, dtype=torch.int64), None, rows,
                                     torch.zeros(n, 1, dtype=torch.int64))
    assert (accepted == 0).all()
    counts = torch.bincount(tokens[:, 0], minlength=VOCAB)
    assert chi2_pvalue(counts, torch.softmax(full[0, 2], dim=-1)) > ALPHA


# -- seeded requests (deterministic inference) -----------------------------------------------

@pytest.mark.parametrize("params", [{}, {"top_k": 4, "top_p": 0.9}])
def test_seeded_rows_emit_plain_seeded_tokens(params):
    """With a sampling seed per request, each emitted token is the one SGLang's seeded sampler
    (its own `multinomial_with_seed`; on CPU its hash is the shim's op, equal to SGLang's
    Triton kernel: tests/test_cpu_shim.py) picks from the full model at that position: the
    output equals plain seeded decoding."""
    n, new_tokens = 64, 7
    full, draft = markov_model(11)
    rows = make_rows([0.9] * n, [params.get("top_k", TOP_K_ALL)] * n,
                     [params.get("top_p", 1.0)] * n, seeds=list(range(n)))
    assert not rows.any_sampled
    t0 = torch.arange(n) % VOCAB
    tokens, accepted, _ = generate(full, draft, rows, t0, new_tokens=new_tokens, k=3)
    assert accepted > 0
    last = t0
    for pos in range(new_tokens):
        at = torch.full((n,), pos)
        last = chosen_tokens(full[min(pos, POSITIONS - 1), last], rows, at)
        assert torch.equal(tokens[:, pos], last)
    assert len(set(map(tuple, tokens.tolist()))) > 1


# -- SGLang's sampling transforms ------------------------------------------------------------

def test_softmax_is_sglangs():
    """softmax_probs is the sampler's `logits.div_(temperatures)` then its softmax, bit for bit,
    and leaves the logits alone."""
    logits = torch.randn(4, 50)
    rows = make_rows([0.5, 1.0, 1.7, 0.0])
    before = logits.clone()
    ours = softmax_probs(logits, rows)
    assert torch.equal(logits, before)
    theirs = before.clone()
    theirs.div_(rows.temperatures.view(-1, 1))
    assert torch.equal(ours, sglang_sampler.sampler_softmax(theirs))


CASES = {
    "top_k": dict(top_ks=[5, 1, 40, TOP_K_ALL]),
    "top_p": dict(top_ps=[0.5, 0.9, 1.0, 0.1]),
    "min_p": dict(min_ps=[0.05, 0.2, 0.0, 0.5]),
    "all": dict(top_ks=[8, 20, TOP_K_ALL, 3], top_ps=[0.8, 0.95, 0.6, 1.0],
                min_ps=[0.1, 0.0, 0.02, 0.3]),
}


def reference_filter(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """SGLang's documented semantics, one row: keep the top_k most likely tokens and, among
    the tokens sorted by probability, those whose preceding mass is at most top_p (both on the
    unfiltered probabilities); then drop what is below min_p times the largest kept weight."""
    order = torch.argsort(probs, descending=True, stable=True)
    sorted_p = probs[order]
    before = torch.cumsum(sorted_p, 0) - sorted_p
    keep = (torch.arange(len(probs)) < top_k) & (before <= top_p)
    kept = torch.where(keep, sorted_p, 0)
    kept = torch.where(kept < kept[0] * min_p, 0, kept)
    out = torch.zeros_like(probs)
    out[order] = kept
    return out / out.sum()


@pytest.mark.parametrize("case", list(CASES))
def test_filters_match_sglangs_sampler(case):
    """filtered_probs equals the documented semantics row by row, and 40,000 draws of SGLang's
    own pytorch-backend sampler per row fit it."""
    gen = torch.Generator().manual_seed(12)
    logits = 2.0 * torch.randn(4, 60, generator=gen)
    rows = make_rows([0.8, 1.0, 1.5, 0.6], **CASES[case])
    probs = softmax_probs(logits, rows)
    ours = filtered_probs(probs, rows)
    for i in range(4):
        ref = reference_filter(probs[i], int(rows.top_ks[i]), float(rows.top_ps[i]),
                               float(rows.min_ps[i]))
        torch.testing.assert_close(ours[i], ref, atol=1e-6, rtol=0)
    draws = 40_000
    torch.manual_seed(13)
    many = rows.repeat(draws)
    tokens = sglang_sampler.top_k_top_p_min_p_sampling_from_probs_torch(
        probs.repeat_interleave(draws, dim=0), many.top_ks, many.top_ps, many.min_ps,
        many.need_min_p, None, torch.zeros(4 * draws, dtype=torch.int64),
    ).view(4, draws)
    for i in range(4):
        counts = torch.bincount(tokens[i].long(), minlength=probs.shape[1])
        assert chi2_pvalue(counts, ours[i]) > ALPHA


def test_draft_tokens_sample_q():
    """Sampled rows draw their draft from the filtered draft distribution they return."""
    n = 30_000
    logits = torch.randn(1, 9, generator=torch.Generator().manual_seed(14)).expand(n, 9)
    rows = make_rows([0.9] * n, [5] * n, [0.95] * n)
    torch.manual_seed(15)
    tokens, q = draft_tokens(logits, rows, torch.zeros(n, dtype=torch.int64))
    assert q is not None and torch.allclose(q.sum(-1), torch.ones(n))
    assert chi2_pvalue(torch.bincount(tokens, minlength=9), q[0]) > ALPHA


# -- which requests are drafted for --------------------------------------------------------

def _sampler(**attrs) -> sglang_sampler.Sampler:
    sampler = sglang_sampler.Sampler.__new__(sglang_sampler.Sampler)
    sampler.use_ascend_backend = False
    sampler.rl_on_policy_target = None
    for name, value in attrs.items():
        setattr(sampler, name, value)
    return sampler


def _info(**flags) -> SimpleNamespace:
    """A batch of a greedy row and a sampled row (SGLang stores top_k 1 for greedy)."""
    base = dict(is_all_greedy=False, need_top_k_sampling=False, need_top_p_sampling=False,
                need_min_p_sampling=False, sampling_seed=None, has_watermark_candidates=False,
                sampling_mask_batch_indices=None, temperatures=torch.ones(2, 1),
                top_ks=torch.tensor([1, 1 << 30]))
    return SimpleNamespace(**{**base, **flags})


def test_rows_sampler_supported():
    pytorch, flashinfer = "pytorch", "flashinfer"
    both, greedy_only, neither = [True, True], [True, False], [False, False]
    supported = rows_sampler_supported
    assert supported(_sampler(), _info(is_all_greedy=True), flashinfer) == both
    assert supported(_sampler(), _info(), flashinfer) == both  # temperature only
    assert supported(_sampler(), _info(need_top_p_sampling=True), pytorch) == both
    # A fused backend filters the batch's sampled rows its own way: the greedy row drafts.
    assert supported(_sampler(), _info(need_top_p_sampling=True), flashinfer) == greedy_only
    assert supported(_sampler(use_ascend_backend=True), _info(), pytorch) == neither
    assert supported(_sampler(rl_on_policy_target="fsdp"), _info(), pytorch) == neither
    assert supported(
        _sampler(), _info(need_min_p_sampling=True, sampling_seed=torch.zeros(2)),
        pytorch) == neither
    assert supported(_sampler(), _info(has_watermark_candidates=True), pytorch) == neither
    assert supported(
        _sampler(), _info(is_all_greedy=True, sampling_mask_batch_indices=torch.zeros(1)),
        pytorch) == neither

    class Custom(sglang_sampler.Sampler):
        pass

    assert supported(Custom.__new__(Custom), _info(is_all_greedy=True), pytorch) == neither


@pytest.mark.parametrize("flashinfer_here, given, chosen", [
    (True, None, "pytorch"),  # SGLang would pick flashinfer: VeriCache picks pytorch
    (True, "flashinfer", "flashinfer"),  # a user's choice stays
    (False, None, None),  # SGLang picks pytorch itself
])
def test_vericache_selects_the_sampling_backend_a_round_reproduces(monkeypatch, flashinfer_here,
                                                                   given, chosen):
    monkeypatch.setattr(algorithm, "get_platform",
                        lambda: SimpleNamespace(has_flashinfer=flashinfer_here))
    args = vericache_server_args(sampling_backend=given)
    algorithm.configure(args)
    assert args.sampling_backend == chosen


# -- level-1 checks of a level-2 proposal --------------------------------------------------

@pytest.mark.parametrize("params", [{"temperatures": [1.0]},
                                    {"temperatures": [0.8], "top_ks": [4], "top_ps": [0.9]}])
def test_checked_proposals_follow_level_ones_distribution(params):
    """A sampling request's check of a point-mass proposal [a, b]: the first added token
    follows q_0, and after a kept `a` the next follows q_1 (Monte Carlo, chi-square); the q
    returned for verification is the distribution each added token was drawn from."""
    torch.manual_seed(0)
    vocab, proposal = 6, [2, 4]
    logits = torch.randn(3, vocab, dtype=torch.float32) * 1.5
    rows = make_rows(**params)
    taken = rows.take(torch.zeros(3, dtype=torch.int64))
    positions = torch.arange(3)
    q = filtered_probs(softmax_probs(logits, taken), taken)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(20000):
        added, probs = check_proposals(logits, taken, positions, [proposal])[0]
        torch.testing.assert_close(probs, q[: len(added)])
        first[added[0]] += 1
        if added[0] == proposal[0]:
            second[added[1]] += 1
    assert chi2_pvalue(first, q[0]) > 1e-3
    assert chi2_pvalue(second, q[1]) > 1e-3


def test_greedy_check_keeps_the_proposals_equal_to_its_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    rows = make_rows([0.0]).take(torch.zeros(3, dtype=torch.int64))
    assert check_proposals(logits, rows, torch.arange(3), [[1, 0]])[0] == ([1, 0, 2], None)
    assert check_proposals(logits, rows, torch.arange(3), [[1, 2]])[0] == ([1, 0], None)
    assert check_proposals(logits[:1], rows.take(torch.zeros(1, dtype=torch.int64)),
                           torch.arange(1), [[]])[0] == ([1], None)


def test_several_requests_checked_at_once_equal_each_checked_alone():
    """Greedy requests' proposals of different lengths (none kept, some, all) checked in one
    call, beside a sampling request: each greedy result is the one its own call gives."""
    torch.manual_seed(0)
    vocab = 8
    proposals = [[], [3, 1, 4], [5], [2, 2]]
    widths = [len(p) + 1 for p in proposals]
    logits = torch.randn(sum(widths), vocab) * 3
    # Request 1 keeps its whole proposal, request 3 its first token only.
    starts = [sum(widths[:r]) for r in range(len(proposals))]
    for r in (1, 3):
        for j, token in enumerate(proposals[r][:len(proposals[r]) if r == 1 else 1]):
            logits[starts[r] + j, token] = 50.0
    request_rows = make_rows([0.0, 0.0, 1.0, 0.0])
    owner = torch.repeat_interleave(torch.arange(len(proposals)), torch.tensor(widths))
    rows = request_rows.take(owner)
    positions = torch.arange(sum(widths))
    together = check_proposals(logits, rows, positions, proposals)
    for r in (0, 1, 3):
        span = torch.arange(starts[r], starts[r] + widths[r])
        alone = check_proposals(logits[span], rows.take(span), positions[span], [proposals[r]])
        assert together[r] == alone[0]
    assert together[1][0][:3] == proposals[1] and together[3][0][0] == proposals[3][0]
    added, q = together[2]
    assert q is not None and len(added) == q.shape[0]
