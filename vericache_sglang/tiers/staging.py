"""The staging area: a bounded device buffer the full KV streams through, layer by layer.

With the full tier off the device, a forward that needs full-precision attention (verification,
prefill over earlier chunks, a plain decode step) reads each layer's full KV from a few device
buffers ("units") that a copier fills from the host tier ahead of the layer that needs them.
This follows SGLang HiCache's layer-wise load (`LayerDoneCounter`: per-layer events, the
attention of layer l waits only for layer l): here a unit holds one layer's rows of a group of
the batch's requests, the copier fills units in the order the forward consumes them, and it
reuses a unit's buffer only after the forward released it, so the device never holds more than
`depth` units whatever the batch's context. The copier is a worker thread that plans the order;
the copies themselves go through the copy engine (`tiers/copy_engine.py`): on a CPU synchronous
`index_select`s (they release the GIL, so they overlap the main thread's compute), on CUDA a
gather into pinned memory and an H2D copy on a side stream, one event per unit that the forward's
stream waits on. There the full pool's host buffers would ideally be page-locked where the host
pool is allocated (SGLang's `alloc_with_host_register`, `sglang.srt.mem_cache.pool_host.common`):
not needed for correctness, since the engine gathers the scattered rows into its own pinned
buffers first.

A unit's buffer also has room for the requests' new tokens (the ones the forward computes): the
forward writes their K/V in behind the prefix, so attention reads one contiguous run per request,
exactly the keys SGLang's own attention reads, in the same order.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.tiers.copy_engine import CopyEngine


class StagingTooSmall(RuntimeError):
    """A request's rows of one layer do not fit a staging unit."""


@dataclass
class Unit:
    """One layer's rows of a group of requests, staged in one buffer."""

    layer: int
    requests: list[int]
    """Batch rows of the requests this unit serves."""
    prefix: list[int]
    """Rows each request fetches from the full tier (its prefix length)."""
    total: list[int]
    """Rows each request's attention reads: prefix plus the forward's new tokens."""
    rows: torch.Tensor
    """Full-tier slots to fetch, the requests' prefixes one after another."""
    starts: list[int]
    """Where each request's rows begin in the buffer."""
    slot: int | None = None
    """The buffer it was copied into (the copy engine's key)."""
    done: threading.Event = field(default_factory=threading.Event)
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    error: BaseException | None = None


@dataclass
class FetchStats:
    """What the copier did since the stats were last taken."""

    bytes: int = 0
    copy_s: float = 0.0
    """Time spent copying (on CUDA: the H2D copies on the copy stream)."""
    wait_s: float = 0.0
    """Time the forward waited for a unit: copy time not hidden behind other work (on CUDA
    only the host's wait for the gather; the stream's wait on the copy is not counted)."""

    def add(self, other: FetchStats) -> None:
        self.bytes += other.bytes
        self.copy_s += other.copy_s
        self.wait_s += other.wait_s

    def hidden_fraction(self) -> float:
        """Share of the copy time the forwards did not wait for (0 with no copies)."""
        return max(0.0, 1 - self.wait_s / self.copy_s) if self.copy_s else 0.0


class Fetch:
    """The units of one forward, in the order it consumes them (layer-major)."""

    def __init__(self, units: list[Unit], layers: int) -> None:
        self.units = units
        self.by_layer: list[list[Unit]] = [[] for _ in range(layers)]
        for unit in units:
            self.by_layer[unit.layer].append(unit)


class StagingArea:
    """`depth` device buffers of `unit_tokens` rows of one layer's K and V each, and their
    copier thread."""

    def __init__(self, full_pool, *, unit_tokens: int, depth: int, device: str | torch.device):
        """`full_pool`: SGLang's KV pool holding the full tier (host memory)."""
        if depth < 2:
            raise ValueError("the staging area needs at least two units (copy one, read one)")
        self.full_pool = full_pool
        self.unit_tokens = unit_tokens
        self.depth = depth
        self.layers = full_pool.layer_num
        shape = (unit_tokens, full_pool.head_num, full_pool.head_dim)
        dtype = full_pool.k_buffer[0].dtype
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(depth)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(depth)]
        self.engine = CopyEngine(device)
        self._free = threading.Semaphore(depth)
        self._jobs: queue.SimpleQueue[Fetch | None] = queue.SimpleQueue()
        self._stats = FetchStats()
        self._request_bytes: dict[int, int] = {}  # batch row -> bytes read for that request
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="vericache-staging", daemon=True)
        self._thread.start()

    # -- planning ---------------------------------------------------------------------------
    def plan(self, prefix_rows: list[torch.Tensor], new_tokens: list[int]) -> Fetch:
        """Units for a forward whose request i attends to the full tier at `prefix_rows[i]`
        plus `new_tokens[i]` rows it computes itself. Requests are packed into units in batch
        order; every layer has the same grouping."""
        groups: list[list[int]] = [[]]
        used = 0
        for i, rows in enumerate(prefix_rows):
            need = len(rows) + new_tokens[i]
            if need > self.unit_tokens:
                raise StagingTooSmall(
                    f"a request needs {need} rows of one layer staged, a staging unit holds "
                    f"{self.unit_tokens}: raise --vericache-staging-budget")
            if used + need > self.unit_tokens:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += need
        self._attribute([len(rows) for rows in prefix_rows])
        units = []
        for layer in range(self.layers):
            for group in groups:
                totals = [len(prefix_rows[i]) + new_tokens[i] for i in group]
                starts = [sum(totals[:j]) for j in range(len(group))]
                rows = torch.cat([prefix_rows[i] for i in group]) if group else \
                    torch.empty(0, dtype=torch.int64)
                units.append(Unit(layer=layer, requests=group,
                                  prefix=[len(prefix_rows[i]) for i in group], total=totals,
                                  rows=rows.to(torch.int64), starts=starts))
        return Fetch(units, self.layers)

    def start(self, fetch: Fetch) -> Fetch:
        """Begin copying `fetch`'s units (as far as free buffers allow) and return it."""
        self._jobs.put(fetch)
        return fetch

    # -- consuming ----------------------------------------------------------------------------
    def wait(self, unit: Unit) -> Unit:
        """Block until `unit`'s copy is issued and make the current stream wait for it; its
        `k`/`v` are then valid until `release`."""
        began = time.perf_counter()
        unit.done.wait()
        waited = time.perf_counter() - began
        with self._lock:
            self._stats.wait_s += waited
        if unit.error is not None:
            raise unit.error
        self.engine.wait(unit.slot)
        return unit

    def release(self, unit: Unit) -> None:
        """The forward is done with `unit`: its buffer may take the next one."""
        self.engine.release(unit.slot)
        unit.k = unit.v = None
        self._free.release()

    def drain(self, fetch: Fetch) -> None:
        """Consume (and release) every unit of `fetch` the forward did not, e.g. after an error,
        so the copier is free for the next forward."""
        for unit in fetch.units:
            if unit.k is not None or not unit.done.is_set():
                unit.done.wait()
                if unit.error is None:
                    self.release(unit)

    # -- accounting ---------------------------------------------------------------------------
    def take_stats(self) -> FetchStats:
        """Bytes copied and time copying / waiting since the last call."""
        copied = self.engine.take_stats()
        with self._lock:
            stats, self._stats = self._stats, FetchStats()
        stats.add(FetchStats(bytes=copied.bytes, copy_s=copied.copy_s))
        return stats

    def take_request_bytes(self) -> dict[int, int]:
        """Bytes read for each request (by batch row) since the last call: its prefix rows of
        every planned unit, and its rows of the drafting windows. Pages compressed from the
        full tier serve every request sharing them and are not attributed."""
        with self._lock:
            taken, self._request_bytes = self._request_bytes, {}
        return taken

    def record_direct(self, nbytes: int, seconds: float,
                      request_rows: list[int] | None = None) -> None:
        """Count a read of the full tier made outside the copier (drafting windows, pages being
        compressed): nothing hid it. `request_rows[i]`: the tokens read for batch row i."""
        with self._lock:
            self._stats.bytes += nbytes
            self._stats.copy_s += seconds
            self._stats.wait_s += seconds
        self._attribute(request_rows or [])

    def _attribute(self, request_rows: list[int]) -> None:
        """Count `request_rows[i]` tokens of full KV (every layer, K and V) read for batch row i."""
        token_bytes = 2 * self.layers * self._row_bytes()
        with self._lock:
            for i, rows in enumerate(request_rows):
                self._request_bytes[i] = self._request_bytes.get(i, 0) + rows * token_bytes

    def allocated_bytes(self) -> int:
        return storage_bytes([*self.k, *self.v])

    # -- the copier ---------------------------------------------------------------------------
    def _run(self) -> None:
        slot = 0
        while True:
            fetch = self._jobs.get()
            if fetch is None:
                return
            for unit in fetch.units:
                self._free.acquire()
                try:
                    self._copy(unit, slot)
                except BaseException as e:  # surfaced to the forward by wait()
                    unit.error = e
                    self._free.release()
                unit.done.set()
                slot = (slot + 1) % self.depth

    def _copy(self, unit: Unit, slot: int) -> None:
        """Each request's prefix rows of `unit.layer` into buffer `slot`, at its start."""
        k, v = self.k[slot], self.v[slot]
        self.engine.issue(slot, [(self.full_pool.k_buffer[unit.layer], k),
                                 (self.full_pool.v_buffer[unit.layer], v)],
                          unit.rows, segments=list(zip(unit.starts, unit.prefix, strict=True)))
        unit.slot, unit.k, unit.v = slot, k, v

    def _row_bytes(self) -> int:
        buffer = self.k[0]
        return buffer[0].numel() * buffer.element_size()

    def close(self) -> None:
        """Stop the copier thread."""
        self._jobs.put(None)
