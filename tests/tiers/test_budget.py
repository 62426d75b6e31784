"""How SGLang's KV sizing (N tokens of full KV) is spent under each placement
(tiers/budget.py), for the demo model's float32 geometry."""

from __future__ import annotations

import pytest

from vericache_sglang.config import VeriCacheConfig, VeriCacheConfigError
from vericache_sglang.tiers.budget import (
    TYPICAL_CONTEXT_SHARE,
    _Geometry,
    plan_device_budget,
)

DEMO = _Geometry(layers=30, kv_heads=3, head_dim=64, itemsize=4, context_len=8192)


def _config(**values) -> VeriCacheConfig:
    return VeriCacheConfig.build({"enable_vericache": True, **values})


def test_host_placement_fits_the_device_budget_and_covers_more_tokens():
    plan = plan_device_budget(_config(), DEMO, 32768, max_running_requests=None)
    assert plan.placement == "host"
    device = plan.compressed_pool_bytes + plan.staging_bytes + plan.window_bytes
    assert device <= plan.device_budget_bytes == 32768 * DEMO.full_per_token
    # 4-bit pages take about a sixth of float32 KV: over four times the tokens, after the
    # staging area and the windows of the requests that use them.
    assert plan.full_kv_tokens > 4 * 32768
    assert plan.staging_units == 4


def test_the_windows_admit_requests_that_use_the_pools_tokens():
    """Without --max-running-requests each running request is planned a window and half a
    context of compressed pages: 12,000 tokens of budget run eight 4,000-token requests at
    once, their compressed KV in the pool (a sixteenth of the budget for windows ran 3), and
    a larger device runs proportionally more."""
    small, large = (plan_device_budget(_config(), DEMO, tokens, max_running_requests=None)
                    for tokens in (12000, 8 * 12000))
    assert small.window_requests >= 8
    assert small.full_kv_tokens >= 8 * (4000 + 128)
    assert small.window_requests * DEMO.context_len * TYPICAL_CONTEXT_SHARE <= \
        small.full_kv_tokens
    spent = small.compressed_pool_bytes + small.staging_bytes + small.window_bytes
    assert spent <= small.device_budget_bytes
    assert large.window_requests >= 8 * small.window_requests


def test_windows_take_what_a_smaller_host_pool_leaves():
    """A host pool of fewer tokens than the compressed pool could cover leaves device budget
    unspent: without --max-running-requests it reserves windows for more requests, within the
    budget; a given --max-running-requests is kept."""
    budget = 32768 * DEMO.full_per_token
    shared = plan_device_budget(_config(), DEMO, 32768, None)
    capped = plan_device_budget(_config(vericache_full_tier_budget=budget), DEMO, 32768, None)
    assert capped.full_kv_tokens == 32768 < shared.full_kv_tokens
    assert capped.window_requests > shared.window_requests
    window = capped.window_bytes // capped.window_requests
    spent = capped.compressed_pool_bytes + capped.staging_bytes + capped.window_bytes
    assert spent <= capped.device_budget_bytes < spent + window
    given = plan_device_budget(_config(vericache_full_tier_budget=budget), DEMO, 32768, 16)
    assert given.window_requests == 16


def test_host_budget_caps_the_tokens():
    budget = 20000 * DEMO.full_per_token
    plan = plan_device_budget(_config(vericache_full_tier_budget=budget), DEMO, 32768, 16)
    assert plan.full_kv_tokens == 20000 and plan.window_requests == 16


def test_the_memory_sglang_profiled_caps_the_tokens():
    """On a machine without a GPU the host pool takes the same memory SGLang profiled: its
    capacity never exceeds what that memory holds (SGLang asserts as much)."""
    plan = plan_device_budget(_config(), DEMO, 32768, None, memory_tokens=100_000)
    assert plan.full_kv_tokens == 100_000
    budget = 20000 * DEMO.full_per_token
    plan = plan_device_budget(_config(vericache_full_tier_budget=budget), DEMO, 32768, None,
                              memory_tokens=100_000)
    assert plan.full_kv_tokens == 20000


def test_staging_budget_sets_the_units():
    unit = (8192 + 64 + 1) * DEMO.full_per_token // DEMO.layers
    plan = plan_device_budget(_config(vericache_staging_budget=3 * unit + 5), DEMO, 32768, None)
    assert plan.staging_units == 3 and plan.staging_bytes == 3 * unit
    with pytest.raises(VeriCacheConfigError, match="below two staging units"):
        plan_device_budget(_config(vericache_staging_budget=unit), DEMO, 32768, None)


def test_a_device_budget_too_small_is_a_clear_error():
    with pytest.raises(VeriCacheConfigError, match="raise --max-total-tokens"):
        plan_device_budget(_config(), DEMO, 2000, max_running_requests=None)


def test_device_placement_keeps_full_and_compressed_within_the_budget():
    plan = plan_device_budget(_config(vericache_full_tier="device"), DEMO, 32768, None)
    assert plan.full_kv_tokens < 32768
    assert (plan.full_kv_tokens * DEMO.full_per_token + plan.compressed_pool_bytes
            <= plan.device_budget_bytes)
