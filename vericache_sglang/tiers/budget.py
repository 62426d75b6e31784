"""The device budget: what SGLang's KV sizing flags buy once VeriCache places the KV.

SGLang sizes its KV pool from `--max-total-tokens` or `--mem-fraction-static`: N tokens of full
KV. VeriCache keeps that meaning as the device budget, the bytes N tokens of full KV take.

- `--vericache-full-tier device`: the same bytes hold the full KV pool and the compressed pool
  beside it, so the token capacity shrinks to the largest count whose full KV plus its
  compressed pages fit.
- `--vericache-full-tier host`: the full KV pool lives in host memory (SGLang's pool, allocated
  there), and the device bytes hold the compressed pool, the drafting windows and verify
  buffers of up to R running requests, and the staging area verification streams the full KV
  through. The token capacity is what the compressed pool can cover (about N x full bytes per
  token / compressed bytes per token), capped by `--vericache-full-tier-budget`; the scheduler
  then admits requests by it, and at most R run at once.

(Request-owned blocks of token droppers grow with their requests and are not sized here.)
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from vericache_sglang import startup
from vericache_sglang.compress import parse_compressor_spec
from vericache_sglang.config import VeriCacheConfig, VeriCacheConfigError, get_config
from vericache_sglang.tiers.compressed_pool import (
    SPLIT_PAGE_SHARE,
    pool_bytes_per_token,
    pool_pages,
)

logger = logging.getLogger(__name__)

TARGET = ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
          "_apply_token_constraints")
"""The configurator step that turns a profiled capacity into the pool's token count."""

MAX_REQUESTS_TARGET = ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
                       "resolve_max_num_reqs")
"""The configurator step that caps concurrent requests."""

TYPICAL_CONTEXT_SHARE = 1 / 2
"""Without --max-running-requests (host placement), each running request is planned a drafting
window and this share of the model's context in compressed pages: the split lets the requests
the windows admit use the tokens the pool holds. (A fixed sixteenth of the budget for windows
gave a 12,000-token budget 58,112 tokens of compressed pool but windows for 3 requests, so 8
requests of 4,000 tokens ran 3 at a time.) Where the host pool holds fewer tokens than that
pool would cover, the windows also get what the pool does not need."""

DEFAULT_STAGING_UNITS = 4
"""Staging buffers by default: one copied while one is read, and two more of lead."""

PLAN_ATTR = "_vericache_device_plan"
"""Where the resolved plan rides on the scheduler's server-args record, for the worker."""


@dataclass(frozen=True)
class DevicePlan:
    """How the device budget is spent (bytes measured as allocated, sizes in tokens)."""

    placement: str
    device_budget_bytes: int
    """Bytes the user's SGLang sizing gives the KV cache: N tokens of full KV."""
    full_kv_tokens: int
    """Token capacity of the full KV pool (on the device or on the host)."""
    full_kv_bytes_per_token: int
    compressed_pool_pages: int = 0
    compressed_pool_bytes: int = 0
    staging_unit_tokens: int = 0
    staging_units: int = 0
    staging_bytes: int = 0
    window_requests: int = 0
    """Running requests the device reserves drafting windows and verify buffers for."""
    window_bytes: int = 0
    host_budget_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Geometry:
    layers: int
    kv_heads: int
    head_dim: int
    itemsize: int
    context_len: int

    @property
    def full_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize


def plan_device_budget(config: VeriCacheConfig, geometry: _Geometry, tokens: int,
                       max_running_requests: int | None,
                       memory_tokens: int | None = None) -> DevicePlan:
    """Spend the bytes `tokens` of full KV take (see the module docstring). `memory_tokens`:
    the full KV tokens the memory SGLang profiled holds; with host placement on a machine
    without a GPU the host pool is allocated there, so it caps the capacity too."""
    compressor = parse_compressor_spec(config.vericache_compressor)
    full = geometry.full_per_token
    budget = tokens * full
    if config.vericache_full_tier == "device":
        fitted, pages, page_bytes = _fit_device_placement(compressor, geometry, budget)
        return DevicePlan("device", budget, fitted, full, pages, pages * page_bytes)
    layer_token = full // geometry.layers
    unit_tokens = geometry.context_len + config.vericache_max_draft_length + 1
    unit_bytes = unit_tokens * layer_token  # K and V
    units = (DEFAULT_STAGING_UNITS if config.vericache_staging_budget is None
             else config.vericache_staging_budget // unit_bytes)
    if units < 2:
        raise VeriCacheConfigError(
            f"--vericache-staging-budget {config.vericache_staging_budget} B is below two "
            f"staging units of {unit_bytes} B (K and V of one layer of a {unit_tokens}-token "
            "request): raise it or lower --context-length")
    staging = units * unit_bytes
    host_budget = config.vericache_full_tier_budget
    limits = [n for n in (None if host_budget is None else host_budget // full, memory_tokens)
              if n is not None]
    host_tokens = min(limits) if limits else None
    if not compressor.prefix_stable:
        # Token droppers keep request-owned blocks (unbudgeted): the device holds staging.
        capacity = tokens if host_tokens is None else host_tokens
        return DevicePlan("host", budget, capacity, full, staging_unit_tokens=unit_tokens,
                          staging_units=units, staging_bytes=staging,
                          host_budget_bytes=host_budget)
    plan = compressor.plan(0)
    # Drafting reads up to residual + group - 1 exact tokens and keeps its drafts' K/V; then
    # verify keeps the chain's (drafts + 1) until acceptance: full KV of these tokens per
    # running request.
    window = (plan.residual + plan.group + config.vericache_max_draft_length) * full
    page_bytes = _page_bytes(compressor, geometry)
    context_pages = pool_pages(compressor, int(geometry.context_len * TYPICAL_CONTEXT_SHARE))
    requests = max_running_requests or max(
        1, (budget - staging) // (window + context_pages * page_bytes))
    windows = requests * window
    left = budget - staging - windows
    pages = int(left // page_bytes) if left > 0 else 0
    capacity = int(pages / (1 + SPLIT_PAGE_SHARE)) * plan.group
    while capacity > 0 and pool_pages(compressor, capacity) > pages:
        capacity -= plan.group
    if capacity < geometry.context_len:
        raise VeriCacheConfigError(
            f"the device budget ({budget} B, {tokens} tokens of full KV) leaves room for "
            f"{max(capacity, 0)} tokens of compressed KV after staging ({staging} B) and the "
            f"windows of {requests} running requests ({windows} B), under one "
            f"{geometry.context_len}-token context: raise --max-total-tokens / "
            "--mem-fraction-static, or lower --vericache-staging-budget / "
            "--max-running-requests")
    if host_tokens is not None and host_tokens < capacity:
        capacity = host_tokens
    pages = pool_pages(compressor, capacity)
    if max_running_requests is None:
        # The host pool holds less than the compressed pool could cover: the budget the pool
        # does not need goes to drafting windows (more requests at once, no less context).
        requests = max(requests, (budget - staging - pages * page_bytes) // window)
        windows = requests * window
    return DevicePlan("host", budget, capacity, full, pages, pages * page_bytes, unit_tokens,
                      units, staging, requests, windows, host_budget)


def _page_bytes(compressor, geometry: _Geometry) -> int:
    return int(pool_bytes_per_token(compressor, num_layers=geometry.layers,
                                    kv_heads=geometry.kv_heads, head_dim=geometry.head_dim)
               * compressor.plan(0).group)


def _fit_device_placement(compressor, geometry: _Geometry,
                          budget: int) -> tuple[int, int, int]:
    """Tokens of full KV plus their compressed pages that fit `budget`, the pages, page bytes."""
    full = geometry.full_per_token
    if not compressor.prefix_stable:
        return budget // full, 0, 0
    page_bytes = _page_bytes(compressor, geometry)
    group = compressor.plan(0).group
    fitted = int(budget // (full + page_bytes * (1 + SPLIT_PAGE_SHARE) / group))
    # Rounding up to whole pages can overshoot by a page or two.
    while fitted > 0 and fitted * full + pool_pages(compressor, fitted) * page_bytes > budget:
        fitted -= 1
    return fitted, pool_pages(compressor, fitted), page_bytes


def _geometry(configurator: Any) -> _Geometry:
    model = configurator.model_config
    text = model.hf_text_config
    return _Geometry(layers=text.num_hidden_layers, kv_heads=text.num_key_value_heads,
                     head_dim=model.head_dim, itemsize=configurator.kv_cache_dtype.itemsize,
                     context_len=model.context_len)


def fit_compressed_pool(original, configurator: Any, token_capacity: int) -> int:
    """AROUND hook on `TARGET`: SGLang's token count, turned into VeriCache's (see the module
    docstring); the plan rides on the server args for the worker and `/server_info`."""
    tokens = original(configurator, token_capacity)
    server_args = configurator.server_args
    config = get_config(server_args)
    if not config.enable_vericache or configurator.is_draft_worker:
        return tokens
    if config.host_placement and str(configurator.device).startswith("cuda"):
        raise startup.scheduler_error(
            f"--vericache-full-tier {config.vericache_full_tier} has served on CPUs "
            "only: its copy engine passed the device check on an H200, but no server has "
            "streamed the full KV through it on a GPU yet: use --vericache-full-tier device")
    try:
        plan = plan_device_budget(config, _geometry(configurator), tokens,
                                  server_args.max_running_requests, memory_tokens=token_capacity)
    except VeriCacheConfigError as e:
        raise startup.scheduler_error(str(e)) from None
    setattr(server_args, PLAN_ATTR, plan)
    logger.info("VeriCache device budget (%s placement): %d tokens of full KV (%d B) hold %s",
                plan.placement, tokens, plan.device_budget_bytes, _describe(plan))
    return plan.full_kv_tokens


def _describe(plan: DevicePlan) -> str:
    if plan.placement == "device":
        return (f"{plan.full_kv_tokens} tokens of full KV plus their "
                f"{plan.compressed_pool_pages} compressed pages ({plan.compressed_pool_bytes} B)")
    text = (f"staging {plan.staging_units} x {plan.staging_unit_tokens} tokens of one layer "
            f"({plan.staging_bytes} B)")
    if plan.compressed_pool_pages:
        text += (f", compressed pool {plan.compressed_pool_pages} pages "
                 f"({plan.compressed_pool_bytes} B) and the windows of {plan.window_requests} "
                 f"running requests ({plan.window_bytes} B)")
    return (f"{text}; the full KV of {plan.full_kv_tokens} tokens "
            f"({plan.full_kv_tokens * plan.full_kv_bytes_per_token} B) lives in host memory")


def cap_running_requests(original, configurator: Any, token_capacity: int) -> int:
    """AROUND hook on `MAX_REQUESTS_TARGET`: no more running requests than the device reserved
    drafting windows for."""
    requests = original(configurator, token_capacity)
    plan = getattr(configurator.server_args, PLAN_ATTR, None)
    if plan is not None and plan.window_requests and plan.window_requests < requests:
        logger.info("VeriCache: at most %d running requests (the drafting windows the device "
                    "budget reserves; --max-running-requests sets it)", plan.window_requests)
        return plan.window_requests
    return requests


def device_plan(server_args: Any) -> DevicePlan | None:
    """The plan the configurator resolved in this process (None before it ran)."""
    return getattr(server_args, PLAN_ATTR, None)
