"""Verifying a round's drafts over the full KV and choosing the tokens it emits.

One TARGET_VERIFY forward scores the chain [t0, d1..dk] of every request; greedy and seeded
requests keep the longest prefix of drafts the full model would have chosen itself, sampling
requests are rejection sampled (`sampling.py`), and requests that do not draft take SGLang's
own sampler's token at chain position 0, the logits a plain decode step samples from.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput

from vericache_sglang.speculative.forwards import (
    TargetForwards,
    first_position_forward_batch,
    verify_forward_batch,
)
from vericache_sglang.speculative.grammar import RoundGrammar
from vericache_sglang.speculative.logprobs import chain_logprobs, take_first_positions
from vericache_sglang.speculative.round import Round
from vericache_sglang.speculative.sampling import verify_tokens


@dataclass
class Verdict:
    """What verification decided for each request of a round."""

    accepted: torch.Tensor
    """[bs] drafts each request keeps (0 for the requests that take a plain step)."""
    target: torch.Tensor
    """[bs, k + 1] the tokens emitted: the kept drafts, then the full model's own token."""
    plain: list[int]
    """Requests that took a plain step."""
    first: LogitsProcessorOutput | None = None
    """SGLang's sampler's output at chain position 0, when some request took a plain step."""


def verify(forwards: TargetForwards, backend, batch, round_: Round) -> LogitsProcessorOutput:
    """The full model's logits at every position of the chain, changed as plain decoding
    changes them (`Round.constrain`)."""
    bs, width = len(batch.reqs), round_.k + 1
    logits_output = forwards.logits(backend, verify_forward_batch(batch, round_))
    logits = logits_output.next_token_logits
    round_.constrain(logits, [i for i in range(bs) for _ in range(width)],
                     list(range(width)) * bs,
                     partial(RoundGrammar.constrain_verify, logits=logits))
    return logits_output


def judge(model_runner, batch, round_: Round, logits_output: LogitsProcessorOutput) -> Verdict:
    """Accept the longest prefix the full model would have chosen itself (greedy and seeded
    requests) or rejection sample (the others), plus the full model's next token; the
    requests that do not draft emit SGLang's sampler's token at chain position 0."""
    bs, width = len(batch.reqs), round_.k + 1
    accepted, target = verify_tokens(
        logits_output.next_token_logits.view(bs, width, -1), round_.chain()[:, 1:],
        torch.stack(round_.draft_probs, dim=1)
        if round_.draft_probs and round_.rows.any_sampled else None,
        round_.rows, round_.positions,
    )
    verdict = Verdict(accepted, target, [i for i, drafts in enumerate(round_.drafts)
                                         if not drafts])
    if verdict.plain:
        tokens, verdict.first = _sample_first_position(model_runner, batch, round_,
                                                       logits_output)
        rows = torch.tensor(verdict.plain, device=accepted.device)
        accepted[rows] = 0
        target[rows, 0] = tokens[rows].to(target.dtype)
    return verdict


def write_logprobs(batch, round_: Round, logits_output: LogitsProcessorOutput,
                   verdict: Verdict) -> None:
    """Returned logprobs of the emitted tokens, from the verify logits."""
    chain_logprobs(logits_output.next_token_logits, round_.rows, verdict.target,
                   batch.top_logprobs_nums, batch.token_ids_logprobs
                   ).write_output_to(logits_output)
    if verdict.first is not None:
        take_first_positions(logits_output, verdict.first, verdict.plain, round_.k + 1)


def _sample_first_position(model_runner, batch, round_: Round,
                           logits_output: LogitsProcessorOutput
                           ) -> tuple[torch.Tensor, LogitsProcessorOutput]:
    """SGLang's own sampler (custom logit processors, logprobs) over the verify logits of
    chain position 0: every request's plain-step token [bs] and the sampler's output."""
    bs, width = len(batch.reqs), round_.k + 1
    first = LogitsProcessorOutput(next_token_logits=logits_output.next_token_logits
                                  .view(bs, width, -1)[:, 0].clone())
    return model_runner.sample(first, first_position_forward_batch(batch, round_)), first
