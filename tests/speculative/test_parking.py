"""A prefill whose stored prefix is still arriving waits beside the running batch
(`speculative/parking.py`): when it parks, what runs between the running batch's steps, and
when it runs. Its registry is a real `PendingExact`; the scheduler path is
tests/stores/test_mooncake_vericache.py's server B."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from tests.support.host_pools import SMALL_PAGE, page_slots, small_host_pool, small_page
from vericache_sglang.speculative.parking import Parking
from vericache_sglang.stores.pending import PendingExact, Settled

CONTEXT = torch.arange(96, 120)
"""The parked prefill's prefix slots: they hold the page loaded at `page_slots(100)`."""


class _Drafting:
    """What parking asks of an `EarlyDrafting`: steps, until done."""

    def __init__(self, wanted: int) -> None:
        self.steps, self.wanted = 0, wanted

    @property
    def done(self) -> bool:
        return self.steps >= self.wanted

    def step(self) -> None:
        self.steps += 1


@pytest.fixture
def world():
    registry = PendingExact()
    registry.attach(small_host_pool(), lambda flat: flat.reshape(2, 1, SMALL_PAGE, 1, 1),
                    deadline=30.0)
    exact: Future = Future()
    registry.expect("a", 8, exact)
    registry.loaded(["a"], page_slots(100), SMALL_PAGE)
    writes: list[Settled] = []
    draftings: list[_Drafting] = []

    def new_drafting(batch) -> _Drafting:
        draftings.append(_Drafting(wanted=2))
        return draftings[-1]

    def drafting_goes_on(context: torch.Tensor) -> bool:  # as the worker's
        writes.append(registry.settle(context=context, block=False, failures=False))
        return registry.arriving_in(context)

    parking = Parking(context_of=lambda batch: batch.context, may_draft=lambda batch: True,
                      new_drafting=new_drafting, drafting_goes_on=drafting_goes_on,
                      pending=registry)
    return SimpleNamespace(registry=registry, exact=exact, parking=parking, writes=writes,
                           draftings=draftings, batch=SimpleNamespace(context=CONTEXT))


def test_a_prefill_over_an_arriving_page_parks_and_drafts_between_steps(world):
    parking = world.parking
    assert not parking.park(SimpleNamespace(context=torch.arange(0, 50)))  # reads no page
    assert parking.park(world.batch)
    assert parking.take(nothing_runs=False) is None  # still arriving
    for _ in range(3):
        parking.between_rounds()
    drafting, = world.draftings
    assert drafting.steps == 2  # then done: no step past what the batch may verify
    assert parking.totals["prefills_parked"] == 1 and parking.totals["parked_draft_steps"] == 2
    world.exact.set_result((small_page(7.0), None))
    parking.between_rounds()  # writes the page that arrived
    (slots, _), = world.writes[-1].writes
    assert slots.tolist() == page_slots(100).tolist()
    assert parking.take(nothing_runs=False) is world.batch
    assert parking.parked is None
    assert parking.claim(SimpleNamespace()) is None  # another batch: not its drafting
    assert parking.claim(world.batch) is None  # claimed once only


def test_the_parked_prefill_takes_its_drafting_to_its_forward(world):
    parking = world.parking
    parking.park(world.batch)
    parking.between_rounds()
    world.exact.set_result((small_page(7.0), None))
    assert parking.take(nothing_runs=False) is world.batch
    assert parking.claim(world.batch) is world.draftings[0]


def test_it_runs_at_once_when_nothing_else_runs(world):
    parking = world.parking
    parking.park(world.batch)
    assert parking.take(nothing_runs=True) is world.batch
    assert world.registry.arriving_in(CONTEXT)  # its forward's barrier waits for the rest


def test_past_the_deadline_its_pages_count_as_failed(world):
    parking, registry = world.parking, world.registry
    registry.deadline = 0.0
    parking.park(world.batch)
    assert parking.take(nothing_runs=False) is world.batch
    assert registry.timed_out == 1 and not registry.arriving_in(CONTEXT)
    assert registry.waiting_in(CONTEXT)  # failed: its forward recomputes the page
    settled = registry.settle(context=CONTEXT, block=False)
    assert list(settled.failed.values())[0].tolist() == page_slots(100).tolist()
