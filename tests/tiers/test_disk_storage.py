"""The disk tier's page store (`VerifiedFileStorage`, SGLang's `HiCacheFile` plus a keyed
digest): every way a page file can go bad reads as a miss, is counted by kind, and never hands
back bytes other than the ones written."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from vericache_sglang.config import VeriCacheConfig, attach_config
from vericache_sglang.tiers import disk
from vericache_sglang.tiers.disk import DIGEST_BYTES, DISK_FAULTS, VerifiedFileStorage

PAGE = 2 * 30 * 3 * 64  # one token of the demo model's K and V, every layer


def _storage(directory: Path) -> VerifiedFileStorage:
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="demo", extra_config={"file_storage_path": str(directory)})
    return VerifiedFileStorage(config)


def _page(seed: int) -> torch.Tensor:
    return torch.randn(PAGE, generator=torch.Generator().manual_seed(seed))


def _file(storage: VerifiedFileStorage, key: str) -> Path:
    return Path(storage._path(key))


@pytest.fixture
def storage(tmp_path: Path) -> VerifiedFileStorage:
    return _storage(tmp_path / "pages")


def _faults(kind: str) -> int:
    return DISK_FAULTS.snapshot()[kind]


def test_a_page_reads_back_exactly(storage):
    page = _page(0)
    assert storage.set("a" * 64, page)
    assert _file(storage, "a" * 64).stat().st_size == page.numel() * 4 + DIGEST_BYTES
    assert storage.batch_exists(["a" * 64, "b" * 64]) == 1
    target = torch.empty(PAGE)
    assert storage.get("a" * 64, target) is target
    assert torch.equal(target, page)


def test_a_corrupted_page_is_a_counted_miss_and_is_removed(storage):
    key = "c" * 64
    storage.set(key, _page(1))
    path = _file(storage, key)
    data = bytearray(path.read_bytes())
    data[1000] ^= 0x01  # one bit of one float
    path.write_bytes(bytes(data))
    before = _faults("corrupt")
    assert storage.get(key, torch.empty(PAGE)) is None
    assert _faults("corrupt") == before + 1
    assert not path.exists() and not storage.exists(key)


def test_a_page_copied_over_another_fails_its_digest(storage):
    storage.set("d" * 64, _page(2))
    storage.set("e" * 64, _page(3))
    _file(storage, "e" * 64).write_bytes(_file(storage, "d" * 64).read_bytes())
    before = _faults("corrupt")
    assert storage.get("e" * 64, torch.empty(PAGE)) is None
    assert _faults("corrupt") == before + 1


@pytest.mark.parametrize("size", [0, PAGE * 4 - 8, PAGE * 4 + DIGEST_BYTES + 8])
def test_a_page_of_the_wrong_length_is_a_counted_miss(storage, size):
    key = "f" * 64
    storage.set(key, _page(4))
    path = _file(storage, key)
    path.write_bytes((path.read_bytes() + bytes(64))[:size])
    before = _faults("short")
    assert storage.get(key, torch.empty(PAGE)) is None
    assert _faults("short") == before + 1


def test_a_deleted_page_is_a_counted_miss(storage):
    keys = ["1" * 64, "2" * 64, "3" * 64]
    for i, key in enumerate(keys):
        storage.set(key, _page(10 + i))
    os.remove(_file(storage, keys[1]))
    before = _faults("missing")
    assert storage.batch_exists(keys) == 1  # the prefix stops at the lost page
    assert _faults("missing") == before + 1
    assert storage.get(keys[1], torch.empty(PAGE)) is None


def test_a_write_that_fails_is_counted_and_nothing_is_read_back(storage):
    directory = Path(storage.file_path)
    for name in os.listdir(directory):
        os.remove(directory / name)
    directory.rmdir()
    directory.write_bytes(b"not a directory")  # writes under it fail (as on a broken mount)
    before = _faults("write_error")
    assert not storage.set("9" * 64, _page(20))
    assert _faults("write_error") == before + 1
    assert not storage.exists("9" * 64)
    assert storage.get("9" * 64, torch.empty(PAGE)) is None


def _server_args(**values) -> SimpleNamespace:
    args = SimpleNamespace(enable_hierarchical_cache=False, hicache_host_memory_mode="cache",
                           hicache_storage_backend=None, hicache_storage_backend_extra_config=None)
    for name in list(values):
        if hasattr(args, name):
            setattr(args, name, values.pop(name))
    attach_config(args, VeriCacheConfig.build({"enable_vericache": True, **values}))
    return args


def test_the_disk_placement_turns_on_sglangs_storage_layer_with_verified_files():
    args = _server_args(vericache_full_tier="disk", vericache_disk_dir="/srv/kv")
    disk.configure(args)
    assert args.enable_hierarchical_cache and args.hicache_host_memory_mode == "buffer_only"
    assert args.hicache_storage_backend == "dynamic"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert (extra["module_path"], extra["class_name"]) == (disk.__name__, "VerifiedFileStorage")
    assert extra["file_storage_path"] == "/srv/kv"


def test_a_users_file_backend_under_vericache_gets_verified_pages_and_keeps_its_settings():
    args = _server_args(enable_hierarchical_cache=True, hicache_storage_backend="file",
                        hicache_storage_backend_extra_config='{"file_storage_path": "/kv"}')
    disk.configure(args)
    assert args.hicache_storage_backend == "dynamic"
    assert args.hicache_host_memory_mode == "cache"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert extra["class_name"] == "VerifiedFileStorage" and extra["file_storage_path"] == "/kv"
    untouched = _server_args(enable_hierarchical_cache=True)
    disk.configure(untouched)
    assert untouched.hicache_storage_backend is None


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
    storage = _storage(full_disk)
    pages = [_page(30 + i) for i in range(12)]  # 12 x 45 KiB > 256 KiB
    stored = [storage.set(f"{i:064x}", page) for i, page in enumerate(pages)]
    assert stored[0] and not stored[-1]
    assert _faults("write_error") >= 1
    for i, (page, ok) in enumerate(zip(pages, stored, strict=True)):
        target = torch.empty(PAGE)
        if ok:
            assert torch.equal(storage.get(f"{i:064x}", target), page)
        else:
            assert not storage.exists(f"{i:064x}")
