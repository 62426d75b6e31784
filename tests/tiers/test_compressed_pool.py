"""The compressed pool on real SGLang pools, allocator and radix tree (no server, no model).

Memory: what drafting holds (used pages, request-owned blocks, the round's buffers), measured
from tensor storages, against the full KV of the same tokens. Sharing: requests over one
cached prefix find its pages by their slots, so it is compressed and stored once; eviction
frees pages with their slots. Reads: drafting over packed pages plus the exact tail equals
drafting over each request's own dequantized KIVI block.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

import vericache_kernels as kernels
from tests.support.compressed_pool import DIM, KV_HEADS, Q_HEADS, SCALE, Setup
from vericache_sglang.attention.draft import DraftAttnBackend
from vericache_sglang.compress import parse_compressor_spec
from vericache_sglang.tiers.compressed import CompressedTier
from vericache_sglang.tiers.compressed_pool import CompressedPagePool, pool_pages


def _storage_sum(tensors) -> int:
    """Bytes of distinct storages, counted here independently of the product's helper."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("bits", "bound"), [(4, 0.40), (2, 0.25)])
def test_drafting_holds_a_fraction_of_the_full_kv(dtype, bits, bound):
    """8 requests x 4,096 tokens: used pages + request-owned blocks + round buffers, during
    and after a round, against the full KV of those tokens (bf16 and float32)."""
    requests, context = 8, 4096
    setup = Setup(f"kivi:bits={bits}", slots=requests * context + 1, dtype=dtype)
    rows = list(range(1, requests + 1))
    gen = torch.Generator().manual_seed(2)
    for row in rows:
        setup.request(row, torch.randint(0, 49152, (context,), generator=gen).tolist())
    full = requests * context * 2 * KV_HEADS * DIM * dtype.itemsize  # one layer

    setup.backend.begin_round(rows, [context] * requests, 8)
    setup.backend.set_step(0)
    batch = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=requests,
                         input_ids=torch.zeros(requests, dtype=torch.int64),
                         req_pool_indices=torch.tensor(rows),
                         seq_lens=torch.full((requests,), context + 1),
                         out_cache_loc=torch.zeros(requests, dtype=torch.int64),
                         seq_lens_sum=requests * (context + 1))
    setup.backend.forward_decode(torch.randn(requests, Q_HEADS * DIM, dtype=dtype),
                                 torch.randn(requests, KV_HEADS * DIM, dtype=dtype),
                                 torch.randn(requests, KV_HEADS * DIM, dtype=dtype),
                                 setup.layers[0], batch)
    pool = setup.pool
    groups = (context - 128) // 32
    assert pool.used_pages == requests * groups  # nothing shared: random prompts
    per_page = _storage_sum(pool.tensors()) / pool.num_pages
    during = (per_page * pool.used_pages + setup.backend.tier.nbytes()
              + setup.backend.round_buffer_bytes())
    assert setup.backend.round_buffer_bytes() > 0
    assert during / full <= bound, during / full
    assert pool.held_bytes() == int(per_page * pool.used_pages)
    setup.backend.end_round()
    after = pool.held_bytes() + setup.backend.tier.nbytes() + setup.backend.round_buffer_bytes()
    assert setup.backend.round_buffer_bytes() == 0
    assert after / full <= bound, after / full


def test_requests_over_one_prefix_share_its_pages():
    """8 concurrent requests over one 2,000-token prefix compress and hold its pages once; a
    later request that hits the cache compresses nothing of it; eviction frees the pages."""
    setup = Setup("kivi:bits=4", slots=8192, requests=10, context=2200)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 49152, (2000,), generator=gen).tolist()
    first = prefix + [1] * 20
    setup.cache(first, setup.request(9, first))  # the prefix is in the tree

    rows = list(range(1, 9))
    for row in rows:
        setup.request(row, prefix + torch.randint(0, 49152, (100,), generator=gen).tolist())
    setup.draft_step(setup.backend, rows, [2100] * 8)
    shared_groups = (2100 - 128) // 32  # 61 groups, all inside the shared prefix
    assert setup.pool.compressed_pages == shared_groups
    assert setup.pool.used_pages == shared_groups

    setup.request(9, prefix + [7] * 100)  # a later request hitting the cache
    setup.draft_step(setup.backend, [9], [2100])
    assert setup.pool.compressed_pages == shared_groups

    # The requests end (their own slots freed), then the tree evicts the prefix.
    for row in [*rows, 9]:
        setup.allocator.free(setup.req_to_token.req_to_token[row, 2000:2100].to(torch.int64))
    setup.tree.evict(EvictParams(num_tokens=setup.tree.evictable_size()))
    assert setup.tree.total_size() == 0
    assert setup.pool.used_pages == 0
    assert setup.pool.held_bytes() == 0


@pytest.mark.parametrize("split", [1024, 1000])
def test_prefix_split_at_and_inside_a_page(split):
    """A request sharing a cached prefix up to a page boundary reuses every page before it;
    sharing up to the middle of a page, it compresses that group itself. Either way its drafts
    read exactly what its own dequantized KIVI block would give."""
    setup = Setup("kivi:bits=4", slots=8192, requests=4, context=2200)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 49152, (2048,), generator=gen).tolist()
    setup.cache(tokens, setup.request(3, tokens))
    setup.draft_step(setup.backend, [3], [2048])  # compresses the cached request's groups
    before = setup.pool.compressed_pages
    assert before == (2048 - 128) // 32

    other = tokens[:split] + torch.randint(0, 49152, (2048 - split,), generator=gen).tolist()
    setup.request(1, other)
    outs = setup.draft_step(setup.backend, [1], [2048])
    reused = split // 32
    assert setup.pool.compressed_pages == before + (2048 - 128) // 32 - reused
    expected = setup.draft_step(setup.dense_backend, [1], [2048])
    for out, ref in zip(outs, expected, strict=True):
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", ["kivi:bits=4", "kivi:bits=2,group=64,residual=32",
                                  "kivi_mixed:recent=0,early_layers=1"])
def test_pool_reads_equal_each_requests_own_block(spec):
    """Batched drafting over pages + exact tail equals drafting over each request's
    dequantized block (to 1e-5 in float32), for requests of different lengths, several
    layers (per-layer bits) and several draft steps."""
    setup = Setup(spec, slots=6000, layers=2, requests=4, context=2000)
    gen = torch.Generator().manual_seed(5)
    committed = [1500, 37, 900, 1999]
    for row, n in zip(range(1, 5), committed, strict=True):
        setup.request(row, torch.randint(0, 49152, (n,), generator=gen).tolist())
    outs = setup.draft_step(setup.backend, [1, 2, 3, 4], committed, steps=3)
    expected = setup.draft_step(setup.dense_backend, [1, 2, 3, 4], committed, steps=3)
    for out, ref in zip(outs, expected, strict=True):
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_a_full_pool_drafts_the_rest_from_the_full_kv():
    """When no page is free, the groups that do not fit are read exactly: the draft attends
    to the pages that fit plus exact K/V for everything after them."""
    setup = Setup("kivi:bits=4", slots=3000, requests=2, context=2000)
    small = CompressedPagePool(setup.compressor, setup.kv, num_pages=10)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=setup.req_to_token,
                             token_to_kv_pool=setup.kv)
    backend = DraftAttnBackend(runner, CompressedTier(setup.compressor), small)
    gen = torch.Generator().manual_seed(6)
    slots = setup.request(1, torch.randint(0, 49152, (1500,), generator=gen).tolist())
    backend.begin_round([1], [1500], 1)
    assert small.used_pages == 10
    q, k, v = (torch.randn(1, h * DIM, generator=gen) for h in (Q_HEADS, KV_HEADS, KV_HEADS))
    batch = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=1,
                         input_ids=torch.zeros(1, dtype=torch.int64),
                         req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([1501]),
                         out_cache_loc=torch.zeros(1, dtype=torch.int64), seq_lens_sum=1501)
    out = backend.forward_decode(q, k, v, setup.layers[0], batch).view(Q_HEADS, DIM)

    paged = slots[:320]
    keys = torch.cat([
        kernels.dequantize_keys(*kernels.quantize_keys(setup.kv.k_buffer[0][paged], 32, 4), 4,
                                torch.float32),
        setup.kv.k_buffer[0][slots[320:]], k.view(1, KV_HEADS, DIM)])
    values = torch.cat([
        kernels.dequantize_values(*kernels.quantize_values(setup.kv.v_buffer[0][paged], 32, 4),
                                  4, torch.float32),
        setup.kv.v_buffer[0][slots[320:]], v.view(1, KV_HEADS, DIM)])
    group = Q_HEADS // KV_HEADS
    logits = torch.einsum("hd,thd->ht", q.view(Q_HEADS, DIM),
                          keys.repeat_interleave(group, 1)) * SCALE
    expected = torch.einsum("ht,thd->hd", logits.softmax(-1), values.repeat_interleave(group, 1))
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)


def test_rows_of_several_steps_read_each_prefix_once_and_equal_single_steps():
    """A level-1 check forward over the pool (several steps of a request in one forward, a
    different number per request, the rows of a request sharing one read of its pages) equals
    one-token steps, on every layer."""
    setup = Setup("kivi:bits=4", slots=6000, layers=2, requests=3, context=2000)
    gen = torch.Generator().manual_seed(8)
    committed = [1500, 37, 900]
    for row, n in zip(range(1, 4), committed, strict=True):
        setup.request(row, torch.randint(0, 49152, (n,), generator=gen).tolist())
    steps = 4
    qkv = {(r, s, layer.layer_id): (torch.randn(Q_HEADS * DIM, generator=gen),
                                    torch.randn(KV_HEADS * DIM, generator=gen),
                                    torch.randn(KV_HEADS * DIM, generator=gen))
           for r in range(3) for s in range(steps) for layer in setup.layers}

    def forward(rows: list[tuple[int, int]]) -> dict[tuple[int, int, int], torch.Tensor]:
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(rows),
            input_ids=torch.zeros(len(rows), dtype=torch.int64),
            req_pool_indices=torch.tensor([r + 1 for r, _ in rows]),
            seq_lens=torch.tensor([committed[r] + s + 1 for r, s in rows]),
            out_cache_loc=torch.zeros(len(rows), dtype=torch.int64),
            seq_lens_sum=sum(committed[r] + s + 1 for r, s in rows))
        outs = {}
        for layer in setup.layers:
            q, k, v = (torch.stack([qkv[(r, s, layer.layer_id)][i] for r, s in rows])
                       for i in range(3))
            out = setup.backend.forward_decode(q, k, v, layer, batch)
            outs.update({(r, s, layer.layer_id): o for (r, s), o in zip(rows, out, strict=True)})
        return outs

    setup.backend.begin_round([1, 2, 3], committed, steps)
    expected = {}
    for step in range(steps):
        setup.backend.set_step(step)
        expected.update(forward([(r, step) for r in range(3)]))
    setup.backend.begin_round([1, 2, 3], committed, steps)
    got = {}
    for rows in ([(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)],
                 [(0, 2), (0, 3), (1, 1), (1, 2), (1, 3), (2, 3)]):
        setup.backend.set_rows([r for r, _ in rows], [s for _, s in rows])
        got.update(forward(rows))
    setup.backend.end_round()
    for key, ref in expected.items():
        torch.testing.assert_close(got[key], ref, rtol=1e-5, atol=1e-5, msg=str(key))


def test_pages_follow_a_paged_allocator():
    """With SGLang's --page-size 64 (its paged allocator), compressed pages are freed with
    their slots however the allocator frees them: a finished request's row and a duplicate
    prefix (`free_segment`), the tree evicting a node, one slot of a page (the allocator
    frees the whole page), a free group. Slots handed out again are compressed again, never
    read through a page made from the tokens they held before."""
    page, slots_total = 64, 4096
    kv = MHATokenToKVPool(size=slots_total, page_size=page, dtype=torch.float32,
                          head_num=KV_HEADS, head_dim=DIM, layer_num=1, device="cpu",
                          enable_memory_saver=False)
    allocator = PagedTokenToKVPoolAllocator(size=slots_total, page_size=page,
                                            dtype=torch.float32, device="cpu", kvcache=kv,
                                            need_sort=False)
    req_to_token = ReqToTokenPool(size=4, max_context_len=1024, device="cpu",
                                  enable_memory_saver=False)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=req_to_token,
                                      token_to_kv_pool_allocator=allocator, page_size=page))
    compressor = parse_compressor_spec("kivi:bits=4")
    pool = CompressedPagePool(compressor, kv, num_pages=pool_pages(compressor, slots_total))
    pool.follow(allocator)
    gen = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, 49152, (512,), generator=gen).tolist()

    # A request of 512 tokens ends: the tree keeps its first 256 (4 pages), the rest of its
    # row is freed as SGLang releases a request's row.
    slots = allocator.alloc(512)
    pool.pages(slots)
    assert pool.used_pages == pool.compressed_pages == 16
    tree.insert(InsertParams(key=RadixKey(array("q", tokens[:256])), value=slots[:256]))
    allocator.free_segment(slots[256:], start_pos=256)
    assert pool.used_pages == 8

    # The freed slots go to the next request, holding other tokens: compressed anew.
    again = allocator.alloc(256)
    assert set(again.tolist()) == set(slots[256:].tolist())
    pool.pages(again)
    assert pool.compressed_pages == 24 and pool.used_pages == 16

    # One slot of a page: the allocator frees the whole page, and both groups of it go.
    allocator.free(again[70:71])
    assert pool.used_pages == 14
    # A free group (SGLang batches a step's frees in one).
    allocator.free_group_begin()
    allocator.free_segment(again[128:], start_pos=128)
    allocator.free(again[:1])  # `free` in a group waits for its end
    assert pool.used_pages == 10
    allocator.free_group_end()
    assert pool.used_pages == 8

    # The tree evicts the cached prefix.
    tree.evict(EvictParams(num_tokens=tree.evictable_size()))
    assert tree.total_size() == 0
    assert pool.used_pages == 0 and pool.held_bytes() == 0
    assert allocator.available_size() == slots_total


class _CountingPool(CompressedPagePool):
    """The pool, recording how many groups each slot lookup (host work) was given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.looked_up: list[int] = []

    def _lookup(self, groups: torch.Tensor) -> list[int]:
        self.looked_up.append(len(groups))
        return super()._lookup(groups)


def test_a_rounds_lookup_covers_only_the_groups_added_since_the_last_round():
    """A request's page ids from its last round are kept where their pages still cover the
    same slots: the next round looks up only the groups it added; a freed page, or the slot
    row of another request, makes a whole lookup again, with the same ids a fresh one gets."""
    kv = MHATokenToKVPool(size=2048, page_size=1, dtype=torch.float32, head_num=KV_HEADS,
                          head_dim=DIM, layer_num=1, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(size=2048, dtype=torch.float32, device="cpu", kvcache=kv,
                                       need_sort=False)
    compressor = parse_compressor_spec("kivi:bits=4")
    pool = _CountingPool(compressor, kv, num_pages=pool_pages(compressor, 2048))
    pool.follow(allocator)
    slots = allocator.alloc(1024).to(torch.int64)
    first = pool.pages(slots[:512])
    grown = pool.pages(slots[:640], first)
    assert pool.looked_up == [16, 4]
    assert torch.equal(grown[:16], first) and len(grown) == 20
    assert pool.pages(slots[:640], grown) is grown and pool.looked_up == [16, 4]

    allocator.free(slots[100:101])  # the page of the 4th group (tokens 96-127) goes
    again = pool.pages(slots[:640], grown)
    assert pool.looked_up[-1] == 20  # a whole lookup: the ids held a freed page
    assert torch.equal(again, pool.pages(slots[:640]))
    assert pool.page_slots[again[3], 0] == slots[96]  # compressed anew from its slots

    other = allocator.alloc(640).to(torch.int64)  # another request, given stale ids
    theirs = pool.pages(other, again)
    assert pool.looked_up[-1] == 20
    assert torch.equal(pool.page_slots[theirs], other.reshape(-1, 32))


def test_a_tensor_parallel_rank_drafts_its_heads_as_the_whole_pool_does():
    """Per-rank pieces of tensor parallelism (VeriCache refuses --tp-size above 1 today, and
    SGLang's CPU engine does not start tensor parallelism here): SGLang gives each rank a KV
    pool of its own KV heads and their query heads. A compressed pool and drafting backend
    over one rank's heads draft exactly what the pool over all heads drafts for them: KIVI
    quantizes each head on its own, so the pool splits by KV head as SGLang's pools do."""
    kv_heads, group, slots, committed = 2, Q_HEADS // KV_HEADS, 1024, 300
    gen = torch.Generator().manual_seed(9)
    req_to_token = ReqToTokenPool(size=3, max_context_len=slots, device="cpu",
                                  enable_memory_saver=False)
    req_to_token.req_to_token[1, :committed] = (torch.randperm(slots - 1, generator=gen)
                                                [:committed] + 1).to(torch.int32)
    keys, values = (torch.randn(slots, kv_heads, DIM, generator=gen) for _ in range(2))
    compressor = parse_compressor_spec("kivi:bits=4,group=32,residual=32")

    def draft(heads: slice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        count = heads.stop - heads.start
        kv = MHATokenToKVPool(size=slots, page_size=1, dtype=torch.float32, head_num=count,
                              head_dim=DIM, layer_num=1, device="cpu", enable_memory_saver=False)
        kv.k_buffer[0][:slots] = keys[:, heads]
        kv.v_buffer[0][:slots] = values[:, heads]
        pool = CompressedPagePool(compressor, kv, num_pages=pool_pages(compressor, slots))
        runner = SimpleNamespace(device="cpu", req_to_token_pool=req_to_token, token_to_kv_pool=kv)
        backend = DraftAttnBackend(runner, CompressedTier(compressor), pool)
        backend.begin_round([1], [committed], 1)
        batch = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=1,
                             input_ids=torch.zeros(1, dtype=torch.int64),
                             req_pool_indices=torch.tensor([1]),
                             seq_lens=torch.tensor([committed + 1]),
                             out_cache_loc=torch.zeros(1, dtype=torch.int64),
                             seq_lens_sum=committed + 1)
        layer = RadixAttention(count * group, DIM, SCALE, count, layer_id=0)
        return backend.forward_decode(q.reshape(1, -1), k.reshape(1, -1), v.reshape(1, -1),
                                      layer, batch).view(count * group, DIM)

    q = torch.randn(kv_heads * group, DIM, generator=gen)
    k, v = (torch.randn(kv_heads, DIM, generator=gen) for _ in range(2))
    whole = draft(slice(0, kv_heads), q, k, v)
    ranks = [draft(slice(r, r + 1), q[r * group:(r + 1) * group], k[r:r + 1], v[r:r + 1])
             for r in range(kv_heads)]
    torch.testing.assert_close(torch.cat(ranks), whole, rtol=1e-5, atol=1e-6)


def test_sliding_window_layers_keep_no_pages():
    """Drafting reads a sliding-window layer's window exactly, so the pool holds no pages for
    it: its storage is the other layers' share (measured), compressing a group never reads
    that layer's full KV, and the other layers' pages are what they would be."""
    setup = Setup("kivi:bits=4,group=32,residual=32", slots=512, layers=2)
    windowed = CompressedPagePool(setup.compressor, setup.kv, num_pages=setup.pool.num_pages,
                                  windowed_layers=[1])
    per_layer = (setup.pool.allocated_bytes() - _storage_sum([setup.pool.page_slots])) / 2
    assert windowed.allocated_bytes() == pytest.approx(
        per_layer + _storage_sum([windowed.page_slots]))
    reads = []
    windowed.on_read = lambda nbytes, seconds: reads.append(nbytes)
    setup.pool.on_read = lambda nbytes, seconds: None
    slots = torch.arange(1, 65)
    pages = windowed.pages(slots)
    both = setup.pool.pages(slots)
    assert len(reads) == 1  # layer 0 only
    assert torch.equal(windowed.k_codes[0][pages], setup.pool.k_codes[0][both])
    assert torch.equal(windowed.v_codes[0][pages], setup.pool.v_codes[0][both])
