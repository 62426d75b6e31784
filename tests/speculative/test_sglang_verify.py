"""Verification through SGLang's own attention backends: on CUDA, a round's TARGET_VERIFY forward
runs through the backend plain SGLang decodes with (Triton or FlashInfer), reading the KV pool
by index, with no mask (a draft chain is causal).

SGLang's real `TritonAttnBackend` runs here on CPU tensors, its kernels run by Triton's
interpreter, so the verify path's logic (VeriCache's verify input, SGLang's metadata, its
extend kernel) runs without a GPU: on pools (below), and in two real servers with
`--attention-backend triton`, plain SGLang and VeriCache, whose outputs must be equal.
FlashInfer does not run on CPU, so its verify arguments are checked against the rows they must
read. TRITON_INTERPRET=1 must be set before triton is first imported: a normal run re-runs this
file in a subprocess with it set, and only there do the pool tests run.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from tests.support.families import build
from tests.support.interpreter import INTERPRETING, interpreter_only, rerun_under_interpreter
from tests.support.servers import ServerSpec
from vericache_sglang.speculative.backends import verifies_natively
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_args import server_args
from vericache_tools.server_process import ServerProcess

POOL = 1024
TRITON_SERVER_ARGS = [*server_args(chunked_prefill_size=None, max_running_requests=4,
                                  overlap=False, warmup=False),
                      "--attention-backend", "triton", "--triton-attention-num-kv-splits", "1"]
"""Plain SGLang on its Triton backend, on CPU with the kernels interpreted: slow (seconds per
decode step), so one KV split per request, no warm-up request, short prompts and outputs."""
NEW_TOKENS = 8


@pytest.mark.parametrize(("backend", "placement", "native"), [
    ("triton", "device", True), ("flashinfer", "device", True), ("fa3", "device", True),
    ("torch_native", "device", False), ("intel_amx", "device", False),
    ("triton", "host", False),  # the host tier's KV is in staging slots
])
def test_which_verifications_run_through_the_server_backend(backend, placement, native):
    assert verifies_natively(backend, placement) is native


def test_sglang_verify_under_the_interpreter() -> None:
    # skipped there: this test and the server test (its servers interpret their kernels)
    rerun_under_interpreter(__file__, skipped=2, timeout=900)


@pytest.mark.server
@pytest.mark.skipif(INTERPRETING, reason="the servers interpret their kernels themselves")
def test_a_server_verifying_through_sglang_triton_backend_equals_plain_sglang(demo_model,
                                                                             hf_reference,
                                                                             server_pool):
    """Two code prompts past the compressed tier's recent window of 32 tokens (the drafts
    read 2-bit pages, so some are rejected), greedy, batched: VeriCache verifies through
    SGLang's Triton backend with the full KV in the device pool, and through SGLang's Triton
    extend kernel over the staging units with the full KV in host memory (`/server_info` says
    which); both emit plain SGLang's tokens on the same backend. The model is the tiny Llama
    of the family tests (4 layers, 4 query heads: the interpreter runs a kernel program at a
    time, and the demo model's 30 layers of 9 heads took minutes for 8 tokens)."""
    from concurrent.futures import ThreadPoolExecutor

    model = build("llama", demo_model)
    tokenizer = hf_reference.tokenizer
    prompts = [stdlib_ids(tokenizer, "heapq", 112), stdlib_ids(tokenizer, "bisect", 96,
                                                                 start=300)]
    payloads = [{"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}} for ids in prompts]
    env = {"TRITON_INTERPRET": "1"}
    vericache = ["--enable-vericache", "--vericache-compressor", "kivi:bits=2,residual=32",
                 "--vericache-drafter", "none", "--vericache-draft-length", "8",
                 "--vericache-min-draft-length", "8", "--vericache-max-draft-length", "8"]
    servers = {"plain": ([], None),
               "device": ([*vericache, "--vericache-full-tier", "device"], "TritonAttnBackend"),
               "host": ([*vericache, "--vericache-full-tier", "host"],
                        "StagedFullKVAttnBackend (SGLang's Triton extend kernel)")}

    def answers(server: ServerProcess, verify_backend: str | None) -> list[dict]:
        with ThreadPoolExecutor(len(payloads)) as pool:
            out = list(pool.map(server.generate, payloads))
        if verify_backend is not None:
            memory = server.server_info()["vericache"]["memory"]
            assert memory["verify_backend"] == verify_backend
        return out

    # The three servers side by side: each interprets its kernels in one Python thread, so
    # two cores serve them together.
    specs = [ServerSpec.of(model, [*TRITON_SERVER_ARGS, *extra], env=env)
             for extra, _ in servers.values()]
    with server_pool.hold(*specs) as started, ThreadPoolExecutor(len(servers)) as pool:
        outputs = dict(zip(servers, pool.map(answers, started,
                                             [backend for _, backend in servers.values()]),
                           strict=True))
    for name in ("device", "host"):
        for plain, served in zip(outputs["plain"], outputs[name], strict=True):
            assert len(plain["output_ids"]) == NEW_TOKENS
            assert served["output_ids"] == plain["output_ids"]
            rounds = served["meta_info"]["spec_verify_ct"]
            print(f"\n[triton verify, {name} full tier] {rounds} verifications for "
                  f"{NEW_TOKENS} tokens")
            assert 0 < rounds < NEW_TOKENS


@pytest.fixture(scope="module")
def sglang_runner(demo_model):
    """What SGLang's Triton backend reads of a model runner: the demo model's config, real
    pools and allocator, SGLang's index translator, and the published server arguments of a
    VeriCache server on the Triton backend."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args, set_global_server_args_for_scheduler

    load_plugins()
    args = prepare_server_args([
        "--model-path", str(demo_model), "--device", "cpu", "--attention-backend", "triton",
        "--enable-vericache", "--vericache-full-tier", "device", "--vericache-min-draft-length",
        "1", "--vericache-draft-length", "4", "--vericache-max-draft-length", "6"])
    args.resolve_once()
    set_global_server_args_for_scheduler(args)
    config = ModelConfig.from_server_args(args)
    pool = MHATokenToKVPool(size=POOL, page_size=1, dtype=torch.float32,
                            head_num=config.get_num_kv_heads(1), head_dim=config.head_dim,
                            layer_num=1, device="cpu", enable_memory_saver=False)
    req_to_token = ReqToTokenPool(size=4, max_context_len=POOL, device="cpu",
                                  enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", pool, need_sort=False)
    translator = KVIndexTranslator(req_to_token=req_to_token.req_to_token,
                                   token_to_kv_pool_allocator=allocator, token_to_kv_pool=pool,
                                   page_size=1, device="cpu")
    return SimpleNamespace(
        device="cpu", gpu_id=0, page_size=1, is_draft_worker=False, kv_cache_dtype=torch.float32,
        kv_cache_dtype_str="auto",
        model_config=config, req_to_token_pool=req_to_token, token_to_kv_pool=pool,
        token_to_kv_pool_allocator=allocator, kv_index_translator=translator,
        sliding_window_size=None, spec_algorithm=args.speculative_algorithm,
        decode_num_tokens_per_req=lambda: args.speculative_num_draft_tokens,
    )


class Chains:
    """Requests with committed prefixes at scattered pool rows, and a chain of `width` tokens
    each: the K/V, queries and `ForwardBatch` of one TARGET_VERIFY forward."""

    def __init__(self, runner, prefixes: list[int], width: int, seed: int) -> None:
        from sglang.srt.layers.radix_attention import RadixAttention

        config = runner.model_config
        self.q_heads = config.get_max_num_attention_heads()
        self.kv_heads = config.get_num_kv_heads(1)
        self.dim = config.head_dim
        gen = torch.Generator().manual_seed(seed)
        self.runner, self.prefixes, self.width = runner, prefixes, width
        self.slots = list(range(len(prefixes)))
        lengths = [n + width for n in prefixes]
        self.rows = (torch.randperm(POOL - 1, generator=gen)[: sum(lengths)] + 1).split(lengths)
        self.keys = [torch.randn(len(r), self.kv_heads, self.dim, generator=gen) for r in self.rows]
        self.values = [torch.randn(len(r), self.kv_heads, self.dim, generator=gen)
                       for r in self.rows]
        self.queries = [torch.randn(width, self.q_heads, self.dim, generator=gen)
                        for _ in self.rows]
        pool = runner.token_to_kv_pool
        for slot, r, k, v, n in zip(self.slots, self.rows, self.keys, self.values, prefixes,
                                    strict=True):
            runner.req_to_token_pool.req_to_token[slot, : len(r)] = r.to(torch.int32)
            pool.k_buffer[0][r[:n]], pool.v_buffer[0][r[:n]] = k[:n], v[:n]
        self.layer = RadixAttention(self.q_heads, self.dim, self.dim**-0.5, self.kv_heads,
                                    layer_id=0)

    def forward_batch(self):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        from vericache_sglang.speculative.info import VeriCacheVerifyInput

        lens = torch.tensor(self.prefixes)
        positions = torch.cat([torch.arange(n, n + self.width) for n in self.prefixes])
        batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(self.prefixes),
            input_ids=torch.zeros(len(positions), dtype=torch.int64),
            req_pool_indices=torch.tensor(self.slots), seq_lens=lens, seq_lens_cpu=lens.clone(),
            out_cache_loc=torch.cat([r[n:] for r, n in zip(self.rows, self.prefixes, strict=True)]),
            seq_lens_sum=sum(self.prefixes), positions=positions,
            spec_info=VeriCacheVerifyInput(draft_token_num=self.width, positions=positions),
        )
        self.runner.kv_index_translator.bind_own_plan(batch)  # as the round's forwards do
        return batch

    def chain_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chain's queries [B * width, Hq * D] and its new keys and values."""
        cut = zip(self.keys, self.values, self.prefixes, strict=True)
        keys, values = zip(*[(k[n:], v[n:]) for k, v, n in cut], strict=True)
        return (torch.cat(self.queries).reshape(-1, self.q_heads * self.dim), torch.cat(keys),
                torch.cat(values))


@interpreter_only
@pytest.mark.parametrize(("prefixes", "width"), [([300, 170], 5), ([64, 250, 9], 2)])
def test_triton_backend_verifies_a_chain_causally_and_writes_it(sglang_runner, prefixes, width):
    """SGLang's Triton backend, given VeriCache's verify input of this round's width (not the
    server's `speculative_num_draft_tokens`), computes each chain token's attention over the
    request's committed prefix and the chain up to itself, and writes the chain's K/V."""
    from sglang.kernels.ops.attention import extend_attention
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from triton.runtime.interpreter import InterpretedFunction

    from tests.support.compressor_oracles import attention

    assert isinstance(extend_attention._fwd_kernel, InterpretedFunction)
    chains = Chains(sglang_runner, prefixes, width, seed=width)
    backend = TritonAttnBackend(sglang_runner)
    batch = chains.forward_batch()
    backend.init_forward_metadata(batch)
    queries, keys, values = chains.chain_kv()
    out = backend.forward_extend(queries, keys, values, chains.layer, batch)
    out = out.view(len(prefixes), width, chains.q_heads, chains.dim)
    pool = sglang_runner.token_to_kv_pool
    for b, n in enumerate(prefixes):
        for j in range(width):
            expected = attention(chains.queries[b][j], chains.keys[b][: n + j + 1],
                                 chains.values[b][: n + j + 1], chains.layer.scaling)
            torch.testing.assert_close(out[b, j], expected, rtol=1e-4, atol=1e-5)
        assert torch.equal(pool.k_buffer[0][chains.rows[b][n:]], chains.keys[b][n:])
        assert torch.equal(pool.v_buffer[0][chains.rows[b][n:]], chains.values[b][n:])


@interpreter_only
def test_flashinfer_verify_arguments_read_each_chain_in_place(sglang_runner):
    """FlashInfer's verify plan from VeriCache's input: each request's rows (its prefix and its
    chain) straight from `req_to_token` by index, `width` queries each, and no mask, so
    FlashInfer's causal plan aligns each chain to the end of its rows."""
    prefixes, width = [300, 170, 41], 4
    chains = Chains(sglang_runner, prefixes, width, seed=7)
    batch = chains.forward_batch()
    kv_indices, kv_indptr, qo_indptr, mask = batch.spec_info.generate_attn_arg_prefill(
        req_pool_indices=batch.req_pool_indices, paged_kernel_lens=batch.seq_lens,
        paged_kernel_lens_sum=batch.seq_lens_sum,
        translator=sglang_runner.kv_index_translator, plan=batch.kv_loc_plan)
    assert mask is None
    assert qo_indptr.tolist() == [0, width, 2 * width, 3 * width]
    lens = [n + width for n in prefixes]
    assert kv_indptr.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    assert len(kv_indices) == sum(lens)
    for b, rows in enumerate(chains.rows):
        assert kv_indices[kv_indptr[b]: kv_indptr[b + 1]].tolist() == rows.tolist()


def _no_fa3_kernel(*_args, **_kwargs):
    raise AssertionError("FA3's CUDA kernels do not run on a CPU")


@interpreter_only
def test_fa3_verify_metadata_sizes_each_chain_by_the_round(sglang_runner, monkeypatch):
    """SGLang's FA3 backend, given VeriCache's verify input of this round's width (4, where the
    server's `speculative_num_draft_tokens` is 7), plans `width` causal queries per request over
    its prefix and chain, read from `req_to_token` by page table. FA3's kernels are CUDA only
    (`sgl_kernel.flash_attn` has no CPU build): they stand here as functions that fail if
    called, and the backend's metadata, all that VeriCache's input decides, is SGLang's code."""
    import types

    from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend

    kernels = types.ModuleType("sgl_kernel.flash_attn")
    kernels.flash_attn_varlen_func = kernels.flash_attn_with_kvcache = _no_fa3_kernel
    kernels.get_scheduler_metadata = _no_fa3_kernel
    monkeypatch.setitem(sys.modules, "sgl_kernel.flash_attn", kernels)
    prefixes, width = [300, 170, 41], 4
    chains = Chains(sglang_runner, prefixes, width, seed=11)
    backend = FlashAttentionBackend(sglang_runner)
    assert backend.speculative_num_draft_tokens == 7  # the longest round, not this one
    batch = chains.forward_batch()
    backend.init_forward_metadata(batch)
    meta = backend.forward_metadata
    assert meta.max_seq_len_q == width
    assert meta.cu_seqlens_q.tolist() == [0, width, 2 * width, 3 * width]
    lens = [n + width for n in prefixes]
    assert meta.cache_seqlens_int32.tolist() == lens
    assert meta.cu_seqlens_k.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    for b, rows in enumerate(chains.rows):
        assert meta.page_table[b, : lens[b]].tolist() == rows.tolist()


@interpreter_only
@pytest.mark.parametrize("triton_verify", [True, False], ids=["triton kernel", "sdpa"])
def test_the_host_tiers_verify_reads_staging_units_by_index(sglang_runner, triton_verify):
    """With the full KV in host memory, verification reads each layer's staging units: on a
    Triton server through SGLang's Triton extend kernel (each request's staged prefix by
    index, its chain causally), else through the batched SDPA. Three requests over two units;
    every chain token's attention is its request's prefix and chain up to itself."""
    from tests.support.compressor_oracles import attention
    from vericache_sglang.attention.full_tier import StagedFullKVAttnBackend
    from vericache_sglang.tiers.staging import StagingArea

    prefixes, width = [300, 170, 41], 4
    chains = Chains(sglang_runner, prefixes, width, seed=13)
    staging = StagingArea(sglang_runner.token_to_kv_pool, unit_tokens=480, depth=2,
                          device="cpu")
    try:
        backend = StagedFullKVAttnBackend(sglang_runner, staging, triton_verify=triton_verify)
        backend.prefetch(chains.slots, prefixes, width)
        batch = chains.forward_batch()
        backend.init_forward_metadata(batch)
        queries, keys, values = chains.chain_kv()
        out = backend.forward_extend(queries, keys, values, chains.layer, batch)
        # every prefix row of K and V (float32) came through the staging units, once
        assert staging.take_stats().bytes == sum(prefixes) * 2 * chains.kv_heads * chains.dim * 4
    finally:
        staging.close()
    out = out.view(len(prefixes), width, chains.q_heads, chains.dim)
    for b, n in enumerate(prefixes):
        for j in range(width):
            expected = attention(chains.queries[b][j], chains.keys[b][: n + j + 1],
                                 chains.values[b][: n + j + 1], chains.layer.scaling)
            torch.testing.assert_close(out[b, j], expected, rtol=1e-4, atol=1e-5)
