"""Grammar masks under stacked drafting: a level-1 check over proposals (some the grammar
forbids, some level 1 rejects) leaves every chain position with the mask one-token drafting
records there, and the grammar back where the round started, on both grammar backends that
can roll back (real SGLang grammar objects over the demo model's tokenizer). A chain drafted
before its round (an early-drafting stash) replayed into the round's masks gives the same."""

from __future__ import annotations

import pytest
import torch

from tests.support.identity import CONSTRAINTS
from vericache_sglang.speculative.grammar import RoundGrammar

VOCAB = 49152
K = 12


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def grammars(request, tokenizer):
    """A maker of fresh grammar objects for the tests' regex on one backend."""
    if request.param == "xgrammar":
        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

        backend = XGrammarGrammarBackend(tokenizer, vocab_size=VOCAB,
                                         model_eos_token_ids=[tokenizer.eos_token_id])
    else:
        from sglang.srt.constrained.llguidance_backend import GuidanceBackend

        backend = GuidanceBackend(tokenizer, n_vocab=VOCAB,
                                  eos_token_ids=[tokenizer.eos_token_id])
    return lambda: backend.dispatch_regex(CONSTRAINTS["regex"]["regex"])


def _state_mask(grammar) -> torch.Tensor:
    mask = grammar.allocate_vocab_mask(vocab_size=VOCAB, batch_size=1, device="cpu")
    grammar.fill_vocab_mask(mask, 0)
    return mask


def _one_token_drafting(grammar, raw: torch.Tensor, verify: torch.Tensor
                        ) -> tuple[list[torch.Tensor], list[int], torch.Tensor]:
    """d1..dK drafted one token at a time from the draft logits `raw` [K + 1, V]: the masked
    logits at each position, the drafts, and `verify` masked as the round masks it."""
    one = RoundGrammar({0: grammar}, 1, VOCAB, K + 1)
    masked, drafts = [], []
    for step in range(K):
        logits = raw[step : step + 1].clone()
        one.constrain_draft(logits, step)
        masked.append(logits[0])
        drafts.append(int(logits.argmax()))
        one.advance(torch.tensor(drafts[-1:]))
    one.finish_drafting()
    want = verify.clone()
    one.constrain_verify(want)
    return masked, drafts, want


def test_checked_proposals_leave_one_token_draftings_masks(grammars):
    torch.manual_seed(0)
    raw = torch.randn(K + 1, VOCAB) * 4  # the draft logits at each chain position
    verify = torch.randn((K + 1), VOCAB)
    masked, drafts, want = _one_token_drafting(grammars(), raw, verify)

    # Stacked: proposals that are right for a while, then forbidden or merely rejected.
    grammar = grammars()
    start = _state_mask(grammar)
    stacked = RoundGrammar({0: grammar}, 1, VOCAB, K + 1)
    chain: list[int] = []
    checks = [(3, "forbidden"), (0, "rejected"), (2, "rejected"), (4, "forbidden"), (8, "")]
    for right, wrong in checks:
        step = len(chain)
        if step >= K:
            break
        right = min(right, K - step - 1)
        proposal = drafts[step : step + right]
        if wrong == "forbidden":  # a token the grammar does not allow there
            proposal.append(int(torch.isinf(masked[step + right]).nonzero()[0]))
        elif wrong == "rejected" and step + right < K:  # allowed, but not level 1's choice
            allowed = torch.isfinite(masked[step + right]).nonzero().flatten().tolist()
            proposal.append(next(t for t in allowed if t != drafts[step + right]))
        proposal = proposal[: K - step - 1]
        logits = raw[step : step + len(proposal) + 1].clone()
        stacked.constrain_proposals(logits, [(0, step, proposal)])
        kept = next((j for j, t in enumerate(proposal) if t != drafts[step + j]),
                    len(proposal))
        for j in range(kept + 1):  # the rows level 1 reads are one-token drafting's
            assert torch.equal(logits[j], masked[step + j]), (step, j)
        chain += drafts[step : step + kept + 1]
        stacked.settle_proposal(0, kept, drafts[step + kept])
    assert chain == drafts[: len(chain)] and len(chain) == K
    stacked.finish_drafting()
    got = verify.clone()
    stacked.constrain_verify(got)
    assert torch.equal(got, want)
    assert torch.equal(_state_mask(grammar), start)  # rolled back to the round start


def test_a_replayed_stash_gets_one_token_draftings_masks(grammars):
    torch.manual_seed(1)
    verify = torch.randn((K + 1), VOCAB)
    _, drafts, want = _one_token_drafting(grammars(), torch.randn(K + 1, VOCAB) * 4, verify)
    grammar = grammars()
    start = _state_mask(grammar)
    replayed = RoundGrammar({0: grammar}, 1, VOCAB, K + 1)
    replayed.replay([torch.tensor([0]), *(torch.tensor([d]) for d in drafts)])
    got = verify.clone()
    replayed.constrain_verify(got)
    assert torch.equal(got, want)
    assert torch.equal(_state_mask(grammar), start)
