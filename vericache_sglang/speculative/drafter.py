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
import json
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.cpu.few_rows import few_row_linear
from vericache_sglang.models import DRAFT_VOCAB_FILE

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

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget everything seen (/flush_cache, as SGLang's NGRAM worker resets its corpus):
        after a flush the server drafts as a fresh one would."""

    def device_bytes(self) -> int:
        """Device bytes the drafter holds beyond the target's (weights, its own KV)."""
        return 0


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

    def reset(self) -> None:
        self.corpus.reset()
        self._inserted.clear()


@dataclass
class _DraftSequence:
    """A request as the draft model has read it: the tokens whose K/V its cache holds, and
    its logits for the token after them."""

    cache: Any
    tokens: list[int] = field(default_factory=list)
    next_logits: torch.Tensor | None = None


class ModelDrafter(Drafter):
    """A small causal LM sharing the target's tokenizer (`--vericache-draft-model`), decoding
    greedily on a KV cache of its own per request.

    Each proposal first brings the request's cache up to the context it is given: the cache
    keeps the longest prefix it shares with the context (what level 1 kept) and is cut there,
    so a rejected proposal's K/V is gone before the next one is made. The model runs through
    `transformers` on the target's device and dtype; where its input embedding equals the
    target's, it reads the target's tensor instead of holding a second copy.
    """

    name = "model"
    context = 1 << 62
    """The whole request: the model's cache covers it."""

    def __init__(self, path: str, device: torch.device | str, dtype: torch.dtype,
                 target_embedding: torch.Tensor | None = None, chunk: int = 512) -> None:
        self.model, self.token_ids = load_draft_model(path, device, dtype)
        self.chunk = chunk  # prompt tokens per forward: bounds the attention scores' size
        self.shared_embedding = self._share_embedding(target_embedding)
        self._seqs: dict[str, _DraftSequence] = {}

    def _share_embedding(self, target: torch.Tensor | None) -> bool:
        """Point the draft model's input embedding (and a head tied to it) at the target's
        tensor when they hold the same values: a vocabulary-sized matrix not stored twice."""
        own = self.model.get_input_embeddings()
        if (target is None or target.shape != own.weight.shape or target.dtype != own.weight.dtype
                or target.device != own.weight.device or not torch.equal(target, own.weight)):
            return False
        tied = self.model.get_output_embeddings()
        shared = torch.nn.Parameter(target, requires_grad=False)
        if tied is not None and tied.weight is own.weight:
            tied.weight = shared
        own.weight = shared
        return True

    def observe(self, reqs: list[Any]) -> None:
        """Nothing to do ahead: `propose` reads each request's context into the cache."""

    @torch.inference_mode()
    def propose(self, rids: list[str], contexts: list[list[int]], total_lens: list[int],
                lengths: list[int]) -> list[list[int]]:
        return [self._propose(rid, context, length) if length > 0 and context else []
                for rid, context, length in zip(rids, contexts, lengths, strict=True)]

    def _propose(self, rid: str, context: list[int], length: int) -> list[int]:
        seq = self._seqs.get(rid)
        if seq is None:
            from transformers import DynamicCache

            seq = self._seqs[rid] = _DraftSequence(DynamicCache(config=self.model.config))
        logits = self._read(seq, context)
        proposal: list[int] = []
        while True:
            best = logits.argmax()
            proposal.append(int(best if self.token_ids is None else self.token_ids[best]))
            if len(proposal) == length:
                return proposal
            logits = self._feed(seq, proposal[-1:])

    def _read(self, seq: _DraftSequence, context: list[int]) -> torch.Tensor:
        """The draft model's logits after `context`, its cache cut to what it shares with it."""
        keep = _shared_prefix(seq.tokens, context)
        if keep == len(seq.tokens) == len(context) and seq.next_logits is not None:
            return seq.next_logits
        keep = min(keep, len(context) - 1)  # at least one token to feed, for its logits
        if keep < len(seq.tokens):
            seq.cache.crop(keep - len(seq.tokens))
            del seq.tokens[keep:]
        logits = None
        for start in range(keep, len(context), self.chunk):
            logits = self._feed(seq, context[start:start + self.chunk])
        return logits

    def _feed(self, seq: _DraftSequence, tokens: list[int]) -> torch.Tensor:
        """Run `tokens` after the cached ones; their K/V join the cache."""
        ids = torch.tensor([tokens], device=self.model.device)
        with few_row_linear(self.model.device):  # proposals are checked by level 1
            out = self.model(input_ids=ids, past_key_values=seq.cache, use_cache=True,
                             logits_to_keep=1)
        seq.tokens.extend(tokens)
        seq.next_logits = out.logits[0, -1]
        return seq.next_logits

    def forget(self, rid: str) -> None:
        self._seqs.pop(rid, None)

    def reset(self) -> None:
        self._seqs.clear()

    def device_bytes(self) -> int:
        tensors = [*self.model.parameters(), *self.model.buffers(), self.token_ids]
        for seq in self._seqs.values():
            for layer in seq.cache.layers:
                tensors += [getattr(layer, "keys", None), getattr(layer, "values", None)]
        total = storage_bytes(tensors)
        if self.shared_embedding:
            total -= storage_bytes([self.model.get_input_embeddings().weight])
        return total


def _shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of `a` and `b` (list slices compare in C; a
    binary search over them beats a Python loop on long requests)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    # The first mismatch is the least m with a[:m + 1] != b[:m + 1].
    return bisect_left(range(n), True, key=lambda m: a[:m + 1] != b[:m + 1])


def read_draft_vocab(path: str | Path, vocab_size: int) -> list[int] | None:
    """The token ids of a draft model's `DRAFT_VOCAB_FILE` (None without one); ValueError
    where the file is not a list of distinct ids below `vocab_size`."""
    file = Path(path) / DRAFT_VOCAB_FILE
    if not file.is_file():
        return None
    try:
        ids = json.loads(file.read_text())["token_ids"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read {file}: {e!r}") from None
    if (not isinstance(ids, list) or not ids or len(set(ids)) != len(ids)
            or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)):
        raise ValueError(f"{file}: token_ids must be distinct ids in [0, {vocab_size})")
    return ids


def load_draft_model(path: str | Path, device: torch.device | str, dtype: torch.dtype):
    """A draft model as the drafter runs it, and the target token each row of its head
    stands for (None: row i is token i). With `DRAFT_VOCAB_FILE` the head keeps only the
    listed rows, and the full-vocabulary head is not kept."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, local_files_only=True).to(device).eval()
    head = model.get_output_embeddings()
    ids = read_draft_vocab(path, head.weight.shape[0])
    if ids is None:
        return model, None
    token_ids = torch.tensor(ids, dtype=torch.long, device=head.weight.device)
    rows = torch.nn.Linear(head.in_features, len(ids), bias=False, device=head.weight.device,
                           dtype=head.weight.dtype)
    rows.weight = torch.nn.Parameter(head.weight[token_ids], requires_grad=False)
    model.set_output_embeddings(rows)
    model.config.tie_word_embeddings = False
    return model, token_ids


def check_draft_model(path: str, tokenizer_path: str) -> None:
    """Refuse a draft model whose tokenizer maps text to other ids than the target's: its
    proposals would be other tokens than they read as. Raises ValueError with the reason."""
    from transformers import AutoTokenizer

    def vocab(where: str) -> dict[str, int]:
        try:
            return AutoTokenizer.from_pretrained(where, local_files_only=True).get_vocab()
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the tokenizer of {where}: {e}") from None

    target_vocab = vocab(tokenizer_path)
    if vocab(path) != target_vocab:
        raise ValueError(f"{path} does not share the target's tokenizer ({tokenizer_path})")
    read_draft_vocab(path, len(target_vocab))


def build_drafter(name: str, max_length: int, *, model_path: str | None = None,
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  target_embedding: torch.Tensor | None = None) -> Drafter | None:
    """The level-2 drafter `--vericache-drafter` names (None for 'none')."""
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter(max_length)
    if name == "model":
        if model_path is None:
            raise ValueError("the model drafter needs a model path")
        return ModelDrafter(model_path, device, dtype, target_embedding)
    raise ValueError(f"unknown drafter {name!r}")
