"""SGLang's host pool as VeriCache's stores use it, and the pages and file stores the store tests
build over it.

The file store and the page coder read the pool's geometry (the demo model's by default); the
pending-exact registry reads its page size and writes and frees its pages, which `HostPool`
records. The registry's tests use `small_host_pool()`, whose pages are short enough to write out
by hand (`small_page`, `page_slots`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from vericache_sglang.stores.file import VeriCacheFileStorage
from vericache_sglang.stores.state import StoreState

TOKEN_PAGE = 2 * 30 * 3 * 64
"""Floats in a page of one token of the demo model's K and V, every layer."""

SMALL_PAGE = 4
"""Tokens in a page of `small_host_pool()`: one layer, head and dimension, so its flat page is
2 * SMALL_PAGE floats."""


@dataclass(eq=False)
class HostPool:
    """What VeriCache reads of SGLang's MHA host pool (by default the demo model's geometry,
    16 pages), and the page writes and frees the pending-exact registry makes of it, recorded."""

    layout: str = "layer_first"
    dtype: torch.dtype = torch.float32
    page_size: int = 64
    layer_num: int = 30
    head_num: int = 3
    head_dim: int = 64
    written: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    freed: list[list[int]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return 16 * self.page_size

    def free(self, indices: torch.Tensor) -> int:
        self.freed.append(indices.tolist())
        return len(indices)

    def set_from_flat_data_page(self, index: int, flat: torch.Tensor) -> None:
        self.written.append((index, flat))

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * self.layer_num * self.page_size * self.head_num * self.head_dim,
                           dtype=self.dtype)


def small_host_pool() -> HostPool:
    """A pool of `SMALL_PAGE`-token pages of one float per token, K and V."""
    return HostPool(page_size=SMALL_PAGE, layer_num=1, head_num=1, head_dim=1)


def small_page(value: float) -> torch.Tensor:
    """A flat page of `small_host_pool()` with every float `value`."""
    return torch.full((2 * SMALL_PAGE,), value)


def page_slots(start: int) -> torch.Tensor:
    """The device slots of one `small_host_pool()` page, from `start`."""
    return torch.arange(start, start + SMALL_PAGE)


def token_page(seed: int) -> torch.Tensor:
    """A random page of one demo-model token (`TOKEN_PAGE` floats), the same for a seed."""
    return torch.randn(TOKEN_PAGE, generator=torch.Generator().manual_seed(seed))


def flat_page(keys: torch.Tensor, values: torch.Tensor, layout: str) -> torch.Tensor:
    """[L, page, H, D] K and V as the host pool's flat page of `layout`."""
    kv = torch.stack([keys, values])
    return (kv if layout == "layer_first" else kv.transpose(1, 2)).contiguous().flatten()


def bits(page: torch.Tensor) -> torch.Tensor:
    """A page's elements as integers of their width, to compare pages bit for bit."""
    return page.view(torch.int16 if page.element_size() == 2 else torch.int32)


def file_storage(directory: Path, state: StoreState | None = None) -> VeriCacheFileStorage:
    """VeriCache's file store of the demo model's page-first pages under `directory`, counting
    in `state` (a store state of its own by default: `storage.state`)."""
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="demo", extra_config={"file_storage_path": str(directory)})
    return VeriCacheFileStorage(config, state or StoreState())


def page_file(storage: VeriCacheFileStorage, key: str) -> Path:
    """The file that holds page `key` of `storage`."""
    return Path(storage._path(key))
