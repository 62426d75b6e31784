"""SGLang's prefix caches run in-process on the CPU: the layer VeriCache extends.

`RadixCache` (the classic radix tree) and `UnifiedRadixCache` (the per-component tree that
SGLang 0.5.23's default factory builds for a plain full-attention model) are driven over real,
small `MHATokenToKVPool` / `TokenToKVPoolAllocator` pools on device="cpu". Keys are
`RadixKey(array("q", ids))`; values are the allocator's device KV indices.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode
from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    create_unified_radix_cache,
)
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
from sglang.srt.mem_cache.unified_cache.unified_tree_core import (
    UnifiedTreeCore,
    UnifiedTreeNode,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import create_context, use_context
from sglang.srt.server_args import ServerArgs

FULL = ComponentType.FULL


# --------------------------------------------------------------------------- helpers


def key(tokens: list[int] | tuple[int, ...]) -> RadixKey:
    """A radix key over token ids."""
    return RadixKey(array("q", tokens))


def make_pools(size: int = 64) -> tuple[ReqToTokenPool, TokenToKVPoolAllocator]:
    """A small req-to-token pool and the allocator of a real one-layer MHA KV pool of ``size``
    slots, all on the CPU."""
    kv_pool = MHATokenToKVPool(
        size=size,
        page_size=1,
        dtype=torch.float16,
        head_num=1,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = TokenToKVPoolAllocator(
        size=size, dtype=torch.float16, device="cpu", kvcache=kv_pool, need_sort=False
    )
    req_to_token_pool = ReqToTokenPool(
        size=4, max_context_len=64, device="cpu", enable_memory_saver=False
    )
    return req_to_token_pool, allocator


def make_radix_cache(size: int = 64) -> tuple[RadixCache, TokenToKVPoolAllocator]:
    """A `RadixCache` over real CPU pools (page size 1, LRU eviction)."""
    req_to_token_pool, allocator = make_pools(size)
    cache = RadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=allocator,
            page_size=1,
        )
    )
    return cache, allocator


def radix_insert(
    cache: RadixCache, allocator: TokenToKVPoolAllocator, tokens: list[int]
) -> tuple[int, torch.Tensor]:
    """Insert ``tokens`` with freshly allocated KV slots, then free the slots of the prefix the
    tree already held (what `RadixCache._insert_cache` does for a finished request).

    Returns the already-cached prefix length and the slots now owned by the tree."""
    slots = allocator.alloc(len(tokens))
    assert slots is not None
    prefix_len = cache.insert(InsertParams(key=key(tokens), value=slots)).prefix_len
    allocator.free(slots[:prefix_len])
    return prefix_len, slots


def radix_match(cache: RadixCache, tokens: list[int]) -> tuple[int, TreeNode, list[int]]:
    """Match ``tokens``: the hit length, the last matched node and the hit's device indices."""
    result = cache.match_prefix(MatchPrefixParams(key=key(tokens)))
    indices = cache.path_device_indices(result.last_device_node).tolist()
    assert len(indices) == result.device_prefix_len
    return result.device_prefix_len, result.last_device_node, indices


def radix_contents(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Everything the tree holds, read without touching it: prefix -> KV index of its last
    token."""
    contents: dict[tuple[int, ...], int] = {}
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(cache.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            child_path = path
            for token, index in zip(child.key.token_ids, child.value.tolist(), strict=True):
                child_path = (*child_path, token)
                contents[child_path] = index
            stack.append((child, child_path))
    return contents


# --------------------------------------------------------------------------- RadixCache


def test_simulated_cache_matches_longest_prefix_with_token_ids_as_values() -> None:
    """`create_simulated()` needs no pools; a value-less insert stores the token ids."""
    cache = RadixCache.create_simulated()
    for tokens in ([1, 2, 3], [1, 2, 3], [1, 2, 4, 5], [1, 2, 4, 5, 6, 7], [8, 9, 10, 11, 12]):
        cache.insert(InsertParams(key=key(tokens)))

    result = cache.match_prefix(MatchPrefixParams(key=key([1, 2, 3, 13, 14])))
    assert result.device_prefix_len == 3
    assert cache.path_device_indices(result.last_device_node).tolist() == [1, 2, 3]
    for tokens, hit in (([1, 2, 4, 5, 6, 99], 5), ([1, 2, 9], 2), ([99], 0)):
        assert cache.match_prefix(MatchPrefixParams(key=key(tokens))).device_prefix_len == hit
    # [1, 2] shared + [3] + [4, 5, 6, 7] + [8, ..., 12]
    assert cache.total_size() == 2 + 1 + 4 + 5 == cache.evictable_size()


def test_simulated_cache_cannot_evict_without_an_allocator() -> None:
    """Eviction frees slots through the allocator, which `create_simulated()` leaves as None."""
    cache = RadixCache.create_simulated()
    cache.insert(InsertParams(key=key([1, 2, 3])))
    with pytest.raises(AttributeError, match="free_segment"):
        cache.evict(EvictParams(num_tokens=1))


def test_page_size_truncates_keys_to_whole_pages() -> None:
    """With page_size=4 only whole pages are inserted and matched."""
    cache = RadixCache.create_simulated(page_size=4)
    assert cache.insert(InsertParams(key=key(list(range(10))))).prefix_len == 0
    assert cache.total_size() == 8  # tokens 8 and 9 are a partial page
    assert cache.match_prefix(MatchPrefixParams(key=key(list(range(7))))).device_prefix_len == 4
    assert cache.match_prefix(MatchPrefixParams(key=key([0, 1, 2, 9]))).device_prefix_len == 0
    # A divergence inside the second page keeps only the first page.
    probe = [0, 1, 2, 3, 4, 5, 99, 7, 8, 9]
    assert cache.match_prefix(MatchPrefixParams(key=key(probe))).device_prefix_len == 4


def test_match_returns_device_indices_of_the_longest_shared_prefix() -> None:
    """A hit is the longest cached prefix; its indices come from whichever insert owns them."""
    cache, allocator = make_radix_cache()
    prefix_a, slots_a = radix_insert(cache, allocator, [10, 11, 12, 13, 14])
    prefix_b, slots_b = radix_insert(cache, allocator, [10, 11, 12, 20, 21])
    assert (prefix_a, prefix_b) == (0, 3)

    length, _, indices = radix_match(cache, [10, 11, 12, 20, 99])
    assert length == 4
    assert indices == slots_a[:3].tolist() + slots_b[3:4].tolist()

    length, _, indices = radix_match(cache, [10, 11, 12, 13, 14, 15])
    assert (length, indices) == (5, slots_a.tolist())

    length, node, indices = radix_match(cache, [99, 10])
    assert (length, indices) == (0, [])
    assert node is cache.root_node

    # 5 + 2 tokens held, and the 3 duplicate slots went back to the allocator.
    assert cache.total_size() == 7
    assert allocator.available_size() == 64 - 7


def test_partial_match_splits_the_node_at_the_divergence() -> None:
    """Matching into the middle of a segment splits it so the hit ends on a node boundary."""
    cache, allocator = make_radix_cache()
    _, slots = radix_insert(cache, allocator, [1, 2, 3, 4, 5, 6])
    (leaf,) = cache.root_node.children.values()
    assert list(leaf.key.token_ids) == [1, 2, 3, 4, 5, 6]

    length, node, indices = radix_match(cache, [1, 2, 3, 7])
    assert (length, indices) == (3, slots[:3].tolist())
    assert list(node.key.token_ids) == [1, 2, 3]
    assert node.parent is cache.root_node
    assert list(node.children.values()) == [leaf]
    assert leaf.parent is node
    assert list(leaf.key.token_ids) == [4, 5, 6]
    assert leaf.value.tolist() == slots[3:].tolist()
    # A split moves no data: sizes are unchanged.
    assert cache.total_size() == cache.evictable_size() == 6

    # An insert diverging inside a segment splits it too, and adds a sibling.
    prefix_len, _ = radix_insert(cache, allocator, [1, 2, 3, 4, 9])
    assert prefix_len == 4
    four = node.children[4]
    assert list(four.key.token_ids) == [4]
    assert sorted(tuple(c.key.token_ids) for c in four.children.values()) == [(5, 6), (9,)]
    assert cache.total_size() == 7


def test_lock_refs_protect_a_path_from_eviction() -> None:
    """A locked node and its ancestors are protected; unlocking makes them evictable again."""
    cache, allocator = make_radix_cache()
    radix_insert(cache, allocator, [1, 2, 3, 4])
    radix_insert(cache, allocator, [1, 2, 5, 6])
    radix_insert(cache, allocator, [7, 8, 9])
    _, locked, _ = radix_match(cache, [1, 2, 3, 4])

    assert cache.inc_lock_ref(locked).delta == -4  # [3, 4] and the shared [1, 2]
    assert locked.lock_ref == 1 and locked.parent.lock_ref == 1
    assert (cache.protected_size(), cache.evictable_size(), cache.total_size()) == (4, 5, 9)

    assert cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 5
    assert radix_match(cache, [1, 2, 3, 4])[0] == 4
    assert radix_match(cache, [1, 2, 5, 6])[0] == 2
    assert radix_match(cache, [7, 8, 9])[0] == 0
    assert (cache.total_size(), allocator.available_size()) == (4, 64 - 4)

    assert cache.dec_lock_ref(locked).delta == 4
    assert (cache.protected_size(), cache.evictable_size()) == (0, 4)
    assert cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 4
    assert cache.total_size() == 0
    assert allocator.available_size() == 64


def test_evict_drops_least_recently_used_leaves_whole() -> None:
    """Eviction pops unlocked leaves in LRU order and frees whole leaves, so it may free more
    tokens than asked; a parent left childless becomes a candidate in turn."""
    cache, allocator = make_radix_cache()
    radix_insert(cache, allocator, [1, 2, 3])
    radix_insert(cache, allocator, [4, 5, 6])
    radix_insert(cache, allocator, [7, 8, 9, 10, 11])
    radix_match(cache, [1, 2, 3])  # touch: [4, 5, 6] is now the least recently used

    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 3
    assert radix_match(cache, [4, 5, 6])[0] == 0
    assert radix_match(cache, [1, 2, 3])[0] == 3
    assert allocator.available_size() == 64 - 8

    # [7..11] is the LRU now; asking for 6 tokens takes it (5) and then [1, 2, 3].
    assert cache.evict(EvictParams(num_tokens=6)).num_tokens_evicted == 8
    assert cache.total_size() == cache.evictable_size() == 0

    radix_insert(cache, allocator, [1, 2, 3, 4])
    radix_insert(cache, allocator, [1, 2, 5, 6])
    # Both leaves (2 + 2) go first, then their parent [1, 2] once it is a leaf.
    assert cache.evict(EvictParams(num_tokens=5)).num_tokens_evicted == 6
    assert cache.total_size() == 0
    assert allocator.available_size() == 64


# --------------------------------------------------------------------------- stateful model

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=8)
POOL_SIZE = 256  # > 20 steps x 12 tokens: inserts never run the pool dry


class RadixCacheMachine(RuleBasedStateMachine):
    """Random insert / match / lock / unlock / evict against a plain-Python model.

    The model maps every cached prefix to the KV index of its last token. Inserts and matches
    are predicted exactly. Eviction depends on LRU order and node boundaries, so it is checked
    by its invariants (it only removes, removes no locked token, reports what it freed, frees at
    least what was asked or all that was evictable) and the model then shrinks to the result.
    """

    def __init__(self) -> None:
        super().__init__()
        self.cache, self.allocator = make_radix_cache(POOL_SIZE)
        self.model: dict[tuple[int, ...], int] = {}
        self.inserted: list[tuple[int, ...]] = []
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []

    def cached_prefix_len(self, tokens: list[int] | tuple[int, ...]) -> int:
        """The model's hit length for ``tokens``."""
        length = 0
        while length < len(tokens) and tuple(tokens[: length + 1]) in self.model:
            length += 1
        return length

    def draw_tokens(self, data: st.DataObject) -> list[int]:
        """Half the time a random sequence; otherwise an inserted one cut at a random point with
        a random tail, so that hits, partial hits and splits are common."""
        if self.inserted and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(self.inserted))
            cut = data.draw(st.integers(0, len(base)))
            tail = data.draw(st.lists(st.integers(0, 3), min_size=0 if cut else 1, max_size=4))
            return list(base[:cut]) + tail
        return data.draw(TOKENS)

    def protected_tokens(self) -> set[tuple[int, ...]]:
        """Every prefix on the path of a held lock."""
        return {prefix[:i] for _, prefix in self.locks for i in range(1, len(prefix) + 1)}

    @initialize(data=st.data())
    def seed(self, data: st.DataObject) -> None:
        """Start from a few sequences, most sharing a prefix with an earlier one."""
        for _ in range(data.draw(st.integers(1, 4))):
            self.insert(data)

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        """Insert: the returned prefix is the model's hit; new tokens get the new slots."""
        tokens = self.draw_tokens(data)
        expected = self.cached_prefix_len(tokens)
        prefix_len, slots = radix_insert(self.cache, self.allocator, tokens)
        assert prefix_len == expected
        for i in range(expected, len(tokens)):
            self.model[tuple(tokens[: i + 1])] = int(slots[i])
        self.inserted.append(tuple(tokens))

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        """Match: the hit is the model's longest cached prefix with the model's indices."""
        tokens = self.draw_tokens(data)
        length, _, indices = radix_match(self.cache, tokens)
        assert length == self.cached_prefix_len(tokens)
        assert indices == [self.model[tuple(tokens[: i + 1])] for i in range(length)]

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        """Lock the cached prefix of a sequence, as a running request does."""
        tokens = self.draw_tokens(data)
        length, node, _ = radix_match(self.cache, tokens)
        self.cache.inc_lock_ref(node)
        self.locks.append((node, tuple(tokens[:length])))

    @rule(index=st.integers(0, 63))
    def unlock(self, index: int) -> None:
        """Release one held lock, if any."""
        if self.locks:
            node, _ = self.locks.pop(index % len(self.locks))
            self.cache.dec_lock_ref(node)

    @precondition(lambda self: self.cache.evictable_size() > 0)
    @rule(num_tokens=st.integers(1, 12))
    def evict(self, num_tokens: int) -> None:
        """Evict: check the invariants, then shrink the model to what is left."""
        evictable = self.cache.evictable_size()
        available = self.allocator.available_size()
        evicted = self.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted
        after = radix_contents(self.cache)

        assert min(num_tokens, evictable) <= evicted <= evictable
        assert after.items() <= self.model.items()  # only removes; values untouched
        assert len(self.model) - len(after) == evicted
        assert self.protected_tokens() <= after.keys()
        assert self.allocator.available_size() == available + evicted
        self.model = after

    @invariant()
    def tree_matches_model(self) -> None:
        """The tree holds exactly the model's prefixes, with the model's indices."""
        assert radix_contents(self.cache) == self.model

    @invariant()
    def sizes_are_consistent(self) -> None:
        """total = evictable + protected = model size; protected = the locked paths; no slot
        leaks."""
        total = self.cache.total_size()
        assert total == len(self.model)
        assert total == self.cache.evictable_size() + self.cache.protected_size()
        assert self.cache.protected_size() == len(self.protected_tokens())
        assert self.allocator.available_size() + total == POOL_SIZE


RadixCacheMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=20,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixCacheAgainstModel = RadixCacheMachine.TestCase


# --------------------------------------------------------------------------- UnifiedRadixCache


class TierTrackingFullComponent(FullComponent):
    """A FULL component carrying a per-token ``vc_tier`` list in its metadata: it splits the list
    with the node and records the metadata of every node it evicts (VeriCache's hook points)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.evicted_metadata: list[dict[str, Any]] = []

    def redistribute_on_node_split(
        self, new_parent: UnifiedTreeNode, child: UnifiedTreeNode
    ) -> None:
        """Split values as SGLang does, then split ``vc_tier`` at the same point."""
        super().redistribute_on_node_split(new_parent, child)
        child_metadata = child.component_data[self.component_type].metadata
        tiers = child_metadata.get("vc_tier")
        if tiers is not None:
            split = len(new_parent.key)
            new_parent.component_data[self.component_type].metadata["vc_tier"] = tiers[:split]
            child_metadata["vc_tier"] = tiers[split:]

    def evict_component(
        self,
        node: UnifiedTreeNode,
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[Any],
        target: EvictLayer = EvictLayer.DEVICE,
    ) -> tuple[int, int]:
        """Record the node's metadata, then evict as SGLang does."""
        self.evicted_metadata.append(dict(node.component_data[self.component_type].metadata))
        return super().evict_component(node, device_frees, host_frees, cache_actions, target)


def build_unified_cache(
    allocator_size: int = 64, **params: Any
) -> tuple[UnifiedRadixCache, TokenToKVPoolAllocator]:
    """Build the cache with SGLang's own factory for a plain (non-hybrid) model, as the scheduler
    does. Must run inside a published runtime context."""
    req_to_token_pool, allocator = make_pools(allocator_size)
    init_params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=1,
        **params,
    )
    build_context = TreeCacheBuildContext(
        server_args=None,  # read only when HiCache or an external linker is enabled
        params=init_params,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    cache = create_unified_radix_cache(build_context)
    assert isinstance(cache, UnifiedRadixCache)
    return cache, allocator


@pytest.fixture
def scheduler_context() -> Iterator[None]:
    """A scheduler runtime context for a CPU server, active only inside the test (the process
    configuration is left untouched)."""
    context = create_context(ServerArgs(model_path="dummy", device="cpu"), role="scheduler")
    with use_context(context):
        yield


@pytest.fixture
def unified(
    scheduler_context: None,
) -> tuple[UnifiedRadixCache, TokenToKVPoolAllocator, UnifiedTreeCore]:
    """A full-attention UnifiedRadixCache on the Python tree core (whose nodes are reachable)."""
    cache, allocator = build_unified_cache(tree_core_backend="python")
    assert isinstance(cache.tree_core, UnifiedTreeCore)
    return cache, allocator, cache.tree_core


def unified_insert(
    cache: UnifiedRadixCache, allocator: TokenToKVPoolAllocator, tokens: list[int]
) -> tuple[int, int, torch.Tensor]:
    """Insert ``tokens`` with fresh slots: (cached prefix length, last node id, slots)."""
    slots = allocator.alloc(len(tokens))
    assert slots is not None
    result = cache.insert(InsertParams(key=key(tokens), value=slots))
    return result.prefix_len, result.last_device_node, slots


def unified_match(cache: UnifiedRadixCache, tokens: list[int]) -> MatchResult:
    """Match ``tokens``; the result carries node ids, not nodes."""
    return cache.match_prefix(MatchPrefixParams(key=key(tokens)))


def test_factory_builds_a_full_only_unified_cache(
    unified: tuple[UnifiedRadixCache, TokenToKVPoolAllocator, UnifiedTreeCore],
) -> None:
    """For a model without SWA or Mamba layers the factory builds a FULL-only unified tree."""
    cache, _, tree = unified
    assert cache.tree_components == (FULL,)
    assert set(cache.components) == {FULL}
    assert cache._tree_core_backend == "python"
    root = tree.node_by_id(cache.root_node_handle())
    assert root is tree.root_node and root.parent is None


def test_default_tree_core_is_rust_and_hides_nodes(scheduler_context: None) -> None:
    """By default (SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=rust) the tree lives in Rust: the cache
    works, but no Python node or ComponentData is reachable. A custom component forces the
    Python core."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", raising=False)
        cache, allocator = build_unified_cache()
        custom, _ = build_unified_cache(
            component_registry_override={FULL: TierTrackingFullComponent}
        )
    assert cache._tree_core_backend == "rust"
    assert not isinstance(cache.tree_core, UnifiedTreeCore)
    unified_insert(cache, allocator, [1, 2, 3, 4])
    result = unified_match(cache, [1, 2, 3, 9])
    assert result.device_prefix_len == 3
    with pytest.raises(NotImplementedError, match="not yet ported to the Rust tree core"):
        cache.tree_core.node_by_id(result.last_device_node)

    assert custom._tree_core_backend == "python"
    assert isinstance(custom.tree_core, UnifiedTreeCore)


def test_unified_insert_match_lock_evict(
    unified: tuple[UnifiedRadixCache, TokenToKVPoolAllocator, UnifiedTreeCore],
) -> None:
    """The unified tree matches, splits, locks and evicts like the classic one; unlike it, insert
    itself frees the slots of the prefix the tree already held."""
    cache, allocator, tree = unified
    prefix_a, leaf_a, slots_a = unified_insert(cache, allocator, [1, 2, 3, 4, 5])
    prefix_b, _, slots_b = unified_insert(cache, allocator, [1, 2, 3, 7])
    assert (prefix_a, prefix_b) == (0, 3)
    assert allocator.available_size() == 64 - 6  # insert freed slots_b[:3] itself
    assert cache.total_size() == (6, 0)  # (full tokens, auxiliary-component tokens)
    assert cache.evictable_size() == 6

    result = unified_match(cache, [1, 2, 3, 7, 8])
    assert (result.device_prefix_len, result.full_kv_hit_length) == (4, 4)
    assert cache.path_device_indices(result.last_device_node).tolist() == (
        slots_a[:3].tolist() + slots_b[3:].tolist()
    )
    miss = unified_match(cache, [9])
    assert (miss.device_prefix_len, miss.last_device_node) == (0, cache.root_node_handle())

    # Leaf [4, 5] hangs under the split-off [1, 2, 3].
    shared = tree.node_by_id(leaf_a).parent
    assert list(shared.key.token_ids) == [1, 2, 3]
    assert shared.component_data[FULL].value.tolist() == slots_a[:3].tolist()

    lock = cache.lock(leaf_a)
    assert tree.node_by_id(leaf_a).component_data[FULL].lock_ref == 1
    assert shared.component_data[FULL].lock_ref == 1
    assert (cache.protected_size(), cache.evictable_size()) == (5, 1)
    assert cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 1  # only [7]
    assert unified_match(cache, [1, 2, 3, 7]).device_prefix_len == 3
    assert unified_match(cache, [1, 2, 3, 4, 5]).device_prefix_len == 5

    cache.unlock(lock)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 5)
    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 2  # leaf [4, 5], whole
    assert unified_match(cache, [1, 2, 3, 4, 5]).device_prefix_len == 3
    assert cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 3
    assert cache.total_size() == (0, 0)
    assert allocator.available_size() == 64
    cache.sanity_check()


def test_unified_evicts_least_recently_used_leaf_first(
    unified: tuple[UnifiedRadixCache, TokenToKVPoolAllocator, UnifiedTreeCore],
) -> None:
    """A match refreshes recency, so the untouched sequence is evicted first."""
    cache, allocator, _ = unified
    unified_insert(cache, allocator, [1, 2, 3])
    unified_insert(cache, allocator, [4, 5, 6])
    unified_insert(cache, allocator, [7, 8])
    unified_match(cache, [1, 2, 3])

    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 3
    assert unified_match(cache, [4, 5, 6]).device_prefix_len == 0
    assert unified_match(cache, [1, 2, 3]).device_prefix_len == 3
    assert unified_match(cache, [7, 8]).device_prefix_len == 2


def test_component_data_carries_custom_metadata(
    unified: tuple[UnifiedRadixCache, TokenToKVPoolAllocator, UnifiedTreeCore],
) -> None:
    """Each node has one ComponentData per component type: device value, host value, lock refs
    and a free-form metadata dict. On a split the node keeps its id, its metadata and the
    suffix; the new prefix node gets an empty metadata dict. Eviction drops the node with its
    metadata."""
    cache, allocator, tree = unified
    _, leaf_id, slots = unified_insert(cache, allocator, [1, 2, 3, 4, 5])
    leaf = tree.node_by_id(leaf_id)
    data = leaf.component_data[FULL]
    assert data is leaf.component(FULL)
    assert data.value.tolist() == slots.tolist()
    assert (data.host_value, data.lock_ref, data.host_lock_ref, data.metadata) == (None, 0, 0, {})
    # Components the tree does not use still have an (empty) slot.
    assert leaf.component_data[ComponentType.SWA].value is None

    compressed = torch.arange(5, dtype=torch.int8)
    data.metadata["vericache"] = {"tier": "kivi:bits=4", "compressed": compressed}

    split = unified_match(cache, [1, 2, 3, 9])
    prefix_node = tree.node_by_id(split.last_device_node)
    assert prefix_node is not leaf and leaf.parent is prefix_node
    assert list(prefix_node.key.token_ids) == [1, 2, 3]
    assert prefix_node.component_data[FULL].metadata == {}
    assert prefix_node.component_data[FULL].value.tolist() == slots[:3].tolist()
    assert tree.node_by_id(leaf_id) is leaf
    assert list(leaf.key.token_ids) == [4, 5]
    assert leaf.component_data[FULL].value.tolist() == slots[3:].tolist()
    # The suffix keeps the metadata object as it was: SGLang does not slice what it cannot know.
    assert leaf.component_data[FULL].metadata["vericache"]["compressed"] is compressed

    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 2
    with pytest.raises(KeyError):
        tree.node_by_id(leaf_id)
    assert leaf not in prefix_node.children.values()
    # The detached node object is not cleared: it keeps its metadata and its device indices,
    # which are back in the allocator. Holding on to a node past eviction reads stale data.
    assert leaf.component_data[FULL].metadata["vericache"]["compressed"] is compressed
    assert leaf.component_data[FULL].value.tolist() == slots[3:].tolist()
    assert allocator.available_size() == 64 - 3


def test_custom_full_component_follows_splits_and_evictions(scheduler_context: None) -> None:
    """A FULL subclass passed as component_registry_override sees every split and eviction: the
    hook where VeriCache keeps a compressed tier aligned with the tree."""
    cache, allocator = build_unified_cache(
        component_registry_override={FULL: TierTrackingFullComponent}
    )
    component = cache.components[FULL]
    assert isinstance(component, TierTrackingFullComponent)
    tree = cache.tree_core
    assert isinstance(tree, UnifiedTreeCore)

    _, leaf_id, _ = unified_insert(cache, allocator, [1, 2, 3, 4, 5, 6])
    leaf = tree.node_by_id(leaf_id)
    leaf.component_data[FULL].metadata["vc_tier"] = ["c", "c", "c", "f", "f", "f"]

    prefix_len, branch_id, _ = unified_insert(cache, allocator, [1, 2, 3, 4, 9])
    assert prefix_len == 4
    shared = tree.node_by_id(branch_id).parent
    assert shared is leaf.parent
    assert shared.component_data[FULL].metadata["vc_tier"] == ["c", "c", "c", "f"]
    assert leaf.component_data[FULL].metadata["vc_tier"] == ["f", "f"]
    assert tree.node_by_id(branch_id).component_data[FULL].metadata == {}

    unified_match(cache, [1, 2, 3, 4, 9])  # [5, 6] is now the least recently used leaf
    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 2
    assert component.evicted_metadata == [{"vc_tier": ["f", "f"]}]
    assert cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 5
    assert component.evicted_metadata[1:] == [{}, {"vc_tier": ["c", "c", "c", "f"]}]
    assert allocator.available_size() == 64
