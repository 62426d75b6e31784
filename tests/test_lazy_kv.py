"""The CPU KV pool's lazy zeros (`vericache_sglang/cpu/lazy_kv.py`): SGLang's `torch.zeros`
calls get zero tensors whose memory is taken only as it is written."""

from __future__ import annotations

import torch

from vericache_sglang.cpu.lazy_kv import MIN_BYTES, TARGET, _LazyZeros


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_large_cpu_pool_is_zero_and_takes_memory_as_it_is_written():
    before = _resident_bytes()
    with _LazyZeros():
        # The shapes SGLang asks for: (slots, heads, head_dim), in the pool's store dtype.
        pool = torch.zeros((1 << 20, 3, 64), dtype=torch.float32, device="cpu")  # 768 MiB
    assert pool.shape == (1 << 20, 3, 64) and pool.dtype == torch.float32
    assert _resident_bytes() - before < 64 << 20
    pool[1000:2000] = 1.0  # written slots become resident, the rest stays zero
    assert pool[1000:2000].eq(1).all() and pool[:1000].eq(0).all() and pool[-5:].eq(0).all()
    assert _resident_bytes() - before < 64 << 20


def test_small_or_unusual_zeros_are_torchs_own():
    with _LazyZeros():
        small = torch.zeros((4, 4), dtype=torch.float32, device="cpu")
        shaped_like = torch.zeros(MIN_BYTES // 4, dtype=torch.float32, requires_grad=True)
    assert small.untyped_storage().nbytes() == 64
    assert shaped_like.requires_grad  # a keyword the map does not serve: torch's zeros


def test_the_hook_target_exists_in_the_pinned_sglang():
    import pkgutil

    owner, _, name = TARGET.rpartition(".")
    assert callable(getattr(pkgutil.resolve_name(owner), name))
