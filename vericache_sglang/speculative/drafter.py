"""Level-2 drafters: cheap proposers under the compressed-KV drafter.

A round's draft is made by the target model over the compressed tier (level 1). With a level-2
drafter, level 1 no longer decodes one token per forward: the drafter proposes a few tokens,
and one level-1 forward over [last token, proposals] checks them all (`worker.py`). A proposal
only decides how much work a forward saves; every emitted token is still verified over the
full KV, so a drafter that proposes garbage costs speed, never output.

The worker owns its drafter, as SGLang's NGRAM worker owns its `NgramCorpus`.
"""

from __future__ import annotations

import abc
from typing import Any

PAD_TOKEN = 0
"""What `NgramCorpus` fills a draft with where it has no match."""


class Drafter(abc.ABC):
    """Proposes continuations of a request's tokens (deterministic: a proposal is a point
    mass, so level 1 accepts exactly the proposed tokens it would have chosen itself)."""

    name: str
    context: int
    """How many of a request's last tokens a proposal looks at."""

    @abc.abstractmethod
    def observe(self, reqs: list[Any]) -> None:
        """See what the batch's requests have emitted so far (their prompt the first time)."""

    @abc.abstractmethod
    def propose(self, rids: list[str], contexts: list[list[int]], total_lens: list[int],
                lengths: list[int]) -> list[list[int]]:
        """Up to `lengths[i]` tokens to follow `contexts[i]` (the last tokens of request
        `rids[i]`, whose full length is `total_lens[i]`); fewer or none where it has no
        guess."""

    @abc.abstractmethod
    def forget(self, rid: str) -> None:
        """Drop a finished request's state."""


class NgramDrafter(Drafter):
    """SGLang's n-gram corpus (`sglang.srt.speculative.cpp_ngram`, built by SGLang's JIT
    loader): a trie over the token n-grams of every request seen, matched against a request's
    last tokens. Unlike SGLang's NGRAM worker, which feeds the corpus only the tokens it
    decodes, this one also feeds it each prompt, which code, agent traces and long documents
    repeat."""

    name = "ngram"

    def __init__(self, max_length: int, depth: int = 18, capacity: int = 1_000_000) -> None:
        from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

        # Breadth 1 makes the corpus return a chain: the context's last token, then the
        # proposal.
        self.corpus = NgramCorpus(max_trie_depth=depth, min_bfs_breadth=1, max_bfs_breadth=1,
                                  draft_token_num=max_length + 1, match_type="BFS",
                                  capacity=capacity)
        self.context = depth
        self.width = max_length + 1
        self._inserted: dict[str, int] = {}  # rid -> tokens of it the corpus has seen

    def observe(self, reqs: list[Any]) -> None:
        fresh = []
        for req in reqs:
            seen = self._inserted.get(req.rid, 0)
            total = len(req.origin_input_ids) + len(req.output_ids)
            if total <= seen:
                continue
            tokens = [*req.origin_input_ids, *req.output_ids]
            # Overlap what the corpus has by one n-gram, so the new n-grams are complete.
            fresh.append(tokens[max(0, seen - self.context):])
            self._inserted[req.rid] = total
        if fresh:
            self.corpus.batch_put(fresh)
            self.corpus.synchronize()

    def propose(self, rids: list[str], contexts: list[list[int]], total_lens: list[int],
                lengths: list[int]) -> list[list[int]]:
        tokens, mask = self.corpus.batch_get(rids, [c[-self.context:] for c in contexts],
                                             total_lens)
        width = self.width
        tokens = tokens.reshape(len(rids), width)
        mask = mask.reshape(len(rids), width, width)
        proposals = []
        for row, (toks, rows) in enumerate(zip(tokens, mask, strict=True)):
            # Node j is on the chain iff it sees every node before it. Without a match the
            # corpus pads with token 0 under the root, which reads as a one-token chain.
            chain = 1
            while chain < width and rows[chain, :chain + 1].all():
                chain += 1
            proposal = toks[1:chain][: lengths[row]].tolist()
            proposals.append([] if proposal == [PAD_TOKEN] else proposal)
        return proposals

    def forget(self, rid: str) -> None:
        self._inserted.pop(rid, None)
        self.corpus.erase_match_state([rid])


def build_drafter(name: str, max_length: int) -> Drafter | None:
    """The level-2 drafter `--vericache-drafter` names (None for 'none')."""
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter(max_length)
    raise ValueError(f"unknown drafter {name!r}")
