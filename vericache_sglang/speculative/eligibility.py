"""Which requests of a decode batch draft, decided per request.

A round reproduces SGLang's sampler for greedy, sampled, seeded, grammar-constrained and
penalized requests, and returns their logprobs from the verification forward. What it does
not reproduce is an arbitrary function of the logits (a custom logit processor) or a sampler
it cannot match (`rows_sampler_supported`). A request with one of these still takes part in
the round, with drafts never offered: its one token per step is chosen by SGLang's own
sampler from the verify logits of the round's first position, which are a plain decode
step's. So it never stops its batch-mates from drafting. (Returned hidden states turn the
whole batch into plain decode steps: the worker checks that first.)
"""

from __future__ import annotations

from typing import Any

from vericache_sglang.speculative.sampling import rows_sampler_supported


def drafting_rows(batch: Any, sampler: Any, backend: str | None) -> list[bool]:
    """For each request of the decode batch: whether its drafts are offered to verification
    this round (the others take one plain step inside it)."""
    supported = rows_sampler_supported(sampler, batch.sampling_info, backend)
    return [ok and req.custom_logit_processor is None
            for req, ok in zip(batch.reqs, supported, strict=True)]
