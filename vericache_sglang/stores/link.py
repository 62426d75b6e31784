"""The store link's bandwidth, measured on the objects received, and the lossy level each page
of an early-drafting read is fetched at (CacheGen's adaptation of quality to the link).

With `--vericache-early-drafting` a Mooncake read answers SGLang's prefetch once every page of
the batch has a drafting level in (`stores/mooncake.py`). A page's stream is stored as a coarse
object (the header and the first lossy level), a refinement object (the finer levels up to the
compressed pool's) and the exact object. Once a page's coarse object has arrived, its read also
fetches the refinement only if, at the bandwidth measured so far, that refinement and the
coarse objects of the batch's pages still to come arrive within `--vericache-drafting-deadline`
of the batch's start (`DraftingPlan.refine`). Otherwise the page drafts on the coarse level,
lifted to the pool's bits, and its refinement comes with its exact part: the pool-level codes
then replace the coarse ones in the compressed pool while drafting goes on (`pending.py`). A
fast link drafts on the pool's own pages; a slow one starts drafting sooner on coarser ones.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)


class LinkMeter:
    """Bytes per second over the store's link: the bytes of the last `window` reads received
    (objects, or the lease-sized ranges `leased_reads.py` reads them in), over the time at
    least one of them was in flight. Reads side by side share the link, so their union, not
    their sum, is the link's busy time."""

    def __init__(self, window: int = 32) -> None:
        self._lock = threading.Lock()
        self._gets: deque[tuple[float, float, int]] = deque(maxlen=window)

    def record(self, began: float, ended: float, nbytes: int) -> None:
        with self._lock:
            self._gets.append((began, ended, nbytes))

    def bytes_per_second(self) -> float | None:
        """The measured rate; None before any object arrived."""
        with self._lock:
            gets = sorted(self._gets)
        if not gets:
            return None
        busy, (start, end, _) = 0.0, gets[0]
        for began, ended, _ in gets[1:]:
            if began > end:
                busy += end - start
                start, end = began, ended
            else:
                end = max(end, ended)
        busy += end - start
        return sum(n for *_, n in gets) / busy if busy > 0 else None

    def mbit(self) -> float:
        """The measured rate in Mbit/s (0 before any object arrived)."""
        rate = self.bytes_per_second()
        return 0.0 if rate is None else rate * 8 / 1e6


class DraftingPlan:
    """One batch's drafting reads against the deadline (see the module docstring)."""

    def __init__(self, pages: int, deadline: float, meter: LinkMeter,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._lock = threading.Lock()
        self._meter = meter
        self._deadline = deadline
        self._clock = clock
        self._began = clock()
        self._to_come = pages
        """Pages whose coarse object has not arrived."""
        self.pool_pages = self.coarse_pages = 0

    def refine(self, coarse_bytes: int, refinement_bytes: int) -> bool:
        """A page's coarse object (`coarse_bytes`) arrived: whether its refinement
        (`refinement_bytes`; 0: the stream has one lossy level) is fetched now, before the
        page answers."""
        with self._lock:
            self._to_come -= 1
            if not refinement_bytes:
                self.pool_pages += 1
                return False
            rate = self._meter.bytes_per_second()
            left = self._deadline - (self._clock() - self._began)
            need = refinement_bytes + self._to_come * coarse_bytes
            fetch = rate is not None and need / rate <= left
            if fetch:
                self.pool_pages += 1
            else:
                self.coarse_pages += 1
            return fetch

    def report(self) -> str:
        """The batch's choice, for the log."""
        return (f"drafting level of {self.pool_pages + self.coarse_pages} pages: "
                f"{self.pool_pages} at the pool's bits, {self.coarse_pages} coarse, in "
                f"{self._clock() - self._began:.2f} s (deadline {self._deadline:g} s); "
                f"link {self._meter.mbit():.0f} Mbit/s "
                "measured")
