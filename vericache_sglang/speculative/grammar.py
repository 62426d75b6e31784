"""Grammar-constrained drafting: the same vocab masks constrain the draft and the verification.

Plain SGLang masks each decode step's logits with the request's grammar state after every
token emitted so far. A VeriCache round emits a chain t0, d1..dk whose masks depend on the
drafts themselves, so while drafting the grammar matcher advances over each draft (recording
the mask each position saw), and after the round it is rolled back: the scheduler advances it
over the tokens actually emitted, as it does for every speculative algorithm. The verify logits
at chain position j are masked with the mask drafting used at j, which is exactly the mask
plain decoding would use there if d1..dj are emitted; only such positions can be emitted.
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
        for i, grammar in self._grammars.items():
            if not grammar.is_terminated():
                grammar.fill_vocab_mask(self._mask, i * self.width + position)

    def _apply(self, logits: torch.Tensor, rows: torch.Tensor | slice) -> None:
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
            grammar = self._grammars[i]
            if grammar.is_terminated():
                continue
            try:
                grammar.accept_token(token)
            except ValueError:
                # Masked logits leave no legal token (a dead end): the verify pass rejects
                # this draft, so the positions after it never need a mask.
                continue
            self._advanced[i] += 1

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
