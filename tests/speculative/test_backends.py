"""The drafting and verification attention backends on real SGLang pools (no server, no model).

Drafting reads the committed prefix from the compressed tier and the round's drafts exactly,
and never writes the KV pool; verification is causal attention over the full KV that writes
the verified tokens' K/V.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention import torch_native_backend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from tests.support.compressor_oracles import attention
from vericache_sglang.attention.draft import DraftAttnBackend
from vericache_sglang.attention.verify import VerifyAttnBackend
from vericache_sglang.compress import parse_compressor_spec
from vericache_sglang.speculative.info import VeriCacheVerifyInput
from vericache_sglang.tiers.compressed import CompressedTier

Q_HEADS, KV_HEADS, DIM = 9, 3, 64
POOL = 1024
SLOT = 1
PREFIX = 300
SCALE = DIM**-0.5


class Pools:
    """One request whose committed prefix sits at scattered rows of real SGLang pools."""

    def __init__(self, spec: str = "kivi:bits=2,group=32,residual=32",
                 **layer_features) -> None:
        gen = torch.Generator().manual_seed(0)
        self.pool = MHATokenToKVPool(size=POOL, page_size=1, dtype=torch.float32,
                                     head_num=KV_HEADS, head_dim=DIM, layer_num=1, device="cpu",
                                     enable_memory_saver=False)
        self.req_to_token = ReqToTokenPool(size=4, max_context_len=POOL, device="cpu",
                                           enable_memory_saver=False)
        self.rows = torch.randperm(POOL - 1, generator=gen)[: PREFIX + 16] + 1
        self.req_to_token.req_to_token[SLOT, : len(self.rows)] = self.rows.to(torch.int32)
        self.keys = torch.randn(len(self.rows), KV_HEADS, DIM, generator=gen)
        self.values = torch.randn(len(self.rows), KV_HEADS, DIM, generator=gen)
        self.queries = torch.randn(len(self.rows), Q_HEADS, DIM, generator=gen)
        self.pool.k_buffer[0][self.rows[:PREFIX]] = self.keys[:PREFIX]
        self.pool.v_buffer[0][self.rows[:PREFIX]] = self.values[:PREFIX]
        self.layer = RadixAttention(Q_HEADS, DIM, SCALE, KV_HEADS, layer_id=0, **layer_features)
        self.runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req_to_token,
                                      token_to_kv_pool=self.pool)
        self.tier = CompressedTier(parse_compressor_spec(spec))

    def batch(self, mode: ForwardMode, seq_len: int, locs: torch.Tensor, **kw) -> ForwardBatch:
        return ForwardBatch(
            forward_mode=mode, batch_size=1, input_ids=torch.zeros(len(locs), dtype=torch.int64),
            req_pool_indices=torch.tensor([SLOT]), seq_lens=torch.tensor([seq_len]),
            out_cache_loc=locs, seq_lens_sum=seq_len, **kw,
        )


def test_draft_reads_the_tier_prefix_and_an_exact_tail_and_writes_nothing():
    p = Pools()
    backend = DraftAttnBackend(p.runner, p.tier)
    pool_before = (p.pool.k_buffer[0].clone(), p.pool.v_buffer[0].clone())
    steps = 3
    backend.begin_round([SLOT], [PREFIX], steps)
    for step in range(steps):
        t = PREFIX + step
        backend.set_step(step)
        fb = p.batch(ForwardMode.DECODE, t + 1, p.rows[t : t + 1])
        out = backend.forward_decode(p.queries[t].reshape(1, -1), p.keys[t : t + 1],
                                     p.values[t : t + 1], p.layer, fb)
        prefix_k, prefix_v = p.tier._entries[(0, SLOT)].block.dense()
        assert len(prefix_k) == PREFIX  # only committed tokens are ever compressed
        expected = attention(p.queries[t], torch.cat([prefix_k, p.keys[PREFIX : t + 1]]),
                             torch.cat([prefix_v, p.values[PREFIX : t + 1]]), SCALE)
        torch.testing.assert_close(out.view(Q_HEADS, DIM), expected, rtol=1e-4, atol=1e-5)
        full = attention(p.queries[t], p.keys[: t + 1], p.values[: t + 1], SCALE)
        assert not torch.allclose(out.view(Q_HEADS, DIM), full, atol=1e-4)  # lossy: tier read
    backend.end_round()
    assert torch.equal(p.pool.k_buffer[0], pool_before[0])
    assert torch.equal(p.pool.v_buffer[0], pool_before[1])


@pytest.mark.parametrize("spec", ["kivi:bits=2,group=32,residual=32", "snapkv:ratio=0.5"])
def test_one_forward_over_several_steps_equals_one_step_at_a_time(spec):
    """A level-1 check forward (several tokens of a request in one forward, each attending to
    the round's tokens up to its own step) computes what one-token draft steps compute."""
    p = Pools(spec)
    steps = 4
    one_at_a_time = DraftAttnBackend(p.runner, p.tier)
    one_at_a_time.begin_round([SLOT], [PREFIX], steps)
    expected = []
    for step in range(steps):
        t = PREFIX + step
        one_at_a_time.set_step(step)
        fb = p.batch(ForwardMode.DECODE, t + 1, p.rows[t : t + 1])
        expected.append(one_at_a_time.forward_decode(
            p.queries[t].reshape(1, -1), p.keys[t : t + 1], p.values[t : t + 1], p.layer, fb))
    one_at_a_time.end_round()
    together = DraftAttnBackend(p.runner, p.tier)
    together.begin_round([SLOT], [PREFIX], steps)
    # Step 0 alone, then steps 1..3 in one forward (rows of the same request).
    together.set_step(0)
    first = together.forward_decode(p.queries[PREFIX].reshape(1, -1), p.keys[PREFIX : PREFIX + 1],
                                    p.values[PREFIX : PREFIX + 1], p.layer,
                                    p.batch(ForwardMode.DECODE, PREFIX + 1,
                                            p.rows[PREFIX : PREFIX + 1]))
    together.set_rows([0, 0, 0], [1, 2, 3])
    span = slice(PREFIX + 1, PREFIX + steps)
    rows = p.batch(ForwardMode.DECODE, PREFIX + steps, p.rows[span])
    rows.req_pool_indices = torch.tensor([SLOT] * 3)  # one row per token, as the worker sends
    rest = together.forward_decode(p.queries[span].reshape(3, -1), p.keys[span], p.values[span],
                                   p.layer, rows)
    torch.testing.assert_close(torch.cat([first, rest]), torch.cat(expected), rtol=1e-5,
                               atol=1e-6)


def test_draft_step_outside_the_round_is_refused():
    backend = DraftAttnBackend(Pools().runner, CompressedTier(parse_compressor_spec("kivi:bits=4")))
    backend.begin_round([SLOT], [PREFIX], 2)
    with pytest.raises(ValueError):
        backend.set_step(2)


def test_verify_batch_computes_only_the_verified_queries(monkeypatch):
    """Two requests with different committed lengths in one TARGET_VERIFY forward: each of
    their `width` tokens attends causally over its own full KV, and attention is computed for
    those queries only (torch_native's extend pads the queries to the whole sequence: a
    verify would cost O(context^2) per layer)."""
    gen = torch.Generator().manual_seed(1)
    pool = MHATokenToKVPool(size=POOL, page_size=1, dtype=torch.float32, head_num=KV_HEADS,
                            head_dim=DIM, layer_num=1, device="cpu", enable_memory_saver=False)
    req_to_token = ReqToTokenPool(size=4, max_context_len=POOL, device="cpu",
                                  enable_memory_saver=False)
    width, prefixes, slots = 4, [300, 170], [1, 3]
    rows = (torch.randperm(POOL - 1, generator=gen)[: sum(prefixes) + 2 * width] + 1).split(
        [prefixes[0] + width, prefixes[1] + width])
    keys = [torch.randn(len(r), KV_HEADS, DIM, generator=gen) for r in rows]
    values = [torch.randn(len(r), KV_HEADS, DIM, generator=gen) for r in rows]
    queries = [torch.randn(width, Q_HEADS, DIM, generator=gen) for _ in rows]
    for slot, r, k, v, n in zip(slots, rows, keys, values, prefixes, strict=True):
        req_to_token.req_to_token[slot, : len(r)] = r.to(torch.int32)
        pool.k_buffer[0][r[:n]], pool.v_buffer[0][r[:n]] = k[:n], v[:n]
    runner = SimpleNamespace(device="cpu", req_to_token_pool=req_to_token, token_to_kv_pool=pool)
    layer = RadixAttention(Q_HEADS, DIM, SCALE, KV_HEADS, layer_id=0)
    locs = torch.cat([r[n:] for r, n in zip(rows, prefixes, strict=True)])
    lens = torch.tensor(prefixes)
    positions = torch.cat([torch.arange(n, n + width) for n in prefixes])
    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=2,
        input_ids=torch.zeros(2 * width, dtype=torch.int64), req_pool_indices=torch.tensor(slots),
        seq_lens=lens, seq_lens_cpu=lens.clone(), out_cache_loc=locs,
        seq_lens_sum=sum(prefixes), positions=positions,
        spec_info=VeriCacheVerifyInput(draft_token_num=width, positions=positions),
    )
    backend = VerifyAttnBackend(runner)
    backend.init_forward_metadata(fb)
    sdpa, query_lengths = torch.nn.functional.scaled_dot_product_attention, []

    def recording_sdpa(query, *args, **kwargs):
        query_lengths.append(query.shape[-2])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    monkeypatch.setattr(torch_native_backend, "scaled_dot_product_attention", recording_sdpa)
    out = backend.forward_extend(
        torch.cat(queries).reshape(2 * width, -1),
        torch.cat([k[n:] for k, n in zip(keys, prefixes, strict=True)]),
        torch.cat([v[n:] for v, n in zip(values, prefixes, strict=True)]), layer, fb,
    ).view(2, width, Q_HEADS, DIM)
    assert query_lengths == [width]  # one call for the batch, the chain's queries only
    for b, n in enumerate(prefixes):
        for j in range(width):
            expected = attention(queries[b][j], keys[b][: n + j + 1], values[b][: n + j + 1],
                                 SCALE)
            torch.testing.assert_close(out[b, j], expected, rtol=1e-4, atol=1e-5)
        assert torch.equal(pool.k_buffer[0][rows[b][n:]], keys[b][n:])


WINDOW, CAP = 40, 5.0
"""A sliding window shorter than a round's reach back, and a cap that bends the logits of
these random queries (|q.k| * scale is several units)."""


def _windowed(t: int) -> slice:
    """The keys a query at position t sees under SGLang's window: t - WINDOW .. t."""
    return slice(max(t - WINDOW, 0), t + 1)


@pytest.mark.parametrize("features", [{"sliding_window_size": WINDOW},
                                      {"sliding_window_size": WINDOW, "logit_cap": CAP}])
def test_a_windowed_layer_drafts_over_its_exact_window(features):
    """A sliding-window layer's draft reads exactly the keys SGLang's backends give it (the
    committed ones within its window from the full pool, the round's own), capped where the
    layer caps: exact attention, where a full layer's draft reads the lossy tier. One-token
    steps and a several-rows forward agree."""
    p = Pools(**features)
    cap = features.get("logit_cap", 0.0)
    steps = 4
    backend = DraftAttnBackend(p.runner, p.tier)
    backend.begin_round([SLOT], [PREFIX], steps)
    outs = []
    for step in range(2):
        t = PREFIX + step
        backend.set_step(step)
        fb = p.batch(ForwardMode.DECODE, t + 1, p.rows[t : t + 1])
        outs.append(backend.forward_decode(p.queries[t].reshape(1, -1), p.keys[t : t + 1],
                                           p.values[t : t + 1], p.layer, fb))
    backend.set_rows([0, 0], [2, 3])
    span = slice(PREFIX + 2, PREFIX + steps)
    rows = p.batch(ForwardMode.DECODE, PREFIX + steps, p.rows[span])
    rows.req_pool_indices = torch.tensor([SLOT] * 2)
    outs.append(backend.forward_decode(p.queries[span].reshape(2, -1), p.keys[span],
                                       p.values[span], p.layer, rows))
    got = torch.cat(outs).view(steps, Q_HEADS, DIM)
    for step in range(steps):
        t = PREFIX + step
        expected = attention(p.queries[t], p.keys[_windowed(t)], p.values[_windowed(t)], SCALE,
                             cap)
        torch.testing.assert_close(got[step], expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got[0], attention(p.queries[PREFIX], p.keys[: PREFIX + 1],
                                                p.values[: PREFIX + 1], SCALE, cap), atol=1e-3)


def test_a_capped_layer_drafts_with_its_cap():
    """Over the compressed tier (lossy), a capped layer's logits are capped: the draft equals
    capped attention over the tier's keys, not uncapped attention."""
    p = Pools(logit_cap=CAP)
    backend = DraftAttnBackend(p.runner, p.tier)
    backend.begin_round([SLOT], [PREFIX], 1)
    backend.set_step(0)
    t = PREFIX
    out = backend.forward_decode(p.queries[t].reshape(1, -1), p.keys[t : t + 1],
                                 p.values[t : t + 1], p.layer,
                                 p.batch(ForwardMode.DECODE, t + 1, p.rows[t : t + 1]))
    prefix_k, prefix_v = p.tier._entries[(0, SLOT)].block.dense()
    keys = torch.cat([prefix_k, p.keys[t : t + 1]])
    values = torch.cat([prefix_v, p.values[t : t + 1]])
    capped = attention(p.queries[t], keys, values, SCALE, CAP)
    torch.testing.assert_close(out.view(Q_HEADS, DIM), capped, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out.view(Q_HEADS, DIM), attention(p.queries[t], keys, values, SCALE),
                              atol=1e-3)


@pytest.mark.parametrize("features", [{}, {"sliding_window_size": WINDOW}, {"logit_cap": CAP},
                                      {"sliding_window_size": WINDOW, "logit_cap": CAP}])
def test_verify_is_causal_attention_over_the_full_kv_and_writes_it(features):
    """Each chain query attends causally over the full KV, within the layer's window and with
    its cap where it has them, and the chain's K/V are written."""
    p = Pools(**features)
    backend = VerifyAttnBackend(p.runner)
    width = 5
    locs = p.rows[PREFIX : PREFIX + width]
    positions = torch.arange(PREFIX, PREFIX + width)
    fb = p.batch(ForwardMode.TARGET_VERIFY, PREFIX, locs,
                 spec_info=VeriCacheVerifyInput(draft_token_num=width, positions=positions))
    backend.init_forward_metadata(fb)
    span = slice(PREFIX, PREFIX + width)
    out = backend.forward_extend(p.queries[span].reshape(width, -1), p.keys[span],
                                 p.values[span], p.layer, fb)
    windowed = "sliding_window_size" in features
    for i in range(width):
        t = PREFIX + i
        seen = _windowed(t) if windowed else slice(0, t + 1)
        expected = attention(p.queries[t], p.keys[seen], p.values[seen], SCALE,
                             features.get("logit_cap", 0.0))
        torch.testing.assert_close(out[i].view(Q_HEADS, DIM), expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(p.pool.k_buffer[0][locs], p.keys[span])
    assert torch.equal(p.pool.v_buffer[0][locs], p.values[span])
