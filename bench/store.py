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

from bench import cli
from bench.codec import kv_of
from vericache_sglang import models
from vericache_sglang.stores.file import VeriCacheFileStorage
from vericache_tools.hf_eval import load_model
from vericache_tools.prompts import file_ids


def _store(directory: str) -> VeriCacheFileStorage:
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="bench", extra_config={"file_storage_path": directory})
    return VeriCacheFileStorage(config)


def measure(keys: torch.Tensor, values: torch.Tensor, page: int) -> dict[str, float]:
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
            layout="layer_first", page_size=page, layer_num=layers, head_num=heads,
            head_dim=dim, dtype=keys.dtype))
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
    return {"files": len(files), "stored / raw KV": stored / raw,
            "write MB/s": raw / 1e6 / write_s, "read MB/s": raw / 1e6 / read_s}


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.store", __doc__)
    parser.add_argument("--files", nargs="+", default=["argparse.py"],
                        help="prompt files (stdlib module file names or paths)")
    parser.add_argument("--tokens", type=int, default=3200, help="tokens per prompt")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_model(models.prepare().target)
    print("| prompt | dtype | page size | form | files | stored / raw KV | write MB/s | "
          "read MB/s |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.files:
        ids = file_ids(tokenizer, name, args.tokens)
        keys, values = kv_of(model, ids)
        for dtype in (torch.bfloat16, torch.float32):
            for page in args.page_sizes:
                r = measure(keys.to(dtype), values.to(dtype), page)
                form = "CacheGen stream" if page % 32 == 0 else "raw + digest"
                print(f"| {name} ({len(ids)} tokens) | {str(dtype).removeprefix('torch.')} | "
                      f"{page} | {form} | {r['files']} | {r['stored / raw KV']:.3f} | "
                      f"{r['write MB/s']:.1f} | {r['read MB/s']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
