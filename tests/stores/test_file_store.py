"""VeriCache's `file` store (`stores/file.py`): SGLang's `HiCacheFile` with pages coded as
CacheGen streams (pages of 64 tokens) or raw with a keyed digest (pages of one token). Every way
a page file can go bad reads as a miss, is counted by kind, and never hands back bytes other
than the ones written; a server without VeriCache gets SGLang's own backend."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from tests.support.host_pools import (
    TOKEN_PAGE,
    HostPool,
    bits,
    file_storage,
    flat_page,
    page_file,
    token_page,
)
from vericache_sglang import stores
from vericache_sglang.config import VeriCacheConfig, attach_config, get_config
from vericache_sglang.stores import file as file_store
from vericache_sglang.stores.file import DIGEST_BYTES, VeriCacheFileStorage
from vericache_sglang.tiers import disk, placement


@pytest.fixture
def storage(tmp_path: Path) -> VeriCacheFileStorage:
    return file_storage(tmp_path / "pages")


def _faults(storage: VeriCacheFileStorage, kind: str) -> int:
    return storage.state.stats.snapshot()["faults"][kind]


def test_a_page_reads_back_exactly(storage):
    page = token_page(0)
    assert storage.set("a" * 64, page)
    assert page_file(storage, "a" * 64).stat().st_size == page.numel() * 4 + DIGEST_BYTES
    assert storage.batch_exists(["a" * 64, "b" * 64]) == 1
    target = torch.empty(TOKEN_PAGE)
    assert storage.get("a" * 64, target) is target
    assert torch.equal(target, page)


def test_a_corrupted_page_is_a_counted_miss_and_is_removed(storage):
    key = "c" * 64
    storage.set(key, token_page(1))
    path = page_file(storage, key)
    data = bytearray(path.read_bytes())
    data[1000] ^= 0x01  # one bit of one float
    path.write_bytes(bytes(data))
    assert storage.get(key, torch.empty(TOKEN_PAGE)) is None
    assert _faults(storage, "corrupt") == 1
    assert not path.exists() and not storage.exists(key)


def test_a_page_copied_over_another_fails_its_digest(storage):
    storage.set("d" * 64, token_page(2))
    storage.set("e" * 64, token_page(3))
    page_file(storage, "e" * 64).write_bytes(page_file(storage, "d" * 64).read_bytes())
    assert storage.get("e" * 64, torch.empty(TOKEN_PAGE)) is None
    assert _faults(storage, "corrupt") == 1


@pytest.mark.parametrize("size", [0, TOKEN_PAGE * 4 - 8, TOKEN_PAGE * 4 + DIGEST_BYTES + 8])
def test_a_page_of_the_wrong_length_is_a_counted_miss(storage, size):
    key = "f" * 64
    storage.set(key, token_page(4))
    path = page_file(storage, key)
    path.write_bytes((path.read_bytes() + bytes(64))[:size])
    assert storage.get(key, torch.empty(TOKEN_PAGE)) is None
    assert _faults(storage, "short") == 1


def test_a_deleted_page_is_a_counted_miss(storage):
    keys = ["1" * 64, "2" * 64, "3" * 64]
    for i, key in enumerate(keys):
        storage.set(key, token_page(10 + i))
    os.remove(page_file(storage, keys[1]))
    assert storage.batch_exists(keys) == 1  # the prefix stops at the lost page
    assert _faults(storage, "missing") == 1
    assert storage.get(keys[1], torch.empty(TOKEN_PAGE)) is None


def test_a_write_that_fails_is_counted_and_nothing_is_read_back(storage):
    directory = Path(storage.file_path)
    for name in os.listdir(directory):
        os.remove(directory / name)
    directory.rmdir()
    directory.write_bytes(b"not a directory")  # writes under it fail (as on a broken mount)
    assert not storage.set("9" * 64, token_page(20))
    assert _faults(storage, "write_error") == 1
    assert not storage.exists("9" * 64)
    assert storage.get("9" * 64, torch.empty(TOKEN_PAGE)) is None


def _server_args(**values) -> SimpleNamespace:
    args = SimpleNamespace(enable_hierarchical_cache=False, hicache_host_memory_mode="cache",
                           hicache_storage_backend=None, hicache_storage_backend_extra_config=None,
                           device="cpu")
    for name in list(values):
        if hasattr(args, name):
            setattr(args, name, values.pop(name))
    attach_config(args, VeriCacheConfig.build({"enable_vericache": True, **values}))
    return args


def test_the_disk_placement_turns_on_sglangs_storage_layer_with_its_file_backend():
    args = _server_args(vericache_full_tier="disk", vericache_disk_dir="/srv/kv")
    disk.configure(args)
    assert args.enable_hierarchical_cache and args.hicache_host_memory_mode == "buffer_only"
    assert args.hicache_storage_backend == "file"
    assert json.loads(args.hicache_storage_backend_extra_config) == {"file_storage_path": "/srv/kv"}


def test_a_users_file_backend_under_vericache_keeps_its_arguments_in_one_host_pool():
    given = '{"file_storage_path": "/kv"}'
    args = _server_args(enable_hierarchical_cache=True, hicache_storage_backend="file",
                        hicache_storage_backend_extra_config=given)
    placement.resolve(args)  # the default, auto, puts the full KV in host memory here
    assert get_config(args).vericache_full_tier == "host"
    disk.configure(args)
    assert (args.hicache_storage_backend, args.hicache_storage_backend_extra_config) == (
        "file", given)
    # The host tier holds the full KV; SGLang's host memory only stages pages to storage.
    assert args.hicache_host_memory_mode == "buffer_only"
    # With the full KV on the device, SGLang's host pool is its own tier below it.
    device = _server_args(enable_hierarchical_cache=True, hicache_storage_backend="file",
                          vericache_full_tier="device")
    disk.configure(device)
    assert device.hicache_host_memory_mode == "cache"


def test_sglangs_file_backend_is_vericaches_only_on_a_vericache_server(tmp_path):
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    stores.register()
    entry = StorageBackendFactory._registry["file"]
    assert (entry["module_path"], entry["class_name"]) == (file_store.__name__, "FileBackend")
    # This process serves nothing: the factory's class builds SGLang's own backend.
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="demo", extra_config={"file_storage_path": str(tmp_path)})
    assert type(entry["loader"]()(config)) is HiCacheFile


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: room for a few pages (skipped where mounting is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs privileges this machine does not give")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_refuses_pages_and_keeps_the_ones_it_has(full_disk):
    storage = file_storage(full_disk)
    pages = [token_page(30 + i) for i in range(12)]  # 12 x 45 KiB > 256 KiB
    stored = [storage.set(f"{i:064x}", page) for i, page in enumerate(pages)]
    assert stored[0] and not stored[-1]
    assert _faults(storage, "write_error") >= 1
    for i, (page, ok) in enumerate(zip(pages, stored, strict=True)):
        target = torch.empty(TOKEN_PAGE)
        if ok:
            assert torch.equal(storage.get(f"{i:064x}", target), page)
        else:
            assert not storage.exists(f"{i:064x}")


@pytest.fixture(params=[("layer_first", torch.float32), ("page_first", torch.bfloat16)],
                ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}")
def coded(request, tmp_path, model_kv):
    """A store of 64-token pages over a host pool of the given layout and dtype, and a page of
    real KV in it (tokens 64-127)."""
    layout, dtype = request.param
    storage = file_storage(tmp_path / "pages")
    storage.register_mem_pool_host(HostPool(layout, dtype))
    keys, values = (t[:, 64:128].to(dtype) for t in model_kv)
    return storage, flat_page(keys, values, layout)


def test_a_page_of_64_tokens_is_stored_as_one_smaller_stream_and_read_back_exactly(coded):
    storage, page = coded
    assert storage.set("a" * 64, page)
    data = page_file(storage, "a" * 64).read_bytes()
    raw = page.numel() * page.element_size()
    assert data[:4] == b"VCKV"
    # The exact KV, entropy coded: measured 0.91 of the float32 bytes and 0.77 of the bf16
    # (stream version 3, whose sizes version 4 keeps; its lanes' final states and word counts
    # cost about 2% of a 64-token page, whose version-2 stream took 0.75 of the bf16 bytes).
    assert len(data) < (0.92 if page.dtype == torch.float32 else 0.78) * raw, len(data) / raw
    target = torch.zeros_like(page)
    assert storage.get("a" * 64, target) is target
    assert torch.equal(bits(target), bits(page))
    io = storage.state.stats.snapshot()["io"]
    assert io["written_coded_bytes"] == len(data)
    assert io["read_coded_pages"] == 1 and io["read_kv_bytes"] == raw


def _overlapping(storage: VeriCacheFileStorage) -> dict[str, int]:
    """Wraps the store's page reads: each counts itself in while it runs, and the first waits
    (up to 10 s, once) for a second to start beside it, so `peak` reaches 2 exactly when two
    pages are read at once, however fast each read is."""
    seen = {"running": 0, "peak": 0}
    lock, two = threading.Lock(), threading.Event()
    load = storage._load

    def counted(*args: object) -> object:
        with lock:
            seen["running"] += 1
            seen["peak"] = max(seen["peak"], seen["running"])
            if seen["running"] >= 2:
                two.set()
        try:
            if not two.wait(10):
                two.set()  # one at a time: the rest need not wait
            return load(*args)
        finally:
            with lock:
                seen["running"] -= 1

    storage._load = counted
    return seen


def test_a_batch_reads_pages_side_by_side_up_to_the_first_missing_one(coded):
    """SGLang's prefetch reads a batch of pages with one `batch_get` and stops at the first
    miss: the pages are read and decoded several at once, each comes back as its own bits, and
    from the missing one on nothing is handed back or counted as read."""
    storage, page = coded
    overlap = _overlapping(storage)
    keys = [f"{i + 16:064x}" for i in range(5)]
    pages = [page.roll(7 * i) for i in range(5)]
    for key, value in zip(keys, pages, strict=True):
        assert storage.set(key, value)
    page_file(storage, keys[3]).unlink()
    targets = [torch.zeros_like(page) for _ in keys]
    got = storage.batch_get(keys, targets)
    assert [t is target for t, target in zip(got[:3], targets[:3], strict=True)] == [True] * 3
    assert got[3:] == [None, None]
    for target, value in zip(targets[:3], pages[:3], strict=True):
        assert torch.equal(bits(target), bits(value))
    assert overlap["peak"] >= 2  # several pages in flight at once
    assert storage.state.stats.snapshot()["io"]["read_coded_pages"] == 3
    assert _faults(storage, "missing") == 1


@pytest.mark.parametrize("damage", ["truncated", "bit flipped", "copied from another page"])
def test_a_damaged_stream_is_a_counted_miss(coded, damage):
    """A stream whose digest fails is removed, to be written again; a truncated one stays
    (only a failed digest proves the bytes are not what their writer stored)."""
    storage, page = coded
    key, other = "b" * 64, "c" * 64
    storage.set(key, page)
    storage.set(other, page.roll(1))
    path = page_file(storage, key)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) - 100]
    elif damage == "bit flipped":
        data[len(data) // 2] ^= 0x10
    else:
        data = bytearray(page_file(storage, other).read_bytes())
    path.write_bytes(bytes(data))
    kind = "short" if damage == "truncated" else "corrupt"
    target = torch.zeros_like(page)
    assert storage.get(key, target) is None
    assert _faults(storage, kind) == 1
    assert path.exists() == storage.exists(key) == (kind == "short")


@pytest.mark.parametrize("pool", [HostPool("layer_first", torch.float32, page_size=1),
                                  HostPool("page_first_direct", torch.float32)],
                         ids=["pages of one token", "a layout the coder does not read"])
def test_pages_the_codec_cannot_take_are_stored_raw_with_a_digest(tmp_path, pool):
    storage = file_storage(tmp_path / "pages")
    storage.register_mem_pool_host(pool)
    page = token_page(40)[: TOKEN_PAGE * pool.page_size]
    assert storage.set("d" * 64, page)
    assert page_file(storage, "d" * 64).stat().st_size == page.numel() * 4 + DIGEST_BYTES
