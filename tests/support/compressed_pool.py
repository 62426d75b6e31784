"""Real SGLang pools, allocator and radix tree with a compressed pool following the allocator,
and drafting backends over them (no server, no model): the compressed pool's tests, and the
Triton kernel's check that drafting over the pool reads the same through it."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from vericache_sglang.attention.draft import DraftAttnBackend
from vericache_sglang.compress import parse_compressor_spec
from vericache_sglang.tiers.compressed import CompressedTier
from vericache_sglang.tiers.compressed_pool import CompressedPagePool, pool_pages

Q_HEADS, KV_HEADS, DIM = 9, 3, 64
"""Heads and head dimension of `Setup`'s layers: 3 query heads per KV head."""
SCALE = DIM**-0.5


class Setup:
    """Real SGLang pools, allocator and radix tree of `layers` layers, with a compressed pool
    following the allocator, and a drafting backend over them."""

    def __init__(self, spec: str, *, slots: int, layers: int = 1, requests: int = 8,
                 context: int = 4096, dtype: torch.dtype = torch.float32) -> None:
        self.gen = torch.Generator().manual_seed(0)
        self.kv = MHATokenToKVPool(size=slots, page_size=1, dtype=dtype, head_num=KV_HEADS,
                                   head_dim=DIM, layer_num=layers, device="cpu",
                                   enable_memory_saver=False)
        for layer in range(layers):  # every slot holds some real-valued K/V
            self.kv.k_buffer[layer].copy_(torch.randn(self.kv.k_buffer[layer].shape,
                                                      generator=self.gen))
            self.kv.v_buffer[layer].copy_(torch.randn(self.kv.v_buffer[layer].shape,
                                                      generator=self.gen))
        self.allocator = TokenToKVPoolAllocator(size=slots, dtype=dtype, device="cpu",
                                                kvcache=self.kv, need_sort=False)
        self.req_to_token = ReqToTokenPool(size=requests + 2, max_context_len=context + 64,
                                           device="cpu", enable_memory_saver=False)
        self.tree = RadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.req_to_token,
            token_to_kv_pool_allocator=self.allocator, page_size=1))
        self.compressor = parse_compressor_spec(spec)
        self.pool = CompressedPagePool(self.compressor, self.kv,
                                       num_pages=pool_pages(self.compressor, slots))
        self.pool.follow(self.allocator)
        runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req_to_token,
                                 token_to_kv_pool=self.kv)
        self.backend = DraftAttnBackend(runner, CompressedTier(self.compressor), self.pool)
        self.dense_backend = DraftAttnBackend(runner, CompressedTier(self.compressor))
        self.layers = [RadixAttention(Q_HEADS, DIM, SCALE, KV_HEADS, layer_id=i)
                       for i in range(layers)]

    def request(self, row: int, tokens: list[int]) -> torch.Tensor:
        """Place a request: reuse the tree's longest cached prefix of `tokens`, allocate slots
        for the rest. Returns its slots in token order."""
        match = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        cached = self.tree.path_device_indices(match.last_device_node)
        own = self.allocator.alloc(len(tokens) - len(cached))
        assert own is not None
        slots = torch.cat([cached.to(torch.int64), own])
        self.req_to_token.req_to_token[row, : len(slots)] = slots.to(torch.int32)
        return slots

    def cache(self, tokens: list[int], slots: torch.Tensor) -> None:
        """Insert a finished request into the tree (freeing the duplicate prefix slots)."""
        prefix = self.tree.insert(InsertParams(key=RadixKey(array("q", tokens)),
                                               value=slots)).prefix_len
        self.allocator.free(slots[:prefix])

    def draft_step(self, backend: DraftAttnBackend, rows: list[int], committed: list[int],
                   steps: int = 2) -> list[torch.Tensor]:
        """Run `steps` draft steps over every layer; the output of each layer of the last."""
        backend.begin_round(rows, committed, steps)
        gen = torch.Generator().manual_seed(1)
        outs = []
        for step in range(steps):
            backend.set_step(step)
            batch = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=len(rows),
                input_ids=torch.zeros(len(rows), dtype=torch.int64),
                req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(committed) + step + 1,
                out_cache_loc=torch.zeros(len(rows), dtype=torch.int64),
                seq_lens_sum=sum(committed) + len(rows) * (step + 1),
            )
            outs = [
                backend.forward_decode(
                    torch.randn(len(rows), Q_HEADS * DIM, generator=gen),
                    torch.randn(len(rows), KV_HEADS * DIM, generator=gen),
                    torch.randn(len(rows), KV_HEADS * DIM, generator=gen), layer, batch)
                for layer in self.layers
            ]
        return outs
