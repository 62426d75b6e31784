"""Pages another configuration wrote, in a store servers share. File names (and Mooncake object
names) say nothing of the dtype, the compressor or the stream format's version, so servers of
other configurations meet each other's pages: such a page is a counted miss (`foreign`), left in
place for the servers whose page it is, and only a page whose digest fails is removed
(`stores/pages.py` `fault_kind`). Another compressor's stream still holds this page's exact KV
(tests/stores/test_reloaded.py); its drafting level is foreign. Two servers of other
compressors on one Mooncake store: tests/stores/test_mooncake_vericache.py's server D.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.host_pools import HostPool, bits, file_storage, flat_page, page_file
from vericache_sglang.codec import StreamForeign, prefix_length, read_header
from vericache_sglang.stores.file import VeriCacheFileStorage
from vericache_sglang.stores.pages import PageCoder

KEY = "a" * 64


def _foreign(storage: VeriCacheFileStorage) -> int:
    return storage.state.stats.snapshot()["faults"]["foreign"]


@pytest.fixture
def stored(tmp_path: Path, model_kv):
    """A float32 server's store of 64-token pages (4-bit KIVI) holding one page of real KV:
    the store, the page, and the directory."""
    storage = file_storage(tmp_path / "pages")
    storage.register_mem_pool_host(HostPool("layer_first", torch.float32))
    keys, values = (t[:, 64:128].float() for t in model_kv)
    page = flat_page(keys, values, "layer_first")
    assert storage.set(KEY, page)
    return storage, page, tmp_path / "pages"


def test_a_page_of_another_dtype_is_a_foreign_miss_left_in_place(stored):
    storage, page, directory = stored
    bf16 = file_storage(directory)
    bf16.register_mem_pool_host(HostPool("layer_first", torch.bfloat16))
    assert bf16.get(KEY, torch.zeros(page.numel(), dtype=torch.bfloat16)) is None
    assert _foreign(bf16) == 1
    assert page_file(storage, KEY).exists() and bf16.exists(KEY)
    target = torch.zeros_like(page)
    assert storage.get(KEY, target) is target  # still its writer's page
    assert torch.equal(bits(target), bits(page))


def test_a_page_of_the_previous_format_is_a_foreign_miss_left_in_place(stored):
    storage, page, _ = stored
    path = page_file(storage, KEY)
    data = bytearray(path.read_bytes())
    data[4] = 3  # the version byte: version 3's part digests were keyed BLAKE2b
    path.write_bytes(bytes(data))
    assert storage.get(KEY, torch.zeros_like(page)) is None
    assert _foreign(storage) == 1
    assert path.read_bytes() == bytes(data)


def test_another_compressors_drafting_level_is_foreign(stored):
    """Early drafting installs the drafting level's codes as the pool's pages: a 2-bit pool
    refuses a 4-bit stream's, and reads its own compressor's."""
    storage, page, _ = stored
    blob = page_file(storage, KEY).read_bytes()
    header, _ = read_header(blob)
    head = blob[:prefix_length(header, 1)]  # the coarse object: header and first level
    name = storage._get_suffixed_key(KEY)
    two_bit = PageCoder.for_pool(HostPool("layer_first", torch.float32), "kivi:bits=2")
    with pytest.raises(StreamForeign, match="another compressor"):
        two_bit.decode_page(head, name, drafting=True)
    keys, _, tiers = storage._coder.decode_page(head, name, drafting=True)
    assert keys.shape == two_bit.chunk_shape and [t.bits for t in tiers] == [4] * 30
