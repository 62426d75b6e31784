"""Request-owned compressed blocks: per request and layer, a compressed copy of its KV.

For compressors that are not prefix-stable (token droppers pick tokens per request, and
compositions with them): their blocks cannot be shared pages (`tiers.compressed_pool`). The full
tier is SGLang's KV pool (rows indexed through `req_to_token`). This tier follows it:
when attention asks for a request's block, new rows are compressed on the way (`append`), so
each token is compressed once. Blocks are keyed by (layer, request slot) and remember the pool
rows they cover; a slot whose rows no longer start with those is rebuilt, and the owner of a
request's lifetime calls `release` when it finishes. Every layer asks with the same rows, so
they are compared and copied once per slot and step (`new_step`), not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_sglang.compress import CompressedKV, Compressor
from vericache_sglang.compress.attention_probs import causal_attention_probs


@dataclass
class _Entry:
    block: CompressedKV
    rows: torch.Tensor
    """Full-pool rows the block covers, in token order."""


@dataclass
class _Seen:
    """A request slot's rows as this step asked for them, and what they were checked against."""

    rows: tuple[int, int, int]
    """(address, length, version) of the rows: a write torch counts changes it."""
    prefixes: list[torch.Tensor]
    """Entry rows found to start these rows (by identity: layers extended together share)."""
    copy: torch.Tensor | None = None
    """The copy of these rows every layer's entry extended this step holds."""


class CompressedTier:
    """Compressed KV blocks built from, and kept in step with, the full KV pool."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._observed: dict[tuple[int, int], torch.Tensor] = {}
        self._seen: dict[int, _Seen] = {}

    def new_step(self) -> None:
        """Forget the rows checked so far: the pool's rows may change between steps without a
        write torch counts (a device kernel's)."""
        self._seen.clear()

    def observe(self, layer_id: int, req_slot: int, scores: torch.Tensor) -> None:
        """Attention probabilities [Hq, W, T] of a prompt's last W queries over its T tokens,
        for compressors that select tokens by attention (SnapKV, H2O)."""
        self._observed[(layer_id, req_slot)] = scores

    def block(
        self,
        layer_id: int,
        req_slot: int,
        rows: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        query: torch.Tensor | None = None,
        sm_scale: float | None = None,
    ) -> CompressedKV:
        """The compressed block for the request's tokens held at `rows` of the full pool.

        `query` [Hq, D] stands in as a one-query observation window when a token-selecting
        compressor has seen no prompt scores (e.g. the whole prompt was a cached prefix).
        """
        key = (layer_id, req_slot)
        entry = self._entries.get(key)
        seen = self._seen_rows(req_slot, rows)
        if entry is None or not self._starts(seen, rows, entry.rows):
            entry = self._build(key, rows, k_buffer, v_buffer, query, sm_scale)
        covered = len(entry.rows)
        if covered < len(rows):
            new = rows[covered:]
            self.compressor.append(
                entry.block, k_buffer[new], v_buffer[new],
                torch.arange(covered, len(rows), device=rows.device),
            )
            if seen.copy is None:
                seen.copy = rows.clone()
                seen.prefixes.append(seen.copy)
            entry.rows = seen.copy
        return entry.block

    def _seen_rows(self, req_slot: int, rows: torch.Tensor) -> _Seen:
        # Inference tensors count no writes; `new_step` covers them.
        state = (rows.data_ptr(), len(rows), -1 if rows.is_inference() else rows._version)
        seen = self._seen.get(req_slot)
        if seen is None or seen.rows != state:
            seen = self._seen[req_slot] = _Seen(state, [])
        return seen

    @staticmethod
    def _starts(seen: _Seen, rows: torch.Tensor, prefix: torch.Tensor) -> bool:
        """Whether `rows` start with `prefix`, compared once per prefix and step."""
        if any(prefix is checked for checked in seen.prefixes):
            return True
        if len(prefix) > len(rows) or not torch.equal(prefix, rows[: len(prefix)]):
            return False
        seen.prefixes.append(prefix)
        return True

    def _build(self, key, rows, k_buffer, v_buffer, query, sm_scale) -> _Entry:
        """Compress the tokens the observed scores cover (the prompt); later ones are appended."""
        scores = self._observed.pop(key, None)
        if scores is None and self.compressor.needs_scores:
            if query is None:
                raise ValueError("a token-selecting compressor needs observed scores or a query")
            keys = k_buffer[rows]
            scale = keys.shape[2] ** -0.5 if sm_scale is None else sm_scale
            scores = causal_attention_probs(query[None], keys, len(rows) - 1, scale)
        n = len(rows) if scores is None else min(scores.shape[-1], len(rows))
        head = rows[:n]
        block = self.compressor.compress(
            k_buffer[head], v_buffer[head], torch.arange(n, device=rows.device),
            None if scores is None else scores[..., :n], layer=key[0],
        )
        self._entries[key] = entry = _Entry(block, head.clone())
        return entry

    def release(self, req_slot: int) -> None:
        """Drop every layer's block of a finished request."""
        for key in [k for k in self._entries if k[1] == req_slot]:
            del self._entries[key]
        for key in [k for k in self._observed if k[1] == req_slot]:
            del self._observed[key]
        self._seen.pop(req_slot, None)

    def nbytes(self) -> int:
        """Exact bytes the tier holds now."""
        return sum(e.block.nbytes() for e in self._entries.values())

