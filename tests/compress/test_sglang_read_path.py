"""The drafting read path over a request's own compressed block, on real SGLang pools and KV.

`DraftAttnBackend` without a page pool (the path of token droppers and compositions) is driven
through SGLang's own `forward_extend`/`forward_decode` with a real `RadixAttention` layer,
`ForwardBatch`, `MHATokenToKVPool` and `ReqToTokenPool` on the CPU, over the demo model's real
K/V, queries and prompt attention scores. Each decode drafts one token over the committed
prefix's block plus its own exact K/V; the token's K/V then reach the pool, as a verification
that accepts it writes them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from tests.support.compressor_oracles import attention
from vericache_sglang.attention.draft import DraftAttnBackend
from vericache_sglang.compress import parse_compressor_spec
from vericache_sglang.tiers.compressed import CompressedTier

LAYER = 14
POOL = 2048
SLOT = 2


class Harness:
    """Real SGLang pools holding one request whose KV sits at scattered pool rows."""

    def __init__(self, real_kv, spec: str) -> None:
        self.kv = real_kv.layers[LAYER]
        tokens, heads, dim = self.kv.keys.shape
        self.pool = MHATokenToKVPool(size=POOL, page_size=1, dtype=torch.float32,
                                     head_num=heads, head_dim=dim, layer_num=1, device="cpu",
                                     enable_memory_saver=False)
        self.req_to_token = ReqToTokenPool(size=4, max_context_len=POOL, device="cpu",
                                           enable_memory_saver=False)
        # Rows out of order, so reading through req_to_token is what gets tested.
        order = torch.randperm(POOL - 1, generator=torch.Generator().manual_seed(0))
        self.rows = order[:tokens] + 1
        self.layer = RadixAttention(real_kv.num_q_heads, dim, real_kv.scaling, heads, layer_id=0)
        runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req_to_token,
                                 token_to_kv_pool=self.pool)
        self.tier = CompressedTier(parse_compressor_spec(spec))
        self.backend = DraftAttnBackend(runner, self.tier)

    def prefill(self, n: int) -> None:
        """Run SGLang's extend over the first n prompt tokens (writes the full KV)."""
        rows = self.rows[:n]
        self.req_to_token.req_to_token[SLOT, :n] = rows.to(torch.int32)
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=1,
            input_ids=torch.zeros(n, dtype=torch.int64), req_pool_indices=torch.tensor([SLOT]),
            seq_lens=torch.tensor([n]), out_cache_loc=rows, seq_lens_sum=n,
            seq_lens_cpu=torch.tensor([n]), extend_prefix_lens=torch.tensor([0]),
            extend_seq_lens=torch.tensor([n]), extend_seq_lens_cpu=[n],
        )
        q = self.kv.queries[:n].reshape(n, -1)
        self.backend.forward_extend(q, self.kv.keys[:n], self.kv.values[:n], self.layer, batch)

    def decode(self, t: int) -> torch.Tensor:
        """Draft token t over the t committed tokens, returning [Hq, D]; then commit it (its
        K/V written to the pool)."""
        row = self.rows[t : t + 1]
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=1,
            input_ids=torch.zeros(1, dtype=torch.int64), req_pool_indices=torch.tensor([SLOT]),
            seq_lens=torch.tensor([t + 1]), out_cache_loc=row, seq_lens_sum=t + 1,
        )
        self.tier.new_step()
        self.backend.begin_round([SLOT], [t], 1)
        self.backend.set_step(0)
        out = self.backend.forward_decode(
            self.kv.queries[t].reshape(1, -1), self.kv.keys[t : t + 1],
            self.kv.values[t : t + 1], self.layer, batch,
        )
        self.backend.end_round()
        self.req_to_token.req_to_token[SLOT, t] = int(row)
        self.pool.set_kv_buffer(self.layer, row, self.kv.keys[t : t + 1],
                                self.kv.values[t : t + 1])
        return out.view(self.kv.queries.shape[1], -1)

    def block(self):
        return self.tier._entries[(0, SLOT)].block


@pytest.mark.parametrize("spec", ["kivi:bits=2,group=32,residual=32", "kivi:bits=8",
                                  "streaming:sink=4,ratio=0.25", "snapkv:ratio=0.25,window=16",
                                  "h2o:ratio=0.25", "snapkv:ratio=0.5,window=16+kivi:bits=4"])
def test_decode_reads_the_compressed_tier(real_kv, spec):
    """A draft token's attention is over exactly what the tier holds of the committed prefix,
    plus its own exact K/V, not over the full KV."""
    h = Harness(real_kv, spec)
    prompt = h.kv.keys.shape[0] - 3
    h.prefill(prompt)
    for t in range(prompt, prompt + 3):
        out = h.decode(t)
        block = h.block()
        keys, values = block.dense()
        keys = torch.cat([keys, h.kv.keys[t : t + 1]])
        values = torch.cat([values, h.kv.values[t : t + 1]])
        positions = block.positions()
        if positions is None:  # quantizer: every token, dequantized
            expected = attention(h.kv.queries[t], keys, values, real_kv.scaling)
        else:  # dropper: per KV head, only its kept tokens
            group = h.kv.queries.shape[1] // keys.shape[1]
            expected = torch.cat([
                attention(h.kv.queries[t, hd * group:(hd + 1) * group], keys[:, hd:hd + 1],
                          values[:, hd:hd + 1], real_kv.scaling)
                for hd in range(keys.shape[1])
            ])
            assert positions.shape[1] < t  # tokens were really dropped
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        full = attention(h.kv.queries[t], h.kv.keys[: t + 1], h.kv.values[: t + 1],
                         real_kv.scaling)
        assert not torch.allclose(out, full, rtol=0, atol=1e-7)  # lossy: the tier was read


def test_decode_steps_append_instead_of_recompressing(real_kv):
    h = Harness(real_kv, "kivi:bits=4,group=32,residual=64")
    prompt = h.kv.keys.shape[0] - 4
    h.prefill(prompt)
    h.decode(prompt)
    first = h.block()
    assert len(first) == prompt
    for t in range(prompt + 1, prompt + 4):
        h.decode(t)
    assert h.block() is first
    assert len(first) == prompt + 3
    assert h.tier.nbytes() == first.nbytes()


def test_prefill_records_snapkv_observation_scores(real_kv):
    """The extend pass's scores equal the window attention HF computed for the same prompt."""
    h = Harness(real_kv, "snapkv:ratio=0.25,window=16")
    n = h.kv.keys.shape[0]
    h.prefill(n)
    observed = h.tier._observed[(0, SLOT)]
    expected = h.kv.window_scores[:, -16:]
    torch.testing.assert_close(observed, expected, rtol=1e-4, atol=1e-6)


def test_a_reused_request_slot_is_rebuilt(real_kv):
    """A new request in the same slot with other pool rows never reads the old block."""
    h = Harness(real_kv, "kivi:bits=4")
    prompt = 100
    h.prefill(prompt)
    h.decode(prompt)
    old = h.block()
    h.rows = h.rows.flip(0)  # the next request's tokens live elsewhere in the pool
    h.prefill(prompt)
    h.decode(prompt)
    assert h.block() is not old
    h.tier.release(SLOT)
    assert h.tier.nbytes() == 0
