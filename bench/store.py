"""Objects and bytes of a stored prefix in VeriCache's `file` store, by page size (not a test).

The demo model's own K/V of a prompt (every layer, bf16 and float32) is written page by page
through `stores/file.VeriCacheFileStorage` over the host pool layout SGLang uses on CPU, as a
HiCache backup would: pages of one token (SGLang's default) are stored raw with a digest, pages
of 64 as one CacheGen stream each. The table gives the files, the bytes on disk against the raw
KV, and write and read (decode and check) speed in MB of KV per second on one core. Every page
is read back and compared with what was written.

    python -m bench.store --files argparse.py --tokens 3200
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from bench import cli, tables
from bench.codec import kv_of
from vericache_sglang import models
from vericache_sglang.stores.file import VeriCacheFileStorage
from vericache_sglang.stores.state import StoreState
from vericache_tools.hf_eval import load_model
from vericache_tools.prompts import file_ids


def _store(directory: str) -> VeriCacheFileStorage:
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="bench", extra_config={"file_storage_path": directory})
    return VeriCacheFileStorage(config, StoreState())


def measure_pages(keys: torch.Tensor, values: torch.Tensor, page: int) -> dict[str, float]:
    """Store [L, T, H, D] K/V as pages of `page` tokens (layer_first host layout)."""
    layers, tokens, heads, dim = keys.shape
    pages = tokens // page
    flat = [torch.stack([keys[:, p * page:(p + 1) * page],
                         values[:, p * page:(p + 1) * page]]).contiguous().flatten()
            for p in range(pages)]
    raw = sum(f.numel() * f.element_size() for f in flat)
    with tempfile.TemporaryDirectory() as directory:
        store = _store(directory)
        store.register_mem_pool_host(SimpleNamespace(
            layout="layer_first", page_size=page, size=pages * page, layer_num=layers,
            head_num=heads, head_dim=dim, dtype=keys.dtype))
        began = time.perf_counter()
        assert all(store.set(f"{p:064x}", f) for p, f in enumerate(flat))
        write_s = time.perf_counter() - began
        files = list(Path(directory).glob("*.bin"))
        stored = sum(f.stat().st_size for f in files)
        began = time.perf_counter()
        for p, f in enumerate(flat):
            target = torch.empty_like(f)
            assert store.get(f"{p:064x}", target) is not None and torch.equal(target, f)
        read_s = time.perf_counter() - began
    return {"files": len(files), "stored_ratio": stored / raw,
            "write_mb_s": raw / 1e6 / write_s, "read_mb_s": raw / 1e6 / read_s}


def measure(model, tokenizer, files: list[str], tokens: int,
            page_sizes: tuple[int, ...] = (1, 64)) -> list[dict]:
    """One row per prompt, dtype and page size: the pages' files, bytes on disk over the raw KV,
    write and read speed. Runs on one thread (speeds are per core)."""
    rows = []
    with cli.threads(1):
        for name in files:
            ids = file_ids(tokenizer, name, tokens)
            keys, values = kv_of(model, ids)
            for dtype in (torch.bfloat16, torch.float32):
                for page in page_sizes:
                    rows.append({"prompt": f"{name} ({len(ids)} tokens)",
                                 "dtype": str(dtype).removeprefix("torch."), "page": page,
                                 "form": "CacheGen stream" if page % 32 == 0 else "raw + digest",
                                 **measure_pages(keys.to(dtype), values.to(dtype), page)})
                    cli.log(f"store: {rows[-1]['prompt']}, {rows[-1]['dtype']}, pages of "
                            f"{page}: {rows[-1]['stored_ratio']:.3f} of the raw KV")
    return rows


def markdown(rows: list[dict]) -> str:
    return tables.table(
        ["prompt", "dtype", "page size", "form", "files", "stored / raw KV", "write MB/s",
         "read MB/s"],
        [[r["prompt"], r["dtype"], r["page"], r["form"], r["files"], f"{r['stored_ratio']:.3f}",
          f"{r['write_mb_s']:.1f}", f"{r['read_mb_s']:.1f}"] for r in rows], "llrlrrrr")


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.store", __doc__)
    parser.add_argument("--files", nargs="+", default=["argparse.py"],
                        help="prompt files (stdlib module file names or paths)")
    parser.add_argument("--tokens", type=int, default=3200, help="tokens per prompt")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args(argv)
    model, tokenizer = load_model(models.prepare().target)
    print(markdown(measure(model, tokenizer, args.files, args.tokens, tuple(args.page_sizes))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
