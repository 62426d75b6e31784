"""Penalties and logit bias at every position of a round, as plain decoding applies them.

Plain SGLang (without the overlap scheduler) changes each decode step's logits with its
batch's penalizers, one after the other, each holding a state over every token the request
has output so far: frequency (`logits -= frequency x count`), presence (`logits -= presence`
for seen tokens), min-new-tokens (-inf on stop tokens while the output is shorter than
`min_new_tokens`) and repetition (seen tokens' logits multiplied by it when negative, divided
when positive); after the grammar mask the logit bias is added. The penalizers run in the
iteration order of a set of their classes, which follows the classes' ids and so differs from
process to process: with a repetition penalty beside an additive one, plain SGLang's own
logprobs move by up to ~1e-3 between runs. `PENALIZERS` is that set, built the same way, so
rounds apply them in the order plain decoding would in the serving process.

A round's chain position j predicts the token after d_j, so its state is the request's output
plus d1..dj. This module keeps each penalized request's state at its committed output (updated
incrementally with SGLang's own tensor operations, so the sums match bit for bit) and advances
a copy over the round's drafts for every draft and verify position. The scheduler's own
penalizer counts only the last token of each speculative step (SGLang's "relaxed" penalties
for speculative decoding); VeriCache does not use it for drafting requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.sampling import penaltylib
from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

PENALIZERS = {
    penaltylib.BatchedFrequencyPenalizer,
    penaltylib.BatchedMinNewTokensPenalizer,
    penaltylib.BatchedPresencePenalizer,
    penaltylib.BatchedRepetitionPenalizer,
}
"""The set `SamplingBatchInfo.from_schedule_batch` builds a batch's penalizers from, written
in the same order: its iteration order is the order plain decoding applies them in."""


def _stop_ids(req: Any) -> set[int]:
    """The tokens `min_new_tokens` holds back, as SGLang's min-new-tokens penalizer lists
    them."""
    tokenizer = req.tokenizer
    ids = ((req.sampling_params.stop_token_ids or set()) | (req.eos_token_ids or set())
           | (getattr(tokenizer, "additional_stop_token_ids", None) or set()))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = ids | {tokenizer.eos_token_id}
    return {i for i in ids if i is not None}


def penalized(req: Any) -> bool:
    """Whether plain decoding changes this request's logits with penalties or bias."""
    params = req.sampling_params
    return (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
            or params.repetition_penalty != 1.0 or params.min_new_tokens > 0
            or params.logit_bias is not None)


@dataclass
class _State:
    """A request's penalty tensors [V] after its first `counted` output tokens."""

    counted: int
    frequency: torch.Tensor
    presence: torch.Tensor
    repetition: torch.Tensor

    def advance(self, token: int, params: Any) -> None:
        """Count one more output token, with the operations SGLang's penalizers use."""
        index = torch.tensor([[token]], device=self.frequency.device)
        self.frequency.view(1, -1).scatter_add_(
            1, index, self._value(params.frequency_penalty))
        self.presence.view(1, -1).scatter_(1, index, self._value(params.presence_penalty))
        self.repetition.view(1, -1).scatter_(1, index, self._value(params.repetition_penalty))
        self.counted += 1

    def _value(self, value: float) -> torch.Tensor:
        return torch.full((1, 1), value, dtype=torch.float32, device=self.frequency.device)

    def copy(self) -> _State:
        return _State(self.counted, self.frequency.clone(), self.presence.clone(),
                      self.repetition.clone())


class PenaltyStates:
    """Each penalized request's state at its committed output, kept across rounds."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._states: dict[str, _State] = {}

    def committed(self, req: Any) -> _State:
        """The request's state over its whole output so far."""
        state = self._states.get(req.rid)
        if state is None or state.counted > len(req.output_ids):
            zeros = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
            state = self._states[req.rid] = _State(0, zeros, zeros.clone(),
                                                   torch.ones_like(zeros))
        for token in req.output_ids[state.counted:]:
            state.advance(token, req.sampling_params)
        return state

    def forget(self, rid: str) -> None:
        self._states.pop(rid, None)


class RoundPenalties:
    """The penalized requests of one round and their logit changes at any chain position."""

    def __init__(self, states: PenaltyStates, reqs: list[Any], logit_bias: torch.Tensor | None):
        self._reqs = {i: req for i, req in enumerate(reqs) if penalized(req)}
        self._base = {i: states.committed(req) for i, req in self._reqs.items()}
        self._stops = {i: torch.tensor(sorted(_stop_ids(req)), dtype=torch.int64,
                                       device=states.device)
                       for i, req in self._reqs.items()
                       if len(req.output_ids) < req.sampling_params.min_new_tokens}
        self._bias = logit_bias
        self._cursors: dict[int, tuple[_State, list[int]]] = {}

    @classmethod
    def for_batch(cls, states: PenaltyStates, batch: Any) -> RoundPenalties | None:
        """The round's penalties, or None when no request of the batch has any."""
        if not any(penalized(req) for req in batch.reqs):
            return None
        return cls(states, batch.reqs, batch.sampling_info.logit_bias)

    def penalize(self, logits: torch.Tensor, requests: list[int], steps: list[int],
                 drafts: list[list[int]]) -> None:
        """Apply the penalties to logits [rows, V] in place (before the grammar mask): row r
        is request `requests[r]`'s chain position `steps[r]`, whose state counts the request's
        drafts `drafts[i][:steps[r]]`."""
        by_request: dict[int, list[tuple[int, int]]] = {}
        for row, (i, step) in enumerate(zip(requests, steps, strict=True)):
            if i in self._reqs:
                by_request.setdefault(i, []).append((step, row))
        for i, rows in by_request.items():
            rows.sort()
            params, stops = self._reqs[i].sampling_params, self._stops.get(i)
            state = self._state_at(i, rows[0][0], drafts[i])
            if len(rows) > 1:  # later rows count drafts the next call may not keep
                state = state.copy()
            for step, row in rows:
                self._advance(state, i, step, drafts[i])
                for penalizer in PENALIZERS:
                    self._apply(penalizer, logits[row : row + 1], state,
                                stops if state.counted < params.min_new_tokens else None)

    def _state_at(self, i: int, step: int, drafts: list[int]) -> _State:
        """Request i's state counting `drafts[:step]`. A round's calls ask for steps that
        mostly only grow over drafts that only extend, so one running state per request is
        advanced in place (k advances a round, not k^2/2); a call behind it or over drafts that
        changed under it (a rejected proposal, verification after drafting) starts it over."""
        cursor = self._cursors.get(i)
        if (cursor is None or cursor[0].counted - self._base[i].counted > step
                or drafts[: len(cursor[1])] != cursor[1]):
            cursor = self._cursors[i] = (self._base[i].copy(), [])
        state, counted = cursor
        self._advance(state, i, step, drafts)
        counted[:] = drafts[:step]
        return state

    def _advance(self, state: _State, i: int, step: int, drafts: list[int]) -> None:
        """Count request i's drafts up to `drafts[:step]` in `state`."""
        base, params = self._base[i], self._reqs[i].sampling_params
        while state.counted - base.counted < step:
            state.advance(drafts[state.counted - base.counted], params)

    @staticmethod
    def _apply(penalizer: type, logits: torch.Tensor, state: _State,
               stops: torch.Tensor | None) -> None:
        """One penalizer's change to logits [1, V], as its `_apply` makes it."""
        if penalizer is penaltylib.BatchedFrequencyPenalizer:
            logits.sub_(state.frequency)
        elif penalizer is penaltylib.BatchedPresencePenalizer:
            logits.sub_(state.presence)
        elif penalizer is penaltylib.BatchedRepetitionPenalizer:
            apply_scaling_penalties(logits, state.repetition.view(1, -1))
        elif stops is not None:  # min-new-tokens, while it holds
            logits[0, stops] += float("-inf")

    def bias(self, logits: torch.Tensor, requests: list[int]) -> None:
        """Add the logit bias to logits [rows, V] in place (after the grammar mask): row r is
        one of request `requests[r]`'s positions."""
        if self._bias is None:
            return
        rows = [r for r, i in enumerate(requests) if i in self._reqs]
        if rows:
            logits[rows] += self._bias[[requests[r] for r in rows]]
