"""`--vericache-full-tier auto` (the default) resolves at startup to the placement that starts
and serves best on the machine (`tiers/placement.py`); explicit placements are kept.

The CUDA cases fake only what the choice reads (SGLang's platform facts, or `--device cuda`):
the launcher-side configuration of the demo's and README's commands then asks for the device
placement, which SGLang's own device pool serves (the host tier refuses CUDA at startup)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.runtime_context import override_platform

from vericache_sglang.config import VeriCacheConfig, attach_config, get_config
from vericache_sglang.tiers import placement


def _args(device: str | None = "cpu", hicache_storage: str | None = None,
          **settings) -> SimpleNamespace:
    args = SimpleNamespace(device=device, enable_hierarchical_cache=hicache_storage is not None,
                           hicache_storage_backend=hicache_storage)
    attach_config(args, VeriCacheConfig.build({"enable_vericache": True, **settings}))
    return args


def _resolved(args: SimpleNamespace) -> str:
    placement.resolve(args)
    return get_config(args).vericache_full_tier


def test_the_default_is_auto_and_a_cpu_gets_the_device_placement():
    args = _args()
    assert get_config(args).vericache_full_tier == "auto"
    assert _resolved(args) == "device"


@pytest.mark.parametrize("device", ["cuda", None, "xpu"])
def test_a_gpu_gets_the_device_placement(device):
    """Whether `--device cuda` is given, SGLang finds CUDA itself (faked platform), or another
    accelerator is named: only a CPU may choose the host tier."""
    with override_platform(is_cuda=True):
        assert _resolved(_args(device=device)) == "device"
        assert _resolved(_args(device=device, hicache_storage="file")) == "device"


def test_hicache_storage_on_a_cpu_gets_one_host_pool():
    assert _resolved(_args(hicache_storage="mooncake")) == "host"


def test_a_host_budget_asks_for_the_host_placement():
    assert _resolved(_args(vericache_full_tier_budget="1GiB")) == "host"
    assert _resolved(_args(vericache_staging_budget="64MiB")) == "host"


def test_a_host_budget_on_cuda_is_refused_with_one_line():
    with override_platform(is_cuda=True), pytest.raises(SystemExit) as refused:
        placement.resolve(_args(device="cuda", vericache_full_tier_budget="1GiB"))
    message = str(refused.value)
    assert "\n" not in message and "--vericache-full-tier-budget" in message
    assert "auto chose device" in message


@pytest.mark.parametrize("given", ["host", "device", "disk"])
def test_an_explicit_placement_is_kept(given):
    with override_platform(is_cuda=True):
        assert _resolved(_args(device="cuda", vericache_full_tier=given)) == given
