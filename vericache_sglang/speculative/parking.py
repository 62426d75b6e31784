"""A prefill whose stored prefix is still arriving waits beside the running batch, drafting
between its rounds, instead of holding it (`--vericache-early-drafting`).

SGLang's scheduler runs one batch at a time. A prefill over a prefix whose exact KV is still on
its way from the store would hold every running request while it drafts over the compressed
tier and waits (the barrier, `early.py`). Instead, when SGLang builds such a prefill while other
requests run, the hook on `Scheduler.get_new_batch_prefill` parks it: the running batch goes on
decoding, and after each of its steps the worker writes the exact pages that arrived and runs
one drafting step of the parked batch (through a draft backend of its own, whose scratch tail
survives the rounds in between). The parked prefill runs as soon as no page of its prefix is
still arriving (failed pages are recomputed by its forward), its wait passes
`--vericache-store-timeout` (the rest count as failed), or nothing else runs (its drafting then
goes on at the barrier, holding nobody). So a running request never waits on the store: its
steps take one drafting step longer at most.

While a prefill is parked SGLang builds no other, so requests keep their order. A parked batch
holds its request slots, KV slots and its prefix's locks as any built batch does; the hook on
`Scheduler._collect_inflight_batches` lets an abort reach its requests, which finish after its
forward. A batch with a chunked request is never parked (SGLang caches a chunk's KV at the
next step, as if it had run).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.managers.schedule_batch import NextBatchPlan
from sglang.srt.plugins.hook_registry import HookType

from vericache_sglang.integration.hooks import hook
from vericache_sglang.speculative.early import EarlyDrafting
from vericache_sglang.stores.pending import PendingExact

PREFILL_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
INFLIGHT_TARGET = "sglang.srt.managers.scheduler.Scheduler._collect_inflight_batches"


@dataclass
class ParkedPrefill:
    batch: Any
    context: torch.Tensor
    """The device slots its forward reads as exact KV (`VeriCacheWorker._context`)."""
    since: float
    may_draft: bool
    drafting: EarlyDrafting | None = None


@dataclass
class Parking:
    """The worker's parked prefill, if any, and what parking did (`/server_info`)."""

    context_of: Callable[[Any], torch.Tensor | None]
    may_draft: Callable[[Any], bool]
    new_drafting: Callable[[Any], EarlyDrafting]
    drafting_goes_on: Callable[[torch.Tensor], bool]
    """Writes the pages of a context that arrived; whether any is still arriving."""
    pending: PendingExact
    """The server's pages waiting for their exact KV (its `StoreState`)."""
    parked: ParkedPrefill | None = None
    _taken: ParkedPrefill | None = None
    totals: dict[str, float] = field(default_factory=lambda: {
        "prefills_parked": 0, "parked_seconds": 0.0, "parked_draft_steps": 0})

    def park(self, batch) -> bool:
        """Park `batch` if a page of its prefix is still arriving."""
        context = self.context_of(batch)
        if context is None or not self.pending.arriving_in(context):
            return False
        self.parked = ParkedPrefill(batch, context, time.perf_counter(), self.may_draft(batch))
        self.totals["prefills_parked"] += 1
        return True

    def between_rounds(self) -> None:
        """After a step of the running batch: write the parked prefix's pages that arrived
        (pool-level codes replace coarse ones, so later drafts read them) and draft one
        step."""
        parked = self.parked
        if parked is None or not self.drafting_goes_on(parked.context) or not parked.may_draft:
            return
        if parked.drafting is None:
            parked.drafting = self.new_drafting(parked.batch)
        if not parked.drafting.done:
            parked.drafting.step()
            self.totals["parked_draft_steps"] += 1

    def take(self, nothing_runs: bool) -> Any | None:
        """The parked batch, once it may run (see the module docstring); None meanwhile."""
        parked = self.parked
        if parked is None:
            return None
        waited = time.perf_counter() - parked.since
        if not nothing_runs and self.pending.arriving_in(parked.context):
            if waited <= self.pending.deadline:
                return None
            self.pending.expire(parked.context)
        self.totals["parked_seconds"] += waited
        self.parked, self._taken = None, parked
        return parked.batch

    def claim(self, batch) -> EarlyDrafting | None:
        """The drafting `batch` began while parked (its forward goes on from there)."""
        taken, self._taken = self._taken, None
        return taken.drafting if taken is not None and taken.batch is batch else None


def _parking(scheduler) -> Parking | None:
    return getattr(scheduler.draft_worker, "parking", None)


def _prefill_or_park(original, scheduler, running_batch) -> NextBatchPlan:
    """AROUND `PREFILL_TARGET`: hand back the parked prefill once it may run (no other
    prefill is built meanwhile), and park a new prefill whose prefix is still arriving while
    other requests run."""
    parking = _parking(scheduler)
    if parking is None:
        return original(scheduler, running_batch)
    if parking.parked is not None:
        batch = parking.take(running_batch.is_empty())
        return NextBatchPlan(batch_to_run=batch, running_batch=running_batch)
    plan = original(scheduler, running_batch)
    batch = plan.batch_to_run
    if (batch is not None and batch.forward_mode.is_extend() and scheduler.chunked_req is None
            and not plan.running_batch.is_empty() and parking.park(batch)):
        return NextBatchPlan(batch_to_run=None, running_batch=plan.running_batch)
    return plan


def _with_parked(original, scheduler) -> list:
    """AROUND `INFLIGHT_TARGET`: the parked batch is in flight (an abort finds its
    requests)."""
    batches = original(scheduler)
    parking = _parking(scheduler)
    if parking is not None and parking.parked is not None:
        batches = [*batches, parking.parked.batch]
    return batches


def register() -> None:
    hook(PREFILL_TARGET, _prefill_or_park, HookType.AROUND)
    hook(INFLIGHT_TARGET, _with_parked, HookType.AROUND)
