"""Returned logprobs of a round's emitted tokens, computed from the verification forward.

Plain SGLang returns, for every decode step, log-probabilities its sampler derives from that
step's logits (after the grammar mask): `log_softmax(logits)` when the whole batch is greedy
(or `SGLANG_RETURN_ORIGINAL_LOGPROB` is set), `log_softmax(logits / temperature)` under
deterministic inference, `log(softmax(logits / temperature))` otherwise. The verification
forward holds the full model's logits at every chain position, and position j's are the
logits of the plain step that emits the round's token j. So a round returns the same figures
for every token it emits, with SGLang's own `OutputLogprobProcessor` (top logprobs and
requested token ids included), laid out as SGLang's speculative result processor reads them:
values [bs, width] and one list row per chain position (row `i * width + j`).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.logprob_processor import LogprobResult, OutputLogprobProcessor
from sglang.srt.layers.sampler import SGLANG_RETURN_ORIGINAL_LOGPROB

from vericache_sglang.speculative.sampling import SamplingRows, softmax_probs


def chain_logprobs(logits: torch.Tensor, rows: SamplingRows, tokens: torch.Tensor,
                   top_logprobs_nums: list[int] | None,
                   token_ids_logprobs: list[list[int] | None] | None) -> LogprobResult:
    """Logprobs of `tokens` [bs, width] (each request's chain of emitted candidates) from the
    verify logits [bs * width, V], with each request's top logprobs and token-id logprobs at
    every position (the batch's lists, None when no request asks)."""
    bs, width = tokens.shape
    top_logprobs_nums = top_logprobs_nums or [0] * bs
    token_ids_logprobs = token_ids_logprobs or [None] * bs
    per_token = rows.repeat(width)
    if rows.all_greedy or SGLANG_RETURN_ORIGINAL_LOGPROB:
        logprobs = torch.log_softmax(logits, dim=-1)
    elif rows.seeds is not None:  # deterministic inference: SGLang's log_softmax kernel
        logprobs = torch.log_softmax(logits / per_token.temperatures.view(-1, 1), dim=-1)
    else:
        logprobs = torch.log(softmax_probs(logits, per_token))
    result = OutputLogprobProcessor().compute_logprobs(
        logprobs, [n for n in top_logprobs_nums for _ in range(width)],
        [ids for ids in token_ids_logprobs for _ in range(width)], tokens.reshape(-1))
    result.token_logprobs = result.token_logprobs.view(bs, width)
    return result


def take_first_positions(output: LogitsProcessorOutput, first: LogitsProcessorOutput,
                         rows: list[int], width: int) -> None:
    """Replace chain position 0 of requests `rows` in `output` (laid out by `chain_logprobs`)
    with `first`'s figures: one row per request, from SGLang's sampler taking a plain step."""
    for i in rows:
        output.next_token_logprobs[i, 0] = first.next_token_logprobs[i]
        for name in ("next_token_top_logprobs_val", "next_token_top_logprobs_idx",
                     "next_token_token_ids_logprobs_val", "next_token_token_ids_logprobs_idx"):
            values = getattr(output, name)
            if values:
                values[i * width] = getattr(first, name)[i]
