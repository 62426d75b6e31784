"""Drafting attention: the target model decodes over the compressed KV plus an exact tail.

`DraftAttnBackend` runs the target model one token at a time during a round. Each request's
committed prefix is read in its compressed form, never densely kept:

- with a prefix-stable compressor (KIVI), from the shared `CompressedPagePool`: the packed
  pages of its whole groups older than the recent window, through a page table, and the rest
  of its committed tokens (the recent window and the partial last group) exactly from the
  full KV pool;
- otherwise (token droppers, compositions), from the request's own `CompressedTier` block.

The tokens drafted in this round are attended exactly from a scratch tail this backend holds
for the round (the only buffer that lives across steps: bounded by batch x draft length, and
counted in `round_buffer_bytes`). Over the pool, one `vericache_kernels.decode_attention` call
reads all three parts (pages, exact window, tail up to each row's own step); over a request's
own block, the block and the tail are attended apart and combined by their log-sum-exp
(`vericache_kernels.merge_attention`). A sliding-window layer reads its window exactly instead
(`_window_attention`), and a softcapped layer caps its logits, as SGLang's backends do, so
drafts follow the model they are verified against. Nothing is written to the KV pool while
drafting, so a rejected draft leaves no trace.

Extend (prefill) is SGLang's `torch_native` forward over the full KV; for compressors that select
tokens by attention it also records the prompt's observation scores. The backend is lossy by
construction, so it is not registered as a server-wide `--attention-backend`: the drafting
worker owns an instance, and every token it drafts is verified over the full KV.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

import vericache_kernels as kernels
from vericache_sglang.attention.features import logit_cap, sliding_window, window_visible
from vericache_sglang.compress.attention_probs import causal_attention_probs
from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.tiers.compressed import CompressedTier
from vericache_sglang.tiers.compressed_pool import CompressedPagePool
from vericache_sglang.tiers.staging import StagingArea


@dataclass(frozen=True)
class _RowGroups:
    """A forward's rows grouped by request, so that a request with several rows reads its
    compressed prefix once: its rows' queries join its query heads (GQA groups `width` times
    as wide), padded with zero queries to the widest request."""

    requests: torch.Tensor
    """[A] the requests that have rows, ascending."""
    group: torch.Tensor
    """[R] each row's index among them."""
    offset: torch.Tensor
    """[R] each row's place among its request's rows."""
    width: int

    @classmethod
    def of(cls, requests: list[int], device) -> _RowGroups:
        order = sorted(set(requests))
        index = {request: n for n, request in enumerate(order)}
        seen: Counter[int] = Counter()
        offsets = []
        for request in requests:
            offsets.append(seen[request])
            seen[request] += 1
        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)
        return cls(tensor(order), tensor([index[r] for r in requests]), tensor(offsets),
                   max(seen.values()))

    def stack(self, q: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """[R, Hq, D] row queries -> [A, width * Hq, D], a request's rows within each group."""
        _, q_heads, dim = q.shape
        grid = q.new_zeros(len(self.requests), self.width, q_heads, dim)
        grid[self.group, self.offset] = q
        return (grid.view(len(self.requests), self.width, kv_heads, q_heads // kv_heads, dim)
                .transpose(1, 2).reshape(len(self.requests), -1, dim))

    def unstack(self, out: torch.Tensor, lse: torch.Tensor,
                kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of `stack` for attention's (out [A, width * Hq, Dv], lse [A, width * Hq])."""
        count, per_group = len(self.requests), out.shape[1] // (kv_heads * self.width)
        out = (out.view(count, kv_heads, self.width, per_group, out.shape[-1]).transpose(1, 2)
               .reshape(count, self.width, kv_heads * per_group, out.shape[-1]))
        lse = (lse.view(count, kv_heads, self.width, per_group).transpose(1, 2)
               .reshape(count, self.width, kv_heads * per_group))
        return out[self.group, self.offset], lse[self.group, self.offset]


class DraftAttnBackend(TorchNativeAttnBackend):
    """Decode over each request's compressed committed prefix plus its exact draft tail.

    Before a round the worker calls `begin_round(req_slots, committed_lens, max_steps)`;
    before draft step j it calls `set_step(j)`, and `end_round()` after the last step. A forward
    that checks several tokens of a request at once (a level-2 drafter's proposals) has one row
    per (request, step) instead: `set_rows(requests, steps)`; each row attends causally to the
    round's tokens up to its own step, written by this forward or earlier ones. Extend (prefill)
    is inherited unchanged: full KV, plus the prompt observation scores token-selecting
    compressors need.
    """

    def __init__(self, model_runner, tier: CompressedTier,
                 pool: CompressedPagePool | None = None,
                 staging: StagingArea | None = None) -> None:
        """`staging`: given when the full KV is in host memory; the round's exact rows are then
        read from it once per round into device buffers (counted as full-tier reads)."""
        super().__init__(model_runner)
        self.tier = tier
        self.pool = pool
        self.staging = staging
        self._window: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._committed: list[int] = []
        self._max_steps = 0
        # The rows of the next forward: request index (None: one row per request, in order)
        # and step of each row.
        self._row_requests: torch.Tensor | None = None
        # The same on the host (every request once, in order, when None above).
        self._row_request_ids: list[int] = []
        self._row_groups: _RowGroups | None = None
        self._row_steps: torch.Tensor | None = None
        self._last_step = 0
        # Per query head of the pool attention's rows: how many of the round's tokens it sees.
        self._tail_heads: torch.Tensor | None = None
        self._tail_k: dict[int, torch.Tensor] = {}
        self._tail_v: dict[int, torch.Tensor] = {}
        # Pool reads of the round: page table [B, max pages], paged tokens [B], and the full-pool
        # rows of each request's exact part [B, max exact] with its length [B].
        self._page_table: torch.Tensor | None = None
        self._paged_lens: torch.Tensor | None = None
        self._exact_rows: torch.Tensor | None = None
        self._exact_lens: torch.Tensor | None = None
        # Each request-pool slot's page ids of its last round (a few bytes per group of
        # context; checked against the pool before reuse, so a slot reused by another
        # request or a freed page only costs a fresh lookup).
        self._known_pages: dict[int, torch.Tensor] = {}
        # Seconds spent looking up (and compressing) pool pages since the worker last took
        # them: a one-off cost of a request's first drafting round, not of its draft length.
        self._lookup_seconds = 0.0
        # Sliding-window layers: the round's request slots, and each window size's
        # (key rows, visibility) for the current rows.
        self._slots: list[int] = []
        self._window_masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        out = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if self.tier.compressor.needs_scores:
            self.observe_prompt(q, layer, forward_batch)
        return out

    def observe_prompt(self, q, layer, forward_batch) -> None:
        """Record attention probabilities of each request's last extend queries."""
        window = self.tier.compressor.score_window()
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        start = 0
        for i, extend_len in enumerate(forward_batch.extend_seq_lens_cpu):
            seq_len = int(forward_batch.seq_lens_cpu[i])
            slot = int(forward_batch.req_pool_indices[i])
            rows = self.req_to_token_pool.req_to_token[slot, :seq_len]
            queries = q[start : start + extend_len]
            start += extend_len
            first = seq_len - extend_len  # position of the first extend query
            if window is not None:
                cut = max(extend_len - window, 0)
                queries, first = queries[cut:], first + cut
            scores = causal_attention_probs(queries, k_buffer[rows], first, layer.scaling,
                                            summed=window is None)
            self.tier.observe(layer.layer_id, slot, scores)

    def begin_round(self, req_slots: list[int], committed_lens: list[int],
                    max_steps: int) -> None:
        """Start drafting for a batch whose requests (at these request-pool slots) have these
        committed KV lengths. With a page pool, their whole old groups are looked up there (and
        compressed, the first time any request needs them); a round of no drafts reads
        nothing."""
        self.end_round()
        self._committed = list(committed_lens)
        self._slots = list(req_slots)
        self._max_steps = max_steps
        if max_steps > 0:
            self.set_step(0)
            if self.pool is not None:
                began = time.perf_counter()
                self._plan_pool_reads(req_slots)
                self._lookup_seconds += time.perf_counter() - began

    def take_lookup_seconds(self) -> float:
        """Seconds of page lookups and compression since the last call (on a GPU, the host's
        part: the kernels it queued are timed with the round)."""
        seconds, self._lookup_seconds = self._lookup_seconds, 0.0
        return seconds

    def set_step(self, step: int) -> None:
        """The next decode forward drafts from the token at committed length + `step`, one row
        per request."""
        self._set_rows(None, [step] * len(self._committed))

    def set_rows(self, requests: list[int], steps: list[int]) -> None:
        """The next decode forward has one row per entry: the token at committed length +
        `steps[r]` of request `requests[r]` (an index into `begin_round`'s batch)."""
        device = self.req_to_token_pool.req_to_token.device
        self._set_rows(torch.tensor(requests, dtype=torch.int64, device=device), steps)
        self._row_request_ids = list(requests)
        self._row_groups = _RowGroups.of(requests, device)

    def _set_rows(self, requests: torch.Tensor | None, steps: list[int]) -> None:
        if not all(0 <= step < self._max_steps for step in steps):
            raise ValueError(f"draft steps {steps} outside [0, {self._max_steps})")
        self._row_requests = requests
        self._row_request_ids = list(range(len(self._committed)))
        self._row_groups = self._tail_heads = None
        self._row_steps = torch.tensor(steps, dtype=torch.int64,
                                       device=self.req_to_token_pool.req_to_token.device)
        self._last_step = max(steps)
        self._window_masks.clear()

    def end_round(self) -> None:
        """Drop the round's buffers: the drafts' K/V and the pool read plan."""
        self._tail_k.clear()
        self._tail_v.clear()
        self._page_table = self._paged_lens = self._exact_rows = self._exact_lens = None
        self._row_requests = self._row_steps = self._row_groups = self._tail_heads = None
        self._window = []
        self._window_masks.clear()

    def round_buffer_bytes(self) -> int:
        """Bytes of the buffers that live for the current round (storages, measured)."""
        return storage_bytes([*self._tail_k.values(), *self._tail_v.values(), self._page_table,
                              self._row_requests, self._row_steps, self._tail_heads,
                              self._paged_lens, self._exact_rows, self._exact_lens,
                              *(t for pair in self._window for t in pair),
                              *(t for pair in self._window_masks.values() for t in pair)])

    def _plan_pool_reads(self, req_slots: list[int]) -> None:
        req_to_token = self.req_to_token_pool.req_to_token
        device = req_to_token.device
        page_lists, exact = [], []
        for slot, committed in zip(req_slots, self._committed, strict=True):
            rows = req_to_token[slot, :committed].to(torch.int64)
            pages = self.pool.pages(rows[: self.pool.compressible_len(committed)],
                                    self._known_pages.get(slot))
            self._known_pages[slot] = pages
            page_lists.append(pages)
            exact.append(rows[len(pages) * self.pool.group :])
        batch = len(req_slots)
        self._page_table = torch.zeros(batch, max(map(len, page_lists), default=0) or 1,
                                       dtype=torch.int32, device=device)
        for i, pages in enumerate(page_lists):
            self._page_table[i, : len(pages)] = pages
        self._paged_lens = torch.tensor([len(p) * self.pool.group for p in page_lists],
                                        dtype=torch.int32, device=device)
        self._exact_lens = torch.tensor([len(r) for r in exact], dtype=torch.int32,
                                        device=device)
        self._exact_rows = torch.zeros(batch, max(map(len, exact), default=0) or 1,
                                       dtype=torch.int64, device=device)
        for i, r in enumerate(exact):
            self._exact_rows[i, : len(r)] = r
        if self.staging is not None:
            began = time.perf_counter()
            self._window = [(self.token_to_kv_pool.get_key_buffer(layer)[self._exact_rows],
                             self.token_to_kv_pool.get_value_buffer(layer)[self._exact_rows])
                            for layer in range(self.staging.layers)]
            self.staging.record_direct(storage_bytes([t for pair in self._window for t in pair]),
                                       time.perf_counter() - began, [len(r) for r in exact])

    def _rows_of(self, per_request: torch.Tensor) -> torch.Tensor:
        """A per-request tensor's rows for the forward's rows."""
        return per_request if self._row_requests is None else per_request[self._row_requests]

    def _write_tail(self, layer, k: torch.Tensor, v: torch.Tensor) -> None:
        """Record the rows' K/V [rows, H, D] in the layer's scratch tail at their steps."""
        lid = layer.layer_id
        if lid not in self._tail_k:
            shape = (len(self._committed), self._max_steps, *k.shape[1:])
            self._tail_k[lid] = k.new_empty(shape)
            self._tail_v[lid] = v.new_empty(shape)
        requests = (torch.arange(len(self._committed), device=k.device)
                    if self._row_requests is None else self._row_requests)
        self._tail_k[lid][requests, self._row_steps] = k
        self._tail_v[lid][requests, self._row_steps] = v

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        del save_kv_cache  # drafting never writes the full KV pool
        heads, head_dim = layer.tp_k_head_num, layer.qk_head_dim
        q = q.reshape(-1, layer.tp_q_head_num, head_dim)
        if q.shape[0] != len(self._row_steps):
            raise RuntimeError("draft forward batch does not match set_step()/set_rows()")
        self._write_tail(layer, k.reshape(-1, heads, head_dim),
                         v.reshape(-1, heads, layer.v_head_dim))
        window = sliding_window(layer)
        if window is not None:
            out = self._window_attention(q, layer, window)
        elif self.pool is not None:
            out = self._pool_attention(q, layer)
        else:
            hi = self._last_step + 1
            tail_k, tail_v = (self._rows_of(tail[layer.layer_id][:, :hi])
                              for tail in (self._tail_k, self._tail_v))
            steps = (self._row_steps + 1).to(torch.int32)
            tail = kernels.decode_attention(q, None, tail_k, tail_v, steps, layer.scaling,
                                            logit_cap=logit_cap(layer))
            prefix = self._tier_attention(q, layer)
            out, _ = kernels.merge_attention([prefix, tail])
        return out.to(q.dtype).reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _window_plan(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a sliding-window layer: each request's key rows [B, window] of the full pool (its
        last `window` committed tokens, the first row where it has fewer), and which of them
        and of the round's tail each row sees [R, 1, 1, window + steps]. Once per forward and
        window size."""
        if window not in self._window_masks:
            device = self.req_to_token_pool.req_to_token.device
            committed = torch.tensor(self._committed, dtype=torch.int64, device=device)
            positions = committed[:, None] - window + torch.arange(window, device=device)
            slots = torch.tensor(self._slots, dtype=torch.int64, device=device)
            rows = self.req_to_token_pool.req_to_token[slots[:, None], positions.clamp(min=0)]
            tail = committed[:, None] + torch.arange(self._max_steps, device=device)
            key_pos = self._rows_of(torch.cat([positions, tail], dim=1))
            query_pos = self._rows_of(committed) + self._row_steps
            visible = (window_visible(query_pos[:, None], key_pos, window)
                       & (key_pos >= 0))[:, None, None]
            self._window_masks[window] = (rows.to(torch.int64), visible)
        return self._window_masks[window]

    def _window_attention(self, q: torch.Tensor, layer, window: int) -> torch.Tensor:
        """A sliding-window layer reads its window exactly: the committed tokens within it
        from the full pool, and the round's tail, as SGLang's backends do. The window is
        short, so the compressed pages would save little here."""
        rows, visible = self._window_plan(window)
        lid = layer.layer_id
        flat = rows.flatten()
        committed_k, committed_v = (
            buffer.index_select(0, flat).view(*rows.shape, *buffer.shape[1:])
            for buffer in (self.token_to_kv_pool.get_key_buffer(lid),
                           self.token_to_kv_pool.get_value_buffer(lid)))
        # Tail steps not drafted yet hold anything, NaN too: zero what a row does not see.
        seen = visible[:, 0, 0, :, None, None]
        keys, values = (
            self._rows_of(torch.cat([committed.to(q.dtype), tail[lid]], dim=1)).where(seen, 0.0)
            for committed, tail in ((committed_k, self._tail_k), (committed_v, self._tail_v)))
        out = kernels.dense_attention(q[:, :, None], keys.transpose(1, 2),
                                      values.transpose(1, 2), visible, layer.scaling,
                                      logit_cap(layer))
        return out[:, :, 0]

    def _tail_head_lengths(self, q_heads: int, kv_heads: int) -> torch.Tensor:
        """[requests, query heads] of the pool attention's query: the round's tokens each head
        sees (its row's step + 1; 0 for a stacked request's padding). Once per forward."""
        if self._tail_heads is None:
            seen = (self._row_steps + 1).to(torch.int32)[:, None, None].expand(-1, q_heads, 1)
            if self._row_groups is not None:
                seen = self._row_groups.stack(seen, kv_heads)
            self._tail_heads = seen[..., 0].contiguous()
        return self._tail_heads

    def _pool_attention(self, q: torch.Tensor, layer) -> torch.Tensor:
        """Attention over the pages of each request's old groups, its exact part (read once per
        request, however many rows it has) and the round's tokens up to each row's own, in one
        kernel call."""
        lid, groups = layer.layer_id, self._row_groups
        every = groups is None or len(groups.requests) == len(self._committed)

        def pick(per_request: torch.Tensor) -> torch.Tensor:
            return per_request if every else per_request[groups.requests]

        if self._window:
            k_exact, v_exact = map(pick, self._window[lid])
        else:
            rows = pick(self._exact_rows)
            # index_select copies whole rows; advanced indexing goes element by element
            k_exact, v_exact = (
                buffer.index_select(0, rows.flatten()).view(*rows.shape, *buffer.shape[1:])
                for buffer in (self.token_to_kv_pool.get_key_buffer(lid),
                               self.token_to_kv_pool.get_value_buffer(lid)))
        paged = self.pool.layer(lid, pick(self._page_table), pick(self._paged_lens))
        kv_heads = layer.tp_k_head_num
        query = q if groups is None else groups.stack(q, kv_heads)
        tail = (pick(self._tail_k[lid]), pick(self._tail_v[lid]),
                self._tail_head_lengths(q.shape[1], kv_heads))
        out, lse = kernels.decode_attention(query, paged, k_exact, v_exact,
                                            pick(self._exact_lens), layer.scaling, tail,
                                            logit_cap(layer))
        return out if groups is None else groups.unstack(out, lse, kv_heads)[0]

    def _tier_attention(self, q: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over each row's request's own compressed block of its committed prefix
        (request slots and rows from the host plan: nothing read back)."""
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        outs, lses = [], []
        for i, request in enumerate(self._row_request_ids):
            slot = self._slots[request]
            block = self.tier.block(
                layer.layer_id, slot, req_to_token[slot, : self._committed[request]], k_buffer,
                v_buffer, query=q[i], sm_scale=layer.scaling,
            )
            out, lse = block.attend_lse(q[i], layer.scaling, logit_cap(layer))
            outs.append(out)
            lses.append(lse)
        return torch.stack(outs), torch.stack(lses)
