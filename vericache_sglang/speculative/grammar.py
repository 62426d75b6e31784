"""Grammar-constrained drafting: the same vocab masks constrain the draft and the verification.

Plain SGLang masks each decode step's logits with the request's grammar state after every
token emitted so far. A VeriCache round emits a chain t0, d1..dk whose masks depend on the
drafts themselves, so while drafting the grammar matcher advances over each draft (recording
the mask each position saw), and after the round it is rolled back: the scheduler advances it
over the tokens actually emitted, as it does for every speculative algorithm. The verify logits
at chain position j are masked with the mask drafting used at j, which is exactly the mask
plain decoding would use there if d1..dj are emitted; only such positions can be emitted.

Stacked drafting (a level-2 drafter) checks a request's last draft and the drafter's proposals
in one forward: the matcher advances over the proposals to fill each row's mask, then rolls
back the proposals level 1 did not keep and advances over level 1's own token, so each chain
position's recorded mask is again the one after the drafts really before it.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.constrained.base_grammar_backend import GrammarMask


class RoundGrammar:
    """The vocab masks of one round's chain positions, for the requests that have a grammar.

    Row `i * width + j` of the mask is request i's mask at chain position j (predicting the
    token after the j-th chain token). Requests without a live grammar keep the
    unconstrained rows the allocation starts with.
    """

    def __init__(self, grammars: dict[int, Any], batch_size: int, vocab_size: int,
                 width: int) -> None:
        self.width = width
        self._grammars = grammars
        self._advanced = dict.fromkeys(self._grammars, 0)
        self._handle = next(iter(self._grammars.values()))
        self._mask = self._handle.allocate_vocab_mask(
            vocab_size=vocab_size, batch_size=batch_size * width, device="cpu"
        )
        # Allocated rows allow every token: what a position after the grammar terminated gets.
        self._unconstrained = self._mask[0].clone()
        self._tentative: dict[int, int] = {}  # proposals each matcher advanced over this check

    @classmethod
    def for_batch(cls, reqs: list[Any], vocab_size: int, width: int) -> RoundGrammar | None:
        """The round's masks, or None when no request of the batch decodes under a grammar
        (finished and terminated grammars constrain nothing, as in plain decoding)."""
        grammars = {
            i: req.grammar for i, req in enumerate(reqs)
            if req.grammar is not None and not req.grammar.finished
            and not req.grammar.is_terminated()
        }
        return cls(grammars, len(reqs), vocab_size, width) if grammars else None

    def _fill(self, position: int) -> None:
        for i in self._grammars:
            self._fill_one(i, position)

    def _fill_one(self, i: int, position: int) -> None:
        row = i * self.width + position
        if self._grammars[i].is_terminated():
            self._mask[row] = self._unconstrained
        else:
            self._grammars[i].fill_vocab_mask(self._mask, row)

    def _accept(self, i: int, token: int) -> bool:
        """Advance request i's matcher over one token; False for a terminated grammar or a
        dead end (masked logits that leave no legal token: verification rejects this draft,
        so the positions after it never need a mask)."""
        grammar = self._grammars[i]
        if grammar.is_terminated():
            return False
        try:
            grammar.accept_token(token)
        except ValueError:
            return False
        self._advanced[i] += 1
        return True

    def _apply(self, logits: torch.Tensor, rows: torch.Tensor | slice | list[int]) -> None:
        GrammarMask(self._handle, self._handle.move_vocab_mask(
            self._mask[rows], logits.device)).apply(logits)

    def constrain_draft(self, logits: torch.Tensor, step: int) -> None:
        """Mask the draft logits [bs, vocab] of draft step `step` in place (chain position
        `step`), recording the masks for verification."""
        self._fill(step)
        self._apply(logits, torch.arange(logits.shape[0]) * self.width + step)

    def advance(self, tokens: torch.Tensor) -> None:
        """Advance every live grammar over its request's new draft token."""
        for i, token in zip(self._grammars, tokens[list(self._grammars)].tolist(), strict=True):
            self._accept(i, token)

    def constrain_proposals(self, logits: torch.Tensor,
                            checks: list[tuple[int, int, list[int]]]) -> None:
        """Mask a level-1 check forward's logits in place. Each check (i, step, proposal)
        owns the next len(proposal) + 1 rows of `logits`: request i's chain positions
        step..step + len(proposal), the drafts before position step + j being the round's
        drafts so far and proposal[:j]. Each matcher advances over the proposals its masks
        allow, until `settle_proposal`; it never sees a token its mask forbids (llguidance's
        matcher cannot recover from one), and level 1 cannot keep such a token either."""
        row = 0
        for i, step, proposal in checks:
            if i in self._grammars:
                self._tentative[i] = 0
                for j in range(len(proposal) + 1):
                    self._fill_one(i, step + j)
                    self._apply(logits[row + j : row + j + 1], [i * self.width + step + j])
                    if (j < len(proposal) and self._tentative[i] == j
                            and logits[row + j, proposal[j]] > float("-inf")
                            and self._accept(i, proposal[j])):
                        self._tentative[i] += 1
            row += len(proposal) + 1

    def settle_proposal(self, i: int, kept: int, token: int) -> None:
        """After level 1 kept `kept` of request i's proposals and added `token`: roll back
        the proposals it did not keep and advance over its token."""
        if i not in self._grammars:
            return
        extra = max(self._tentative.pop(i, 0) - kept, 0)
        if extra:
            self._grammars[i].rollback(extra)
            self._advanced[i] -= extra
        self._accept(i, token)

    def replay(self, tokens: list[torch.Tensor]) -> None:
        """Record the masks of a chain t0, d1..dk drafted before this round (a stash,
        `early.py`): advance over each draft after filling its position's mask, then roll
        back as after drafting."""
        for step, token in enumerate(tokens[1:]):
            self._fill(step)
            self.advance(token)
        self.finish_drafting()

    def finish_drafting(self) -> None:
        """Record the bonus position's masks and roll every grammar back to the round start."""
        self._fill(self.width - 1)
        for i, grammar in self._grammars.items():
            if self._advanced[i]:
                grammar.rollback(self._advanced[i])
            self._advanced[i] = 0

    def constrain_verify(self, logits: torch.Tensor) -> None:
        """Mask the verify logits [bs * width, vocab] in place."""
        self._apply(logits, slice(None))
