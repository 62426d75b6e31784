"""The device budget: the compressed pool is paid for out of the memory SGLang gives its KV pool.

SGLang sizes its KV pool from `--max-total-tokens` or `--mem-fraction-static`. With VeriCache
and a prefix-stable compressor, the same bytes must hold the full KV pool and the compressed
pool beside it, so the token capacity shrinks to the largest count whose full KV plus its
compressed pages fit the bytes the user's capacity would have taken alone. (Request-owned
blocks of token droppers grow with their requests and are not sized here.)
"""

from __future__ import annotations

import logging
from typing import Any

from vericache_sglang.compress import parse_compressor_spec
from vericache_sglang.config import get_config
from vericache_sglang.tiers.compressed_pool import (
    SPLIT_PAGE_SHARE,
    pool_bytes_per_token,
    pool_pages,
)

logger = logging.getLogger(__name__)

TARGET = ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
          "_apply_token_constraints")
"""The configurator step that turns a profiled capacity into the pool's token count."""


def fit_compressed_pool(original, configurator: Any, token_capacity: int) -> int:
    """AROUND hook on `TARGET`: SGLang's token count, shrunk to leave room for the pool."""
    tokens = original(configurator, token_capacity)
    config = get_config(configurator.server_args)
    if not config.enable_vericache or configurator.is_draft_worker:
        return tokens
    compressor = parse_compressor_spec(config.vericache_compressor)
    if not compressor.prefix_stable:
        return tokens
    model = configurator.model_config
    text = model.hf_text_config
    layers, heads = text.num_hidden_layers, text.num_key_value_heads
    full_per_token = 2 * layers * heads * model.head_dim * configurator.kv_cache_dtype.itemsize
    page_bytes = pool_bytes_per_token(compressor, num_layers=layers, kv_heads=heads,
                                      head_dim=model.head_dim) * compressor.plan(0).group
    budget = tokens * full_per_token
    pool_per_token = page_bytes * (1 + SPLIT_PAGE_SHARE) / compressor.plan(0).group
    fitted = int(budget // (full_per_token + pool_per_token))
    # Rounding up to whole pages can overshoot by a page or two.
    while fitted > 0 and fitted * full_per_token + pool_pages(compressor, fitted) * page_bytes \
            > budget:
        fitted -= 1
    logger.info("VeriCache device budget: %d tokens of full KV (%d B) now hold %d tokens of "
                "full KV plus their compressed pages", tokens, budget, fitted)
    return fitted
