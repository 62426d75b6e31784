"""The worker's counts: rounds, drafts and emitted tokens for the logs, `/server_info` and
Prometheus (`--enable-metrics`), and each request's own figures in its `meta_info`."""

from __future__ import annotations

from vericache_sglang.metrics import RoundCounts, VeriCacheMetrics
from vericache_sglang.stores.state import StoreState
from vericache_sglang.tiers.staging import FetchStats


class WorkerStats:
    """Cumulative over all requests (per-request figures go to `meta_info`)."""

    def __init__(self, metrics: VeriCacheMetrics | None, store: StoreState) -> None:
        self.metrics = metrics
        self.store = store  # the server's store counts, brought to /metrics after each step
        self.totals = RoundCounts()
        # Full-tier reads of prefill forwards, and of decoding (drafting windows, pages being
        # compressed, verification).
        self.fetched = {"prefill": FetchStats(), "decode": FetchStats()}
        self.peak_round_bytes = 0
        self.peak_running_requests = 0
        self._pages_reported = 0  # pool pages compressed that /metrics already counts
        self._settling: list[bool] = []  # per request of the last step: a verified round
        # Drafting before a stored prefix's exact KV (early.py).
        self.early_prefills = self.early_drafts = 0
        self.stash_verified = self.stash_accepted = 0

    def add_early(self, drafts: int) -> None:
        """A prefill drafted `drafts` tokens before its stored prefix's exact KV."""
        self.early_prefills += 1
        self.early_drafts += drafts
        if self.metrics is not None:
            self.metrics.early_drafts.inc(drafts)

    def add_stashed(self, verified: int, accepted: int) -> None:
        """A round verified `verified` early drafts of a request and accepted `accepted`."""
        self.stash_verified += verified
        self.stash_accepted += accepted
        if self.metrics is not None:
            self.metrics.early_stash_accepted.inc(accepted)

    def early_report(self) -> dict[str, int]:
        """Prefills that drafted before their exact KV, their drafts, and how many of those
        later rounds verified and accepted."""
        return {"early_prefills": self.early_prefills, "early_drafts": self.early_drafts,
                "stash_verified": self.stash_verified, "stash_accepted": self.stash_accepted}

    def peak(self, round_bytes: int) -> None:
        """Note a round's buffer bytes."""
        self.peak_round_bytes = max(self.peak_round_bytes, round_bytes)

    def add(self, counts: RoundCounts, compressed_pages: int) -> None:
        """Add to the totals; `compressed_pages`: the pool's pages compressed so far."""
        self.totals.add(counts)
        if self.metrics is not None:
            self.metrics.record(counts,
                                pages_compressed=compressed_pages - self._pages_reported)
            self._pages_reported = compressed_pages

    def count_step(self, drafted: int, verified: list[bool], compressed_pages: int,
                   prefills_parked: int = 0) -> None:
        """Count a step's rounds, drafts and plain steps; its emitted tokens are counted as
        the scheduler settles them (`settle`). `prefills_parked`: so far (`parking.py`)."""
        self._settling = verified
        rounds = sum(verified)
        self.add(RoundCounts(verify_rounds=rounds, drafted_tokens=drafted * rounds,
                             plain_decode_steps=len(verified) - rounds), compressed_pages)
        if self.metrics is not None:
            store = self.store
            self.metrics.record_store(*store.stats.totals(), {
                "store_reads_declined": store.admission.declined_pages,
                "store_read_probes": store.admission.probes,
                "reloaded_pages_installed": store.reloaded.installed,
                "reloaded_pages_skipped": store.reloaded.skipped,
                "store_reconnect_attempts": store.reconnects.attempts,
                "store_reconnect_failures": store.reconnects.failures,
                "early_exact_failed": store.pending.poisoned,
                "early_exact_timed_out": store.pending.timed_out,
                "early_pages_recomputed": store.pending.recomputed,
                "early_prefills_parked": prefills_parked}, store.link.mbit())

    def settle(self, row: int, emitted: int, accepted: int, compressed_pages: int) -> None:
        """Count the tokens request `row` of the last step kept of its verified round."""
        if self._settling[row]:
            self.add(RoundCounts(accepted_drafts=accepted, emitted_tokens=emitted),
                     compressed_pages)

    def publish_sizes(self, held_bytes: int, pages_used: int) -> None:
        """Set the size gauges to what is held now."""
        if self.metrics is not None:
            self.metrics.set_sizes(held_bytes, pages_used=pages_used)


def add_to_meta_info(req, key: str, amount: int) -> None:
    """Add to one of the request's `meta_info` figures (request-level keys of `meta_info.py`,
    reported once, when the request finishes). A streamed response's first chunk would carry
    the figure as it stood after prefill, so streams get none."""
    if req.stream:
        return
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info.setdefault(key, [0])[0] += amount
