"""Read a stored prefix, or recompute it: whichever this server measures to finish first.

CacheGen's rule for a prefix behind a link: reading k pages costs k times what reading one
takes (transfer, then decoding the stream), recomputing them costs their prefill. With
`--vericache-store-reads auto` the server keeps both rates as it measures them (seconds per
token of the pages its store reads, seconds per token of the prefills its worker runs), and
once both are known the store reports no hit for a prefix whose pages would take longer to read
than to prefill: SGLang then prefills it, the output is the same (a prefill is what a miss
gets), and the declined pages are counted (`vericache:store_reads_declined`). Until both rates
are known it reads, which measures. `always` (the default) reads every stored page.

A declined prefix measures nothing about the link, so a link that got faster would never be
used again: every `PROBE_EVERY`-th lookup that would be declined is read instead (a probe,
counted), and its reads replace the read rate, so the choice after a probe follows the link as
it is now.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

DECAY = 0.7
"""Weight the running sums keep at each new measurement (older ones fade)."""

PROBE_EVERY = 16
"""One in this many lookups the rates would decline is read, to measure the link again: while
it stays slow, about 1/16 of the stored prefixes pay its read time instead of their prefill."""


class Rate:
    """Seconds per token over recent measurements, weighted by their tokens: a long prefill
    counts for more than a short one (whose fixed costs would overstate the rate)."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._tokens = 0.0

    @property
    def seconds_per_token(self) -> float | None:
        return self._seconds / self._tokens if self._tokens else None

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._seconds = DECAY * self._seconds + seconds
        self._tokens = DECAY * self._tokens + tokens


class ReadOrRecompute:
    """A server's measured read and prefill rates, and the choice they make (one per server,
    in its `StoreState`). `enabled`: `--vericache-store-reads auto` (the store sets it from its
    server's flags)."""

    def __init__(self, enabled: bool = False, probe_every: int = PROBE_EVERY) -> None:
        if probe_every < 1:
            raise ValueError(f"probe_every must be at least 1, got {probe_every}")
        self._lock = threading.Lock()
        self.enabled = enabled
        self.probe_every = probe_every
        self.read = Rate()
        self.prefill = Rate()
        self.declined_pages = 0
        self.probes = 0
        """Lookups read although the rates declined them, to measure the link again."""
        self._slower = 0
        """Lookups in a row that the rates would decline (probes included)."""
        self._probing = False
        """A probe was let through: the next read starts the read rate afresh."""

    def record_read(self, tokens: int, seconds: float) -> None:
        """A page of `tokens` read from the store (transfer and decode) in `seconds`."""
        with self._lock:
            if self._probing:
                self._probing = False
                self.read = Rate()
            self.read.add(tokens, seconds)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill forward of `tokens` new tokens took `seconds`."""
        with self._lock:
            self.prefill.add(tokens, seconds)

    def pages_to_read(self, hits: int) -> int:
        """Of `hits` consecutive stored pages, how many to read: all, or none when both rates
        are known and reading is the slower, bar every `probe_every`-th such lookup (a
        probe: all, read to measure again)."""
        if not self.enabled or hits == 0:
            return hits
        with self._lock:
            read, prefill = self.read.seconds_per_token, self.prefill.seconds_per_token
            if read is None or prefill is None or read <= prefill:
                if self._slower:
                    logger.info("VeriCache store: reading stored pages again: reading "
                                "measured %.2f ms per token, prefill %.2f ms "
                                "(--vericache-store-reads auto)", 1e3 * read, 1e3 * prefill)
                self._slower = 0
                return hits
            self._slower += 1
            if self._slower % self.probe_every == 0:
                self.probes += 1
                self._probing = True
                return hits
            self.declined_pages += hits
            if self._slower == 1:
                logger.info("VeriCache store: %d stored pages recomputed instead of read: "
                            "reading measured %.2f ms per token, prefill %.2f ms "
                            "(--vericache-store-reads auto; counted in "
                            "vericache:store_reads_declined; one lookup in %d is read to "
                            "measure the link again)", hits, 1e3 * read, 1e3 * prefill,
                            self.probe_every)
            return 0

    def snapshot(self) -> dict[str, float | int | None]:
        with self._lock:
            return {"enabled": self.enabled, "declined_pages": self.declined_pages,
                    "probes": self.probes,
                    "read_seconds_per_token": self.read.seconds_per_token,
                    "prefill_seconds_per_token": self.prefill.seconds_per_token}
