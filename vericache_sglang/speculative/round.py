"""The state one decode round carries from planning to acceptance, as SGLang keeps a round's
state in its algorithm's info type rather than in the worker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vericache_sglang.speculative.grammar import RoundGrammar
from vericache_sglang.speculative.penalties import RoundPenalties
from vericache_sglang.speculative.sampling import SamplingRows


@dataclass
class Round:
    """One decode round of a batch, from planning to acceptance."""

    k: int
    """Draft length of the batch."""
    room: list[int]
    """New tokens each request may still emit."""
    committed: torch.Tensor
    """[bs] committed KV length (the bonus token's position)."""
    committed_cpu: torch.Tensor
    """The same on the host, as SGLang's forwards need it."""
    slots: list[int]
    """Each request's request-pool slot, on the host."""
    positions: torch.Tensor
    """[bs, k + 1] positions of the chain t0, d1..dk."""
    locs: torch.Tensor
    """[bs, k + 1] full-pool slots the chain's K/V go to when verified."""
    tokens: list[torch.Tensor]
    """t0 (the last emitted token), then each drafted token [bs]."""
    grammar: RoundGrammar | None
    penalties: RoundPenalties | None
    rows: SamplingRows
    drafts: list[bool]
    """Requests whose drafts are offered to verification; the others take one plain step
    (`eligibility.py`): their drafts are made but never offered."""
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)
    """q of each draft step, for the requests that sample."""
    round_buffer_bytes: int = 0
    """Bytes of the drafting buffers at the round's last step."""
    forwards: list[int] = field(default_factory=list)
    """Level-1 (compressed-tier) forwards each request took part in."""
    proposed: list[int] = field(default_factory=list)
    """Tokens the level-2 drafter proposed for each request."""
    kept: list[int] = field(default_factory=list)
    """Of those, the tokens level 1 kept as drafts."""
    stashed: bool = False
    """The drafts are the requests' stashes, made before the exact KV (`early.py`)."""
    committed_host: list[int] = field(init=False)
    """`committed_cpu` as Python ints, read once when the round is planned: the drafting steps
    build their forwards from it."""

    def __post_init__(self) -> None:
        self.committed_host = self.committed_cpu.tolist()

    def chain(self) -> torch.Tensor:
        """[bs, k + 1]: t0, d1..dk."""
        return torch.stack(self.tokens, dim=1)

    def constrain(self, logits: torch.Tensor, requests: list[int], steps: list[int],
                  mask: Callable[[RoundGrammar], None],
                  drafts: list[list[int]] | None = None) -> None:
        """Change logits [rows, V] in place as plain decoding changes a step's: penalties, the
        grammar's mask (`mask` applies it), then the logit bias. Row r is request
        `requests[r]`'s chain position `steps[r]`, after its `drafts[i][:steps[r]]` (by
        default the round's drafts so far)."""
        if self.penalties is not None:
            if drafts is None:
                # Penalty states count tokens on the host (`penalties.py`): only rounds with
                # penalties copy their drafts there.
                drafts = self.chain()[:, 1:].tolist()
            self.penalties.penalize(logits, requests, steps, drafts)
        if self.grammar is not None:
            mask(self.grammar)
        if self.penalties is not None:
            self.penalties.bias(logits, requests)


def room(reqs: list) -> list[int]:
    """New tokens each request may still emit before max_new_tokens (a round emits at most
    drafts + 1)."""
    return [
        1 << 30 if req.sampling_params.max_new_tokens is None
        else max(1, req.sampling_params.max_new_tokens - len(req.output_ids))
        for req in reqs
    ]
