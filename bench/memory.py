"""Device memory of drafting per context token, and the time of a draft step's attention.

Two measurements on real SGLang pools (`MHATokenToKVPool`, `TokenToKVPoolAllocator`,
`ReqToTokenPool`) on the CPU, one layer (no server, no model forward beyond a prefill):

1. Bytes per context token, per compressor, bf16 and float32: --requests requests of --context
   tokens each, holding the real K/V of one layer of the demo model prefilled on real text
   (the droppers get that prefill's real attention probabilities through
   `CompressedTier.observe`). One draft round of --draft-length is begun and its first step
   run; then the used compressed-pool pages (`CompressedPagePool.held_bytes`), the
   request-owned blocks (`CompressedTier.nbytes`) and the round's buffers
   (`DraftAttnBackend.round_buffer_bytes`) are read from tensor storages, against plain
   SGLang's full KV per token (the storages of the KV pool over its rows).
2. Attention time of one draft step (`DraftAttnBackend.forward_decode`, one layer, after
   `begin_round`) against a plain decode step's (SGLang's
   `TorchNativeAttnBackend.forward_decode` over the same full KV pool), batch x context,
   random K/V; the once-per-round `begin_round` (which compresses pages the first time) and
   the first draft step (which builds request-owned blocks) are timed separately.

Not a test: it prints progress and two markdown tables, and with --write-docs puts them and
the exact command into the marked section of docs/memory.md.

    .venv/bin/python -m bench.memory --threads 1 --write-docs docs/memory.md
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from transformers import AutoConfig

from bench import cli
from bench.cli import log
from bench.docs_section import replace_section
from vericache_sglang.attention.draft import DraftAttnBackend
from vericache_sglang.compress import Compressor, parse_compressor_spec
from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.tiers.compressed import CompressedTier
from vericache_sglang.tiers.compressed_pool import CompressedPagePool, pool_pages
from vericache_tools.hf_eval import LayerKV, load_model, prefill
from vericache_tools.prompts import file_ids

MEMORY_SPECS = [
    "kivi:bits=8",
    "kivi:bits=4",
    "kivi:bits=2",
    "kivi_mixed:recent=0",  # layer 0 is one of its early (4-bit) layers
    "kivi_mixed:recent=0,early_layers=0",  # the same on a late (2-bit) layer
    "snapkv:ratio=0.25",
    "h2o:ratio=0.25",
    "streaming:ratio=0.25",
    "snapkv:ratio=0.5+kivi:bits=4",
]
TIMING_SPECS = ["kivi:bits=4", "snapkv:ratio=0.25"]
DEFAULT_FILES = ["argparse.py", "difflib.py", "GPL-3", "typing.py", "inspect.py",
                 "subprocess.py", "tarfile.py", "LGPL-2.1"]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
SECTION = "memory"


@dataclass(frozen=True)
class Geometry:
    """Attention geometry of one model layer."""

    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def scaling(self) -> float:
        return self.head_dim**-0.5

    @classmethod
    def of(cls, model_dir: Path) -> Geometry:
        """The geometry an HF model directory's config declares."""
        config = AutoConfig.from_pretrained(model_dir)
        return cls(config.num_attention_heads, config.num_key_value_heads,
                   getattr(config, "head_dim", None)
                   or config.hidden_size // config.num_attention_heads)


class Pools:
    """SGLang's KV pool (one layer), allocator and request-to-token pool on the CPU, holding
    `len(lengths)` requests of those lengths at request-pool rows 1, 2, ..."""

    def __init__(self, geometry: Geometry, dtype: torch.dtype, lengths: list[int]) -> None:
        slots = sum(lengths) + 1
        self.geometry = geometry
        self.kv = MHATokenToKVPool(size=slots, page_size=1, dtype=dtype,
                                   head_num=geometry.kv_heads, head_dim=geometry.head_dim,
                                   layer_num=1, device="cpu", enable_memory_saver=False)
        self.allocator = TokenToKVPoolAllocator(size=slots, dtype=dtype, device="cpu",
                                                kvcache=self.kv, need_sort=False)
        self.req_to_token = ReqToTokenPool(size=len(lengths) + 2, max_context_len=max(lengths),
                                           device="cpu", enable_memory_saver=False)
        self.runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req_to_token,
                                      token_to_kv_pool=self.kv)
        self.layer = RadixAttention(geometry.q_heads, geometry.head_dim, geometry.scaling,
                                    geometry.kv_heads, layer_id=0)
        self.rows = list(range(1, len(lengths) + 1))
        self.slots: list[torch.Tensor] = []
        for row, n in zip(self.rows, lengths, strict=True):
            own = self.allocator.alloc(n)
            assert own is not None, "the KV pool was sized for these requests"
            self.req_to_token.req_to_token[row, :n] = own.to(torch.int32)
            self.slots.append(own.to(torch.int64))

    def full_bytes_per_token(self) -> float:
        """Plain SGLang's full KV per token: the pool's K and V storages over its rows."""
        return storage_bytes([*self.kv.k_buffer, *self.kv.v_buffer]) / self.kv.k_buffer[0].shape[0]

    def fill(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write each request's K/V [n, H, D] at its slots."""
        for slots, k, v in zip(self.slots, keys, values, strict=True):
            self.kv.k_buffer[0][slots] = k.to(self.kv.dtype)
            self.kv.v_buffer[0][slots] = v.to(self.kv.dtype)

    def draft_backend(self, compressor: Compressor) -> DraftAttnBackend:
        """The drafting backend as the VeriCache worker builds it: a shared page pool for a
        prefix-stable compressor, request-owned blocks otherwise."""
        pool = None
        if compressor.prefix_stable:
            pool = CompressedPagePool(compressor, self.kv,
                                      num_pages=pool_pages(compressor, self.kv.size))
        return DraftAttnBackend(self.runner, CompressedTier(compressor), pool)

    def decode_batch(self, seq_lens: list[int], out_cache_loc: torch.Tensor) -> ForwardBatch:
        batch = len(self.rows)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=batch,
            input_ids=torch.zeros(batch, dtype=torch.int64),
            req_pool_indices=torch.tensor(self.rows), seq_lens=torch.tensor(seq_lens),
            out_cache_loc=out_cache_loc, seq_lens_sum=sum(seq_lens),
        )

    def qkv(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode token's q [B, Hq * D] and k, v [B, H, D] for every request, as
        `RadixAttention` hands them to the backend."""
        g, batch, dtype = self.geometry, len(self.rows), self.kv.dtype
        q = torch.randn(batch, g.q_heads * g.head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(batch, g.kv_heads, g.head_dim, generator=gen).to(dtype)
                for _ in range(2))
        return q, k, v


# -- 1. memory ------------------------------------------------------------------------------------
@dataclass
class MemoryRow:
    spec: str
    path: str
    dtype: str
    tokens: int
    pages: int
    owned: int
    buffers: int
    full_per_token: float
    page_index: int
    allocated_per_slot: float
    """The preallocated pool's bytes per full-pool slot (0 without a pool)."""

    @property
    def total(self) -> int:
        return self.pages + self.owned + self.buffers


def real_kv(model_dir: Path, files: list[str], tokens: int, layer: int) -> list[LayerKV]:
    """Layer `layer`'s K/V and attention probabilities of the demo model prefilled on the
    first `tokens` tokens of each file (the model is cut after that layer: nothing later is
    needed)."""
    model, tokenizer = load_model(model_dir)
    base = model.model
    base.layers = base.layers[: layer + 1]
    base.config.num_hidden_layers = layer + 1
    if getattr(base.config, "layer_types", None):
        base.config.layer_types = base.config.layer_types[: layer + 1]
    out = []
    for name in files:
        ids = file_ids(tokenizer, name, tokens)
        began = time.monotonic()
        out.append(prefill(base, ids, window=32, total_scores=True)[layer])
        log(f"  prefilled {name} ({tokens} tokens, layers 0..{layer}) in "
            f"{time.monotonic() - began:.1f} s")
    return out


def measure_memory(spec: str, dtype: str, kvs: list[LayerKV], geometry: Geometry,
                   draft_length: int) -> MemoryRow:
    compressor = parse_compressor_spec(spec)
    tokens = [kv.keys.shape[0] for kv in kvs]
    pools = Pools(geometry, DTYPES[dtype], tokens)
    pools.fill([kv.keys for kv in kvs], [kv.values for kv in kvs])
    backend = pools.draft_backend(compressor)
    if compressor.needs_scores:  # the prompt's observation, as the prefill records it
        for row, kv in zip(pools.rows, kvs, strict=True):
            backend.tier.observe(0, row, kv.scores_for(compressor))
    backend.begin_round(pools.rows, tokens, draft_length)
    backend.set_step(0)
    batch = pools.decode_batch([n + 1 for n in tokens],
                               torch.zeros(len(tokens), dtype=torch.int64))
    backend.forward_decode(*pools.qkv(torch.Generator().manual_seed(0)), pools.layer, batch)
    pool = backend.pool
    page_index, allocated = 0, 0.0
    if pool is not None:
        page_index = storage_bytes([pool.page_slots]) * pool.used_pages // pool.num_pages
        allocated = pool.allocated_bytes() / pools.kv.size
    return MemoryRow(
        spec=spec, path="pool" if pool is not None else "request-owned", dtype=dtype,
        tokens=sum(tokens), pages=0 if pool is None else pool.held_bytes(),
        owned=backend.tier.nbytes(), buffers=backend.round_buffer_bytes(),
        full_per_token=pools.full_bytes_per_token(), page_index=page_index,
        allocated_per_slot=allocated,
    )


def memory_table(rows: list[MemoryRow]) -> str:
    lines = [
        "| compressor | path | dtype | pool pages in use | request-owned blocks | round buffers "
        "| total | plain SGLang full KV | drafting / full |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        share = r.total / r.tokens / r.full_per_token
        lines.append(
            f"| `{r.spec}` | {r.path} | {r.dtype} | {r.pages / r.tokens:.2f} "
            f"| {r.owned / r.tokens:.2f} | {r.buffers / r.tokens:.2f} "
            f"| **{r.total / r.tokens:.2f}** | {r.full_per_token:.2f} "
            f"| {100 * share:.1f}% ({1 / share:.2f}x less) |"
        )
    return "\n".join(lines)


# -- 2. time --------------------------------------------------------------------------------------
@dataclass
class TimingRow:
    spec: str
    path: str
    batch: int
    context: int
    plain_ms: float
    draft_ms: float
    first_begin_ms: float
    later_begin_ms: float
    first_step_ms: float


def _ms(fn) -> float:
    began = time.perf_counter()
    fn()
    return (time.perf_counter() - began) * 1e3


def measure_time(spec: str, batch: int, context: int, dtype: torch.dtype, geometry: Geometry,
                 draft_length: int, rounds: int) -> TimingRow:
    """Median attention time per call of a draft step and of a plain decode step, one layer,
    alternating one round of draft steps with as many plain steps, `rounds` times, after a
    first (untimed) round; plus the one-time costs."""
    compressor = parse_compressor_spec(spec)
    gen = torch.Generator().manual_seed(batch * 100_003 + context)
    pools = Pools(geometry, dtype, [context + 1] * batch)  # + the plain step's new token
    pools.fill(*([torch.randn(context + 1, geometry.kv_heads, geometry.head_dim, generator=gen)
                  for _ in range(batch)] for _ in range(2)))
    plain = TorchNativeAttnBackend(pools.runner)
    plain_batch = pools.decode_batch([context + 1] * batch,
                                     torch.stack([s[context] for s in pools.slots]))
    draft = pools.draft_backend(compressor)
    committed = [context] * batch
    layer = pools.layer

    def draft_step(step: int) -> float:
        draft.set_step(step)
        fb = pools.decode_batch([context + step + 1] * batch, plain_batch.out_cache_loc)
        q, k, v = pools.qkv(gen)
        return _ms(lambda: draft.forward_decode(q, k, v, layer, fb))

    def plain_step() -> float:
        q, k, v = pools.qkv(gen)
        return _ms(lambda: plain.forward_decode(q, k, v, layer, plain_batch))

    first_begin = _ms(lambda: draft.begin_round(pools.rows, committed, draft_length))
    first_step = draft_step(0)
    for step in range(1, draft_length):
        draft_step(step)
    for _ in range(draft_length):
        plain_step()
    later_begin, draft_times, plain_times = [], [], []
    for _ in range(rounds):
        later_begin.append(_ms(lambda: draft.begin_round(pools.rows, committed, draft_length)))
        draft_times += [draft_step(step) for step in range(draft_length)]
        plain_times += [plain_step() for _ in range(draft_length)]
    draft.end_round()
    return TimingRow(
        spec=spec, path="pool" if draft.pool is not None else "request-owned", batch=batch,
        context=context, plain_ms=statistics.median(plain_times),
        draft_ms=statistics.median(draft_times), first_begin_ms=first_begin,
        later_begin_ms=statistics.median(later_begin), first_step_ms=first_step,
    )


def timing_table(rows: list[TimingRow]) -> str:
    lines = [
        "| compressor | path | batch | context | plain decode attn (ms) | draft step attn (ms) "
        "| draft / plain | first `begin_round` (ms) | later `begin_round` (ms) "
        "| first draft step (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| `{r.spec}` | {r.path} | {r.batch} | {r.context} | {r.plain_ms:.2f} "
            f"| {r.draft_ms:.2f} | **{r.draft_ms / r.plain_ms:.2f}x** | {r.first_begin_ms:.1f} "
            f"| {r.later_begin_ms:.2f} | {r.first_step_ms:.1f} |"
        )
    return "\n".join(lines)


# -- docs -----------------------------------------------------------------------------------------
def write_docs(path: Path, body: str) -> None:
    replace_section(path, SECTION, f"\n{body}\n")


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.memory", __doc__)
    cli.add_model(parser)
    parser.add_argument("--specs", nargs="+", default=MEMORY_SPECS,
                        help="compressor specs of the memory table")
    parser.add_argument("--files", nargs="+", default=DEFAULT_FILES,
                        help="prompt files (stdlib or licence names), one request each")
    parser.add_argument("--context", type=int, default=4096,
                        help="tokens per request in the memory table (default: %(default)s)")
    parser.add_argument("--layer", type=int, default=0,
                        help="model layer whose real K/V fill the pool (default: %(default)s)")
    parser.add_argument("--draft-length", type=int, default=32,
                        help="draft steps per round (default: %(default)s)")
    parser.add_argument("--timing-specs", nargs="+", default=TIMING_SPECS)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--contexts", nargs="+", type=int, default=[2048, 4096],
                        help="contexts of the timing table (default: %(default)s)")
    parser.add_argument("--timing-dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds of --draft-length steps each (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default: %(default)s)")
    parser.add_argument("--only", choices=("memory", "time"), default=None,
                        help="run one of the two measurements")
    parser.add_argument("--write-docs", type=Path, default=None,
                        help="markdown file whose memory section gets the results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    args.model = cli.model_dir(args.model)
    geometry = Geometry.of(args.model)
    sections = []

    if args.only != "time":
        log(f"memory: prefill of {len(args.files)} texts, layer {args.layer}")
        kvs = real_kv(args.model, args.files, args.context, args.layer)
        rows = []
        for dtype in DTYPES:
            for spec in args.specs:
                rows.append(measure_memory(spec, dtype, kvs, geometry, args.draft_length))
                r = rows[-1]
                log(f"  {dtype} {spec}: {r.total / r.tokens:.2f} B/token "
                    f"(full {r.full_per_token:.2f})")
        del kvs
        table = memory_table(rows)
        print(table, flush=True)
        index = next((r.page_index / r.tokens for r in rows if r.page_index), 0.0)
        allocated = ", ".join(f"`{r.spec}` {r.allocated_per_slot:.2f}" for r in rows
                              if r.allocated_per_slot and r.dtype == "bfloat16")
        sections.append(
            f"Device bytes per context token, one layer: {len(args.files)} requests x "
            f"{args.context:,} tokens holding the real K/V of layer {args.layer} of "
            f"{args.model.name} prefilled on {', '.join(args.files)} (droppers observe that "
            f"prefill's attention probabilities), during a round of draft length "
            f"{args.draft_length} (after its first step). Of a pool row's pages, "
            f"{index:.2f} B/token is the page-slot index, held once for all layers. The "
            f"pool is preallocated for every slot of the KV pool (`allocated_bytes()` over "
            f"the slots, B): {allocated}.\n\n"
            f"{table}"
        )

    if args.only != "memory":
        dtype = DTYPES[args.timing_dtype]
        rows_t = []
        for spec in args.timing_specs:
            for batch in args.batches:
                for context in args.contexts:
                    rows_t.append(measure_time(spec, batch, context, dtype, geometry,
                                               args.draft_length, args.rounds))
                    r = rows_t[-1]
                    log(f"  {spec} batch {batch} context {context}: draft {r.draft_ms:.2f} ms, "
                        f"plain {r.plain_ms:.2f} ms")
        table = timing_table(rows_t)
        print(table, flush=True)
        sections.append(
            f"Attention of one layer per decode call on the CPU, {args.timing_dtype}, random "
            f"K/V, {torch.get_num_threads()} torch thread(s): median over {args.rounds} rounds "
            f"x {args.draft_length} calls, draft steps and plain steps alternating by round, "
            f"after one untimed round.\n\n{table}"
        )

    seconds = time.monotonic() - started
    log(f"done in {seconds:.0f} s")
    if args.write_docs:
        command = cli.invocation("bench.memory", argv)
        body = (f"```\n{command}\n```\n\nOne run, {seconds:.0f} s, on a shared "
                f"{os.cpu_count()}-core CPU machine, torch {torch.__version__} (timings are "
                f"noisy: compare the ratio within a row).\n\n"
                + "\n\n".join(sections) + "\n")
        write_docs(args.write_docs, body)
        log(f"wrote {args.write_docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
