"""Reading a Mooncake object in ranges that each fit the store's read lease, however slow the
link.

Mooncake leases an object when a client looks it up and fails a `get` whose data crossed after
the lease ran out (`LEASE_EXPIRED`, the master's `--default_kv_lease_ttl`, 10 s by default):
on a slow link a whole page never arrives, and a lease raised to fit it keeps evicted pages
pinned for as long. `LeasedReader.get` reads an object with `get_into_ranges`, one lookup
(one lease) per range, each range sized from the link's measured rate (`link.LinkMeter`) to
cross in `RANGE_SECONDS` while the reads in flight share the link, into a registered buffer
of the reading thread. A stream's digest covers all its ranges (`codec/stream.py`), so an
object replaced between two ranges is a corrupt stream, never wrong KV.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from .link import LinkMeter

logger = logging.getLogger(__name__)

RANGE_SECONDS = 1.0
"""How long one range may take to cross: a tenth of Mooncake's default lease."""

FIRST_RANGE_BYTES = 1 << 20
"""A range before the link has been measured: 8 s to cross at 1 Mbit/s."""

MIN_RANGE_BYTES = 256 << 10
"""The smallest range: below it the lookup, not the link, sets the pace."""


class LeasedReader:
    """`get(name)` of one Mooncake client, in lease-sized ranges (see the module docstring);
    `sharing` reads run at once and share the link."""

    def __init__(self, client: Any, meter: LinkMeter, sharing: int = 1) -> None:
        self._client = client
        self._meter = meter
        self._sharing = max(1, sharing)
        self._local = threading.local()
        self._lock = threading.Lock()
        self.ranges = 0
        """Ranges read so far (each one lookup, one lease)."""

    def range_bytes(self) -> int:
        """The next range's size: this reader's share of the measured rate for
        `RANGE_SECONDS`."""
        rate = self._meter.bytes_per_second()
        if rate is None:
            return FIRST_RANGE_BYTES
        return max(MIN_RANGE_BYTES, int(rate * RANGE_SECONDS / self._sharing))

    def get(self, name: str) -> bytes | None:
        """Object `name`'s bytes; None when the store has no such object, a range fails or
        no buffer can be registered (a miss, as a failed `get` is)."""
        size = self._client.get_size(name)
        if size <= 0:
            return None
        buffer = self._buffer(size)
        if buffer is None:
            return None
        address, done = buffer.data_ptr(), 0
        while done < size:
            length = min(self.range_bytes(), size - done)
            began = time.perf_counter()
            got = self._client.get_into_ranges([address], [[name]], [[[done]]], [[[done]]],
                                               [[[length]]])[0][0][0]
            if got != length:  # a negative code: missing now, or the store is gone
                return None
            self._meter.record(began, time.perf_counter(), length)
            with self._lock:
                self.ranges += 1
            done += length
        return buffer[:size].numpy().tobytes()

    def _buffer(self, size: int) -> torch.Tensor | None:
        """The calling thread's registered buffer, grown to `size` bytes (None: the store
        refused to register it, logged)."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is not None and buffer.numel() >= size:
            return buffer
        if buffer is not None:
            self._client.unregister_buffer(buffer.data_ptr())
        buffer = torch.empty(size, dtype=torch.uint8)
        code = self._client.register_buffer(buffer.data_ptr(), size)
        if code != 0:
            self._local.buffer = None
            logger.warning("VeriCache store: Mooncake refused to register a %d-byte read "
                           "buffer (%d); the page is a miss", size, code)
            return None
        self._local.buffer = buffer
        return buffer
