"""Pages answered on their drafting level, whose exact KV comes behind (`stores/pending.py`),
the drafting levels' decode (`PageCoder.decode_page(drafting=True)`), the level chosen by the
link (`stores/link.py`) and the stash of early drafts (`speculative/early.py`). The server path
is tests/stores/test_mooncake_vericache.py's server B."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from tests.support.host_pools import (
    SMALL_PAGE,
    HostPool,
    flat_page,
    page_slots,
    small_host_pool,
    small_page,
)
from vericache_sglang.codec import StreamError, decode_chunk
from vericache_sglang.speculative.early import Stash, can_draft_early
from vericache_sglang.stores.link import DraftingPlan, LinkMeter
from vericache_sglang.stores.pages import PageCoder
from vericache_sglang.stores.pending import PendingExact, check_early_drafting


@pytest.fixture
def pending() -> tuple[PendingExact, HostPool]:
    registry, host = PendingExact(), small_host_pool()
    registry.attach(host, lambda flat: flat.reshape(2, 1, SMALL_PAGE, 1, 1), deadline=30.0)
    return registry, host


def test_a_device_page_waits_for_its_exact_kv_and_is_written_host_first(pending) -> None:
    registry, host = pending
    exact: Future = Future()
    registry.expect("a", 8, exact)
    registry.loaded(["a"], page_slots(100), SMALL_PAGE)
    context = torch.arange(96, 120)  # a prefill whose prefix holds the page
    assert registry.waiting_in(context) and registry.arriving_in(context)
    assert not registry.settle(context=context, block=False).writes and not host.written
    result: list = []
    barrier = threading.Thread(
        target=lambda: result.append(registry.settle(context=context, block=True)))
    barrier.start()
    barrier.join(0.5)
    assert barrier.is_alive() and not host.written  # the barrier waits for the exact KV
    exact.set_result((small_page(7.0), None))
    barrier.join()
    settled, = result
    assert host.written[0][0] == 8 and torch.equal(host.written[0][1], small_page(7.0))
    (slots, kv), = settled.writes
    assert slots.tolist() == page_slots(100).tolist() and kv.shape == (2, 1, SMALL_PAGE, 1, 1)
    assert not settled.codes  # answered on the pool level: nothing to refine
    assert not registry.waiting_in() and registry.snapshot()["waiting_pages"] == 0


def test_a_forward_that_reads_no_waiting_page_never_waits(pending) -> None:
    """Another request's prefill (its prefix elsewhere) or a decode (no context) runs while
    a page's exact KV is on its way; the page is written once it arrives."""
    registry, host = pending
    exact: Future = Future()
    registry.expect("a", 8, exact)
    registry.loaded(["a"], page_slots(100), SMALL_PAGE)
    elsewhere = torch.arange(0, 64)
    assert not registry.waiting_in(elsewhere) and registry.waiting_in()
    for context in (elsewhere, None):
        settled = registry.settle(context=context, block=True)
        assert not settled.writes and not settled.failed and settled.waited_seconds == 0
    exact.set_result((small_page(5.0), None))
    (slots, _), = registry.settle(context=None, block=False).writes
    assert slots.tolist() == page_slots(100).tolist() and host.written[0][0] == 8


def test_an_exact_part_past_the_deadline_counts_as_failed(pending) -> None:
    registry, host = pending
    registry.deadline = 0.05
    registry.expect("a", 8, Future())  # never answered: a store that stopped responding
    registry.loaded(["a"], page_slots(40), SMALL_PAGE)
    settled = registry.settle(context=page_slots(40), block=True)
    assert [s.tolist() for s in settled.failed.values()] == [page_slots(40).tolist()]
    assert registry.snapshot()["exact_timed_out"] == 1 and not host.written


def _heal(registry: PendingExact, recomputed: torch.Tensor, failed: dict) -> None:
    """The worker's heal after recomputing `recomputed`: each slot's KV is its index."""
    registry.heal(recomputed, failed, lambda slots: slots.float().reshape(1, 1, -1, 1, 1)
                  .expand(2, 1, -1, 1, 1))


def test_a_failed_exact_part_comes_back_for_recompute_wherever_it_is_loaded(pending) -> None:
    registry, host = pending
    exact: Future = Future()
    registry.expect("a", 8, exact)
    exact.set_exception(StreamError("the store has no exact object"))
    # Only on the host: it stays, poisoned, and is not written.
    assert not registry.settle(context=None, block=False).failed and not host.written
    registry.loaded(["a"], page_slots(40), SMALL_PAGE)
    # Failed before any settle marked it: the prefill over it must still stop for it.
    assert registry.waiting_in(page_slots(40)) and not registry.arriving_in(page_slots(40))
    # While drafting, failures wait for the barrier.
    assert not registry.settle(context=page_slots(40), block=False, failures=False).failed
    settled = registry.settle(context=page_slots(40), block=True)
    assert [s.tolist() for s in settled.failed.values()] == [page_slots(40).tolist()]
    assert not settled.writes and not host.written
    # The worker recomputed the slots: their KV heals the host page, and the page is done.
    _heal(registry, page_slots(40), settled.failed)
    (index, flat), = host.written
    assert index == 8 and flat.tolist() == [40.0, 41.0, 42.0, 43.0] * 2
    assert registry.snapshot()["waiting_pages"] == 0
    assert registry.snapshot()["recomputed_pages"] == 1


def test_a_failed_page_outside_the_forward_is_never_promoted(pending) -> None:
    """The request that loaded the page was aborted (or another batch runs) when its exact
    part fails: its lossy device and host copies stay poisoned, are never copied as exact,
    and come back for recompute in the prefill that reads them, wherever SGLang put them."""
    registry, host = pending
    exact: Future = Future()
    registry.expect("a", 8, exact)
    registry.loaded(["a"], page_slots(40), SMALL_PAGE)
    exact.set_exception(StreamError("the store has no exact object"))
    settled = registry.settle(context=torch.arange(0, 32), block=True)  # another prefill
    assert not settled.failed and not settled.writes and not host.written
    assert registry.snapshot()["failed_pages_held"] == 1
    registry.released(page_slots(40))  # SGLang evicted the device copy (the host page stays)
    assert not registry.waiting_in()
    registry.loaded(["a"], page_slots(80), SMALL_PAGE)  # a later request loads it back
    settled = registry.settle(context=torch.arange(64, 96), block=True)
    assert [s.tolist() for s in settled.failed.values()] == [page_slots(80).tolist()]
    _heal(registry, page_slots(80), settled.failed)
    assert host.written[0][1].tolist() == [80.0, 81.0, 82.0, 83.0] * 2
    assert registry.snapshot()["waiting_pages"] == 0


def test_a_page_only_partly_recomputed_stays_failed(pending) -> None:
    registry, host = pending
    exact: Future = Future()
    registry.expect("a", 8, exact)
    registry.loaded(["a"], page_slots(40), SMALL_PAGE)
    exact.set_exception(StreamError("the store has no exact object"))
    settled = registry.settle(context=page_slots(40), block=True)
    _heal(registry, page_slots(40)[:2], settled.failed)  # a prefix ending inside the page
    assert not host.written and registry.snapshot()["failed_pages_held"] == 1
    assert registry.waiting_in(page_slots(40))


def test_freed_device_slots_never_receive_a_late_exact_page(pending) -> None:
    registry, host = pending
    exact: Future = Future()
    registry.expect("a", 8, exact)
    registry.loaded(["a"], page_slots(40), SMALL_PAGE)
    registry.released(torch.arange(32, 48))  # freed, then reused for another request's KV
    exact.set_result((small_page(9.0), None))
    settled = registry.settle(context=page_slots(40), block=True)
    assert not settled.writes and host.written[0][0] == 8


def test_a_coarse_page_brings_its_pool_codes_for_the_device_slots(pending) -> None:
    registry, _ = pending
    exact: Future = Future()
    registry.expect("a", 8, exact)
    registry.loaded(["a"], page_slots(40), SMALL_PAGE)
    exact.set_result((small_page(2.0), ["pool-level codes"]))
    settled = registry.settle(context=page_slots(40), block=False, failures=False)
    (slots, codes), = settled.codes
    assert slots.tolist() == list(range(40, 40 + SMALL_PAGE)) and codes == ["pool-level codes"]


@pytest.fixture(scope="module")
def coded_page(model_kv) -> tuple[PageCoder, bytes, torch.Tensor]:
    host = HostPool("layer_first", torch.float32)
    coder = PageCoder.for_pool(host, "kivi:bits=4")
    keys, values = (t[:, 64:128].float() for t in model_kv)
    return coder, coder.encode_page(flat_page(keys, values, "layer_first"), "k"), keys


def test_the_drafting_level_decodes_the_pool_pages_lossy(coded_page) -> None:
    """The coarse and refinement parts give the pool level's reconstruction: close to the
    exact KV, not equal, and the same as dequantizing the codes the exact decode offers."""
    coder, blob, keys = coded_page
    coarse, refinement, _ = PageCoder.split(blob)
    assert PageCoder.refinement_bytes(coarse) == len(refinement) > 0
    assert PageCoder.refinement_bytes(coarse + refinement) == 0
    lossy_k, lossy_v, tiers = coder.decode_page(coarse + refinement, "k", drafting=True)
    exact_k, _, exact_tiers = coder.decode_page(blob, "k")
    assert torch.equal(exact_k, keys)
    assert not torch.equal(lossy_k, keys)
    assert (lossy_k - keys).abs().max() < 0.25 * keys.abs().max()
    for tier, exact_tier, k in zip(tiers, exact_tiers, lossy_k, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(tier.tensors(), exact_tier.tensors(),
                                                      strict=True))
        assert torch.equal(tier.dequantize(torch.float32)[0], k)
    assert len(coarse + refinement) < len(blob) / 3


def test_the_coarse_level_alone_fills_pool_pages_with_its_own_values(coded_page) -> None:
    """The coarse part decodes the first level, its codes lifted to the pool's bits: they
    dequantize to that level's values exactly, coarser than the pool level."""
    coder, blob, keys = coded_page
    coarse, refinement, _ = PageCoder.split(blob)
    coarse_k, _, tiers = coder.decode_page(coarse, "k", drafting=True)
    pool_k, _, _ = coder.decode_page(coarse + refinement, "k", drafting=True)
    level0 = decode_chunk(coarse, level=0, key=b"k")
    assert {t.bits for t in tiers} == {4} and {t.bits for t in level0.tiers} == {2, 4}
    for tier, own in zip(tiers, level0.tiers, strict=True):
        assert torch.equal(tier.dequantize(torch.float32)[0], own.dequantize(torch.float32)[0])
    assert (coarse_k - keys).abs().mean() > 1.5 * (pool_k - keys).abs().mean()
    assert len(coarse) < 0.8 * len(coarse + refinement)


def test_a_slow_link_drafts_on_the_coarse_level_a_fast_one_on_the_pool_level() -> None:
    meter = LinkMeter()
    meter.record(0.0, 1.0, 10_000_000)  # 80 Mbit/s
    assert round(meter.mbit()) == 80
    meter.record(0.5, 1.0, 10_000_000)  # fetched beside the first: the link's rate doubles
    assert round(meter.mbit()) == 160
    def still() -> float:  # no time passes while the plan decides
        return 0.0

    fast = DraftingPlan(4, deadline=10.0, meter=meter, clock=still)
    assert all(fast.refine(100_000, 60_000) for _ in range(4))
    slow = DraftingPlan(4, deadline=0.004, meter=meter, clock=still)
    # 100 kB at 20 MB/s is 5 ms: no page's refinement fits, even the last's alone.
    assert not any(slow.refine(100_000, 100_000) for _ in range(4))
    assert (slow.pool_pages, slow.coarse_pages) == (0, 4)
    # 18 ms: the first page's refinement does not fit beside the three coarse parts still to
    # come (20 ms); the later ones do (15, 10, 5 ms).
    mixed = DraftingPlan(4, deadline=0.018, meter=meter, clock=still)
    assert [mixed.refine(100_000, 100_000) for _ in range(4)] == [False, True, True, True]
    never = DraftingPlan(2, deadline=0.0, meter=meter, clock=still)
    assert not never.refine(1, 1) and not never.refine(1, 0)  # one level: the pool's
    assert (never.pool_pages, never.coarse_pages) == (1, 1)
    assert not DraftingPlan(1, 10.0, LinkMeter()).refine(1, 1)  # nothing measured yet


def test_a_stash_keeps_what_continues_the_emitted_tokens() -> None:
    stash = Stash()
    stash.keep("r", [5, 6, 7, 8, 9], first_token=5)
    assert stash.length(["r"]) == 4
    assert [t.tolist() for t in stash.take(["r"], 2, "cpu")] == [[6], [7]]
    stash.advance("r", 2, accepted=2, bonus=8)  # 6, 7 accepted, bonus 8 as drafted
    assert stash.length(["r"]) == 1
    stash.advance("r", 1, accepted=0, bonus=3)  # 9 rejected
    assert stash.length(["r"]) == 0
    stash.keep("s", [4, 6], first_token=5)  # the first draft was already wrong
    assert stash.length(["s"]) == 0


def test_a_sampled_stash_keeps_each_drafts_distribution() -> None:
    """A sampled request's stash hands verification the q each draft was drawn from, in
    step with its drafts; a greedy request beside it gets zeros."""
    stash = Stash()
    q = [torch.full((4,), float(j)) for j in range(5)]
    stash.keep("s", [1, 2, 3, 0, 2], first_token=1, probs=q)
    stash.keep("g", [3, 3, 3, 3], first_token=3)
    assert stash.length(["s", "g"]) == 3
    steps = stash.take_probs(["s", "g"], 2, vocab=4, device="cpu")
    assert [step[0, 0].item() for step in steps] == [1.0, 2.0]  # q of drafts 2 and 3
    assert all(step[1].eq(0).all() for step in steps)
    stash.advance("s", 2, accepted=2, bonus=0)  # drafts 2, 3 accepted, bonus as drafted
    assert stash.take(["s"], 1, "cpu")[0].tolist() == [2]
    assert stash.take_probs(["s"], 1, vocab=4, device="cpu")[0][0, 0].item() == 4.0
    stash.keep("s", [2, 1], first_token=3, probs=q[:2])  # a new prefill replaces it
    assert stash.length(["s"]) == 0


def test_a_stash_counts_the_storages_its_q_keep_alive() -> None:
    """The stash's bytes are its q's storages: rows viewing one tensor keep all of it alive,
    counted once."""
    stash = Stash()
    steps = [torch.rand(3, 8) for _ in range(4)]
    stash.keep("s", [1, 2, 3, 4], first_token=1, probs=[step[0] for step in steps])
    stash.keep("t", [1, 2, 3, 4], first_token=1, probs=[step[1] for step in steps])
    assert stash.nbytes() == 3 * 3 * 8 * 4  # steps 2-4, counted once for both requests
    stash.forget("s")
    assert stash.nbytes() == 3 * 3 * 8 * 4
    stash.forget("t")
    assert stash.nbytes() == 0


def _prefill(**change) -> SimpleNamespace:
    """A prefill batch as `can_draft_early` reads it: two whole prompts with a 3-token suffix,
    one of them sampled (no penalties, bias or logprobs)."""
    info = SimpleNamespace(penalizer_orchestrator=None, logit_bias=None, sampling_seed=None)
    reqs = [SimpleNamespace(extend_end=10, origin_input_ids=list(range(10)))] * 2
    return SimpleNamespace(**({"sampling_info": info, "return_logprob": False,
                               "return_hidden_states": False, "reqs": reqs,
                               "extend_lens": [3, 3]} | change))


def test_which_prefills_draft_early() -> None:
    assert can_draft_early(_prefill(), [True, True])
    assert not can_draft_early(_prefill(), [True, False])  # e.g. a custom logit processor
    assert not can_draft_early(_prefill(return_logprob=True), [True, True])
    assert not can_draft_early(_prefill(sampling_info=SimpleNamespace(
        penalizer_orchestrator=None, logit_bias=torch.zeros(2, 4), sampling_seed=None)),
        [True, True])
    assert not can_draft_early(_prefill(sampling_info=SimpleNamespace(  # seeded: they wait
        penalizer_orchestrator=None, logit_bias=None, sampling_seed=torch.zeros(2))),
        [True, True])
    assert not can_draft_early(_prefill(extend_lens=[3, 600]), [True, True])  # past MAX_SUFFIX


@pytest.mark.parametrize(("change", "needs"), [
    ({"hicache_storage_backend": "file"}, "a Mooncake store"),
    ({"page_size": 1}, "--page-size a multiple of 64"),
    ({"hicache_write_policy": "write_back"}, "write_through"),
])
def test_early_drafting_names_what_it_needs(change: dict, needs: str) -> None:
    args = {"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake",
            "page_size": 64, "hicache_write_policy": "write_through"} | change
    config = SimpleNamespace(vericache_early_drafting=True, vericache_compressor="kivi:bits=4",
                             vericache_full_tier="device")
    problem = check_early_drafting(SimpleNamespace(**args), config)
    assert problem.startswith("--vericache-early-drafting needs") and needs in problem
    assert check_early_drafting(SimpleNamespace(**(args | {
        "hicache_storage_backend": "mooncake", "page_size": 64,
        "hicache_write_policy": "write_through", "enable_hierarchical_cache": True})),
        config) is None


def test_two_answers_of_one_page_each_keep_their_host_page(pending) -> None:
    """Two prefetches of one prefix raced: SGLang keeps one host page and frees the other;
    the kept one is still written with the exact KV."""
    registry, host = pending
    first, second = Future(), Future()
    registry.expect("a", 8, first)
    registry.expect("a", 16, second)
    host.free(torch.arange(16, 16 + SMALL_PAGE))
    first.set_result((small_page(3.0), None))
    second.set_result((small_page(3.0), None))
    registry.settle(context=None, block=False)
    assert [index for index, _ in host.written] == [8]
    assert registry.snapshot()["waiting_pages"] == 0
