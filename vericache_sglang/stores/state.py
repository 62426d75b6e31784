"""One server's store state: what its storage backend measures and holds, shared with its worker.

The VeriCache worker and the storage backend meet in the scheduler process, neither built by
the other: SGLang's speculative-algorithm registry builds the worker
(`Scheduler.maybe_init_draft_worker`), then HiCache's controller builds the backend through
`StorageBackendFactory` (`kv_cache_builder.build_kv_cache`; a store unreachable at startup is
built again later, in a thread of its own: `reconnect.py`). Both reach the server's arguments:
the worker is given the record, the backend and SGLang's load-back hooks read the one SGLang
published in the process, which is the same object. So the state rides on that record, as
VeriCache's settings do (`config.CONFIG_ATTR`), made by the first to ask for it (the worker):
two servers, or two tests, never share counts, rates or pages waiting, as they would through
module globals. It is made in the scheduler process, after the record crossed from the
launcher: it holds locks, and never travels with the record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.runtime_context import get_server_args

from .admission import ReadOrRecompute
from .link import LinkMeter
from .pages import ReconnectStats, StoreStats
from .pending import PendingExact, Settled
from .reloaded import ReloadedCodes

STATE_ATTR = "_vericache_stores"
"""Where a server's store state rides on its server-args record: a bookkeeping attribute,
which ServerArgs leaves writable after resolution."""


@dataclass
class StoreState:
    """A server's store registries and counters (see the module docstring)."""

    pending: PendingExact = field(default_factory=PendingExact)
    """Pages answered on their drafting level, until their exact KV is written."""
    reloaded: ReloadedCodes = field(default_factory=ReloadedCodes)
    """Pool-level codes of pages read from the store, until they are loaded onto the device."""
    link: LinkMeter = field(default_factory=LinkMeter)
    """The store link's measured rate."""
    admission: ReadOrRecompute = field(default_factory=ReadOrRecompute)
    """Whether a stored prefix is read or recomputed."""
    stats: StoreStats = field(default_factory=StoreStats)
    """Faults, pages, bytes and codec time."""
    reconnects: ReconnectStats = field(default_factory=ReconnectStats)
    """Attempts to reach a store that was unreachable."""

    def __reduce__(self) -> tuple:
        """Pickled or copied with its server's record, it arrives empty: its registries, locks
        and counts belong to the process that made them."""
        return (StoreState, ())

    def write_settled(self, settled: Settled, kv_pool: Any,
                      device: torch.device | str) -> None:
        """Write settled pages' exact KV into their slots of the device pool `kv_pool`, and
        their pool-level codes over the coarse ones in the compressed pool."""
        if settled.writes and str(device).startswith("cuda"):
            # SGLang's host-to-device load of these pages runs on its own stream; it read
            # the host page before or after its exact KV came: write the slots after it
            # (not yet run on a GPU).
            torch.cuda.synchronize()
        for slots, kv in settled.writes:
            index = slots.to(torch.int64).to(device)
            for layer in range(kv.shape[1]):
                kv_pool.k_buffer[layer][index] = kv[0, layer].to(device)
                kv_pool.v_buffer[layer][index] = kv[1, layer].to(device)
        if self.reloaded.pool is not None:
            for slots, codes in settled.codes:
                self.pending.refined += self.reloaded.pool.install(slots, codes, replace=True)

    def report(self) -> dict[str, Any]:
        """The store's part of VeriCache's running state (`/server_info`)."""
        stats = self.stats.snapshot()
        return {"disk_faults": stats["faults"], "store_io": stats["io"],
                "store_reads": self.admission.snapshot(),
                "store_reconnects": {"attempts": self.reconnects.attempts,
                                     "failures": self.reconnects.failures},
                "reloaded_pages": self.reloaded.snapshot()}


def store_state(server_args: Any) -> StoreState:
    """The store state of the server `server_args` describes, made on first use."""
    state = getattr(server_args, STATE_ATTR, None)
    if state is None:
        state = StoreState()
        setattr(server_args, STATE_ATTR, state)
    return state


def served_store_state() -> StoreState:
    """The store state of the server this scheduler process runs (the arguments SGLang
    published in it: the record its worker was given)."""
    return store_state(get_server_args())
