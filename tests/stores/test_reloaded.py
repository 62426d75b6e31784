"""A reloaded prefix's compressed pages come from the stored stream (`stores/reloaded.py`).

On real demo-model KV: a page the store reads offers its stream's pool level; installed at the
slots SGLang loads the page into, it is bit for bit the pages the compressed pool would have
quantized from that KV, and the pool quantizes nothing of it, though the full KV at those slots
is zeros here (so the pages cannot have come from it). Codes that are not the pool's pages (a
stream another compressor wrote, codes of another geometry) are skipped and counted, and the
pool quantizes those pages from their KV. The server path (SGLang's load-back hook) is
tests/speculative/test_page_size.py's server B, and with another compressor's streams
tests/stores/test_mooncake_vericache.py's server D.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from tests.support.host_pools import TOKEN_PAGE, HostPool, file_storage, flat_page
from vericache_sglang.codec import coarser, finer
from vericache_sglang.compress import parse_compressor_spec
from vericache_sglang.compress.quant import QuantTier
from vericache_sglang.tiers.compressed_pool import CompressedPagePool

PAGE = 64
TOKENS = (64, 192)
"""Two pages of real KV, tokens 64-191 of the prompt."""


def _pool(keys: torch.Tensor | None, values: torch.Tensor | None,
          compressor: str = "kivi:bits=4") -> tuple[CompressedPagePool, torch.Tensor]:
    """A compressed pool beside an SGLang KV pool whose slots 1..n hold `keys`/`values`
    ([L, n, H, D]; zeros where None), and those slots."""
    kv = MHATokenToKVPool(size=TOKENS[1] - TOKENS[0] + 8, page_size=1, dtype=torch.float32,
                          head_num=3, head_dim=64, layer_num=30, device="cpu",
                          enable_memory_saver=False)
    slots = torch.arange(1, TOKENS[1] - TOKENS[0] + 1)
    if keys is not None:
        for layer in range(30):
            kv.k_buffer[layer][slots] = keys[layer]
            kv.v_buffer[layer][slots] = values[layer]
    return CompressedPagePool(parse_compressor_spec(compressor), kv, num_pages=8), slots


@pytest.fixture
def stored(tmp_path: Path, model_kv):
    """A store of 64-token pages holding two pages of real float32 KV (its reloaded codes in
    `storage.state.reloaded`), and that KV."""
    storage = file_storage(tmp_path / "pages")
    storage.register_mem_pool_host(HostPool("layer_first", torch.float32))
    keys, values = (t[:, TOKENS[0]:TOKENS[1]].float() for t in model_kv)
    for page in range(2):
        rows = slice(page * PAGE, (page + 1) * PAGE)
        assert storage.set(f"{page:064x}", flat_page(keys[:, rows], values[:, rows],
                                                     "layer_first"))
    return storage, keys, values


def _read(storage) -> list[str]:
    keys = [f"{page:064x}" for page in range(2)]
    target = torch.zeros(TOKEN_PAGE * PAGE)
    for key in keys:
        assert storage.get(key, target) is target
    return keys


def test_reloaded_pages_are_the_pools_own_pages_without_quantizing(stored):
    storage, keys, values = stored
    reference, slots = _pool(keys, values)
    want = reference.pages(slots)
    assert reference.compressed_pages == 4

    pool, slots = _pool(None, None)  # the full KV is zeros: nothing to quantize from
    reloaded = storage.state.reloaded
    reloaded.accept(pool)
    page_keys = _read(storage)
    assert len(reloaded) == 2
    reloaded.install(page_keys, slots, PAGE)
    got = pool.pages(slots.to(torch.int32))  # found whatever the slots' integer dtype
    assert pool.compressed_pages == 0 and pool.installed_pages == 4
    assert reloaded.snapshot()["installed_pages"] == 4
    assert len(reloaded) == 0
    for layer in range(30):
        for mine, theirs in zip(
                (pool.k_codes, pool.k_scale, pool.k_zero, pool.v_codes, pool.v_scale,
                 pool.v_zero),
                (reference.k_codes, reference.k_scale, reference.k_zero, reference.v_codes,
                 reference.v_scale, reference.v_zero), strict=True):
            assert torch.equal(mine[layer][got], theirs[layer][want])
    # A page the pool already holds is not installed twice.
    assert pool.install(slots[:PAGE], reference_tiers(reference, want[:2])) == 0


def test_pool_level_codes_replace_coarse_ones_in_place(stored):
    """A page answered on the coarse level (its codes lifted to the pool's bits) is
    overwritten in its own pool page by the pool level's codes when its exact part comes."""
    storage, keys, values = stored
    reference, slots = _pool(keys, values)
    want = reference.pages(slots[:PAGE])
    pool_tiers = reference_tiers(reference, want)
    pool, _ = _pool(None, None)
    coarse = [finer(coarser(tier, 2), 4) for tier in pool_tiers]
    assert pool.install(slots[:PAGE], coarse) == 2
    pages = pool.pages(slots[:PAGE])
    assert not torch.equal(pool.k_codes[5][pages], reference.k_codes[5][want])
    assert pool.install(slots[:PAGE], pool_tiers, replace=True) == 2
    assert torch.equal(pool.pages(slots[:PAGE]), pages) and pool.installed_pages == 2
    for layer in range(30):
        assert torch.equal(pool.k_codes[layer][pages], reference.k_codes[layer][want])
        assert torch.equal(pool.v_scale[layer][pages], reference.v_scale[layer][want])


def reference_tiers(pool: CompressedPagePool, pages: torch.Tensor):
    """`pages` of `pool` as per-layer tiers (token-major value rows), as a store decodes them."""
    return [QuantTier(pool.bits[layer], pool.k_codes[layer][pages], pool.k_scale[layer][pages],
                      pool.k_zero[layer][pages], pool.v_codes[layer][pages].flatten(0, 1),
                      pool.v_scale[layer][pages].flatten(0, 1),
                      pool.v_zero[layer][pages].flatten(0, 1))
            for layer in range(30)]


def test_codes_of_another_geometry_are_refused(stored):
    storage, keys, values = stored
    reference, slots = _pool(keys, values)
    tiers = reference_tiers(reference, reference.pages(slots)[:2])
    two_bit, _ = _pool(None, None, "kivi:bits=2")
    assert reference.fits(slots[:PAGE], tiers)
    for pool, at in ((two_bit, slots[:PAGE]), (reference, slots[:PAGE + 32]),
                     (reference, slots[:PAGE - 32])):
        assert not pool.fits(at, tiers)
        with pytest.raises(ValueError, match="geometry"):
            pool.install(at, tiers)


def test_codes_of_another_geometry_are_skipped_at_load_back(stored):
    """A 4-bit store's codes waiting for a 2-bit pool: the load-back installs none and does
    not raise; they are counted, and the pool quantizes those pages from the KV loaded into
    their slots, as it does for a page no store offered codes for."""
    storage, keys, values = stored
    pool, slots = _pool(keys, values, "kivi:bits=2")
    reloaded = storage.state.reloaded
    reloaded.accept(pool)
    page_keys = _read(storage)
    assert len(reloaded) == 2
    reloaded.install(page_keys, slots, PAGE)
    counts = reloaded.snapshot()
    assert counts["skipped_pages"] == 2
    assert counts["installed_pages"] == 0 and len(reloaded) == 0
    assert pool.installed_pages == 0
    got = pool.pages(slots)
    assert pool.compressed_pages == 4
    reference, _ = _pool(keys, values, "kivi:bits=2")
    want = reference.pages(slots)
    for layer in (0, 29):
        assert torch.equal(pool.k_codes[layer][got], reference.k_codes[layer][want])
        assert torch.equal(pool.v_scale[layer][got], reference.v_scale[layer][want])


def test_another_compressors_stream_gives_its_exact_kv_and_no_codes(stored, tmp_path):
    """A 2-bit server reads the pages a 4-bit one stored in the same directory: their exact KV
    is this page's all the same, their codes are not its pool's pages (skipped, counted). No
    fault, and the files stay."""
    storage, keys, values = stored
    pool, _ = _pool(None, None, "kivi:bits=2")
    two_bit = file_storage(tmp_path / "pages")
    two_bit.compressor = "kivi:bits=2"
    two_bit.register_mem_pool_host(HostPool("layer_first", torch.float32))
    reloaded = two_bit.state.reloaded
    reloaded.accept(pool)
    _read(two_bit)
    assert reloaded.snapshot()["skipped_pages"] == 2
    assert len(reloaded) == 0 and not any(two_bit.state.stats.snapshot()["faults"].values())
    target = torch.zeros(TOKEN_PAGE * PAGE)
    assert two_bit.get(f"{1:064x}", target) is target
    assert torch.equal(target, flat_page(keys[:, PAGE:], values[:, PAGE:], "layer_first"))
    assert all(storage.exists(f"{page:064x}") for page in range(2))


def test_waiting_codes_are_bounded_oldest_first(stored):
    storage, keys, values = stored
    pool, _ = _pool(None, None)
    reloaded = storage.state.reloaded
    reloaded.accept(pool)
    reloaded.capacity = 1
    page_keys = _read(storage)
    assert len(reloaded) == 1 and reloaded.dropped == 1
    assert reloaded.take(page_keys[0]) is None and reloaded.take(page_keys[1]) is not None


def test_nothing_waits_without_a_pool_or_for_a_token_dropper(stored, tmp_path):
    storage, _, _ = stored
    storage.state.reloaded.accept(None)
    _read(storage)
    assert len(storage.state.reloaded) == 0
    # A token dropper's stream carries 4-bit KIVI bins as the exact part's predictor only.
    pool, _ = _pool(None, None)
    dropper = file_storage(tmp_path / "snapkv")
    dropper.state.reloaded.accept(pool)
    dropper.compressor = "snapkv:ratio=0.25"
    dropper.register_mem_pool_host(HostPool("layer_first", torch.float32))
    page = torch.zeros(TOKEN_PAGE * PAGE)
    assert dropper.set("e" * 64, page)
    assert dropper.get("e" * 64, torch.empty_like(page)) is not None
    assert len(dropper.state.reloaded) == 0
