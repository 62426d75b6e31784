"""SGLang's load-backs, hooked: once a request's stored pages are loaded into device slots,
the compressed pool's pages for them come from the codes the store decoded
(`reloaded.ReloadedCodes`), and pages still waiting for their exact KV learn their slots
(`pending.py`). Apart from `reloaded.py` because the hooks find the server's store state
(`state.py`), which holds a `ReloadedCodes`. The plugin registers these hooks in every SGLang
process, so the state (whose modules bring the codec) is imported when a hook first runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vericache_sglang.integration.internals import internal

PIPELINE_CACHE = internal("sglang.srt.mem_cache.buffer_mode.pipeline.BufferModePipeline",
                          "_cache", "private attribute", __name__, on_instances=True)
"""The radix cache a buffer-mode pipeline loads back into (its page size)."""

LOAD_BACK = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.load_back"
BUFFER_LOAD_BACK = ("sglang.srt.mem_cache.buffer_mode.pipeline.BufferModePipeline"
                    "._allocate_and_queue_load_back")
"""SGLang's two load-backs: from its host pool (`load_back`), and with
`--hicache-host-memory-mode buffer_only` (VeriCache's host tier holds the full KV, SGLang's
host memory only stages pages) from the staged prefetch."""


def install_reloaded_codes(load_back: Callable[..., bool], tree: Any, node_id: Any,
                           mem_quota: int | None = None, req: Any = None) -> bool:
    """Around `UnifiedRadixCache.load_back`: once SGLang loaded a request's host pages onto
    the device (they end the request's matched path, after `req.last_node`), install the
    codes the store decoded for them, and note where pages waiting for their exact KV now
    are (`pending.py`), in the server's store state."""
    from .state import served_store_state

    last = getattr(req, "last_node", None)
    loaded = load_back(tree, node_id, mem_quota=mem_quota, req=req)
    state = served_store_state()
    if not loaded or not (len(state.reloaded) or state.pending.enabled) or last is None:
        return loaded
    slots = tree.tree_core.collect_full_device_indices(node_id, last)
    page_size = tree.page_size
    chain = tree.get_prefix_hash_values(node_id) + tree.tree_core.get_hash_values(node_id)
    pages = slots.numel() // page_size
    if pages and len(chain) >= pages:
        state.reloaded.install(chain[-pages:], slots.cpu(), page_size)
        state.pending.loaded(chain[-pages:], slots.cpu(), page_size)
    return loaded


def install_staged_codes(result: tuple[Any, str], pipeline: Any, req: Any, staged: Any,
                         *args: Any, **kwargs: Any) -> None:
    """After `BufferModePipeline._allocate_and_queue_load_back`: the staged prefetch's pages
    (`staged.hash_values`, page by page with `staged.host_indices`) were queued into device
    slots (`device_indices` of the load SGLang returns, for the host rows past the
    already-resident head): install the codes the store decoded for them."""
    from .state import served_store_state

    load = result[0]
    reloaded = served_store_state().reloaded
    if load is None or not len(reloaded):
        return None
    slots = load.device_indices
    page_size = PIPELINE_CACHE.get(pipeline).page_size
    head = (len(staged.host_indices) - slots.numel()) // page_size
    pages = slots.numel() // page_size
    keys = staged.hash_values[head:head + pages]
    if len(keys) == pages:
        reloaded.install(keys, slots.cpu(), page_size)
    return None
