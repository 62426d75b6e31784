"""The host tier's copy engine: a layer's full-KV rows, host to device, behind the compute.

The host tier keeps the full KV in host memory and a forward reads each layer's rows from a few
reusable device buffers. On CUDA this follows SGLang HiCache's layer-wise load
(`LayerDoneCounter` in `sglang.srt.managers.cache_controller`): the engine gathers a copy's rows
into a pinned buffer, issues the host-to-device copy on its own stream and records one event per
copy; the forward's `wait` makes its stream wait on that event (the host does not block), so the
attention of layer l waits only for layer l while later layers are still copying. On a CPU the
same calls copy synchronously, so CPU tests exercise the same ordering checks.

Each copy is known by a key the caller picks (a layer, a staging slot). A key is issued, waited
on once and released; anything else is a `CopyOrderError`, not a silent race. Releasing a copy
hands its destination back: on CUDA the next copy into that destination waits (on the device)
for the reads the forward queued before the release.

This module imports torch only, never SGLang, so it runs on a bare GPU machine.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch

_ALIGN = 64  # bytes: each source's rows start aligned in a pinned buffer


class CopyOrderError(RuntimeError):
    """A copy was waited on or released out of order: never issued, twice, after release."""


def pinned_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Host memory an H2D copy can read asynchronously: page-locked when CUDA is available,
    plain CPU memory otherwise."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=torch.cuda.is_available())


class PinnedBuffers:
    """`count` reusable host buffers the rows are gathered into before their H2D copy.

    A buffer is handed out again only after the copy that last read it completed (its event is
    synchronized), and it grows only when a gather does not fit."""

    def __init__(self, count: int = 2) -> None:
        if count < 2:
            raise ValueError("at least two pinned buffers: fill one while the other is copied")
        self.buffers = [pinned_empty((0,), torch.uint8) for _ in range(count)]
        self._last_reader: list[torch.cuda.Event | None] = [None] * count
        self._next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next buffer (index, bytes), at least `nbytes`, free to overwrite."""
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        reader = self._last_reader[i]
        if reader is not None:
            reader.synchronize()
            self._last_reader[i] = None
        if self.buffers[i].numel() < nbytes:
            self.buffers[i] = pinned_empty((nbytes,), torch.uint8)
        return i, self.buffers[i]

    def read_by(self, i: int, event: torch.cuda.Event) -> None:
        """Buffer `i` is being read by the copy `event` completes."""
        self._last_reader[i] = event


@dataclass
class CopyStats:
    """What the engine copied since the stats were last taken."""

    bytes: int = 0
    copy_s: float = 0.0
    """Time copying: on CUDA the H2D copies on the copy stream, timed by events; on a CPU the
    synchronous copies."""

    def gbps(self) -> float:
        return self.bytes / self.copy_s / 1e9 if self.copy_s else 0.0


@dataclass
class Ticket:
    """One issued copy."""

    key: Hashable
    dst_storages: tuple[int, ...]
    """Storage addresses of its destinations (a later copy into one waits for the release)."""
    done: torch.cuda.Event | None = None
    """On CUDA, recorded on the copy stream after the copy; on a CPU the copy is done at issue."""
    waited: bool = False
    released: bool = False


@dataclass
class _Timing:
    start: torch.cuda.Event
    end: torch.cuda.Event
    nbytes: int


Pair = tuple[torch.Tensor, torch.Tensor]
"""(source, destination): a host tensor [slots, ...] and a buffer on the engine's device."""


class CopyEngine:
    """Host-to-device copies of full-KV rows, one key (layer or unit) at a time, into reusable
    device buffers the caller owns. One thread issues; any thread waits and releases."""

    def __init__(self, device: str | torch.device, *, pinned_buffers: int = 2) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"the copy engine copies to a CPU or a CUDA device, not {device}")
        self.device = device
        self.cuda = device.type == "cuda"
        self.pinned = PinnedBuffers(pinned_buffers)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._tickets: dict[Hashable, Ticket] = {}
        self._reads_done: dict[int, torch.cuda.Event] = {}  # dst storage -> its release
        self._timings: list[_Timing] = []  # CUDA copies not yet counted in the stats
        self._stats = CopyStats()
        self._lock = threading.Lock()

    # -- producer -----------------------------------------------------------------------------
    def issue(self, key: Hashable, pairs: Sequence[Pair], rows: torch.Tensor,
              segments: Sequence[tuple[int, int]] | None = None) -> Ticket:
        """Copy `src[rows]` into each pair's destination. `segments`: (destination row, count)
        runs that `rows` fill in order (default: all of them from row 0), so several requests'
        rows can land apart in one buffer."""
        segments = [(0, rows.numel())] if segments is None else list(segments)
        _check(pairs, rows, segments, self.device)
        with self._lock:
            previous = self._tickets.get(key)
            if previous is not None and not previous.released:
                raise CopyOrderError(f"copy {key!r} issued again before it was released")
        rows = rows.to(torch.int64)
        nbytes = sum(rows.numel() * _row_bytes(src) for src, _ in pairs)
        storages = tuple(dst.untyped_storage().data_ptr() for _, dst in pairs)
        ticket = Ticket(key, storages)
        if self.cuda:
            ticket.done = self._issue_cuda(pairs, rows, segments, storages, nbytes)
        else:
            began = time.perf_counter()
            for src, dst in pairs:
                for at, start, n in _runs(segments):
                    torch.index_select(src, 0, rows[at:at + n], out=dst[start:start + n])
            with self._lock:
                self._stats.bytes += nbytes
                self._stats.copy_s += time.perf_counter() - began
        with self._lock:
            self._tickets[key] = ticket
        return ticket

    def _issue_cuda(self, pairs: Sequence[Pair], rows: torch.Tensor,
                    segments: list[tuple[int, int]], storages: tuple[int, ...],
                    nbytes: int) -> torch.cuda.Event:
        """Gather into a pinned buffer, copy it on the copy stream; the copy's end event."""
        offsets, total = [], 0
        for src, _ in pairs:
            offsets.append(total)
            total += -(-rows.numel() * _row_bytes(src) // _ALIGN) * _ALIGN
        index, buffer = self.pinned.take(total)
        staged = []
        for (src, _), offset in zip(pairs, offsets, strict=True):
            size = rows.numel() * _row_bytes(src)
            view = buffer[offset:offset + size].view(src.dtype).view(rows.numel(), *src.shape[1:])
            torch.index_select(src, 0, rows, out=view)
            staged.append(view)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with self._lock:
            reads = {self._reads_done[s] for s in storages if s in self._reads_done}
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for event in reads:
                self.stream.wait_event(event)
            start.record(self.stream)
            for view, (_, dst) in zip(staged, pairs, strict=True):
                for at, begin, n in _runs(segments):
                    dst[begin:begin + n].copy_(view[at:at + n], non_blocking=True)
            end.record(self.stream)
        self.pinned.read_by(index, end)
        with self._lock:
            self._timings.append(_Timing(start, end, nbytes))
            self._harvest()
        return end

    # -- consumer -----------------------------------------------------------------------------
    def wait(self, key: Hashable) -> None:
        """Make the current stream wait until copy `key` landed (on a CPU it already has);
        the host does not block."""
        with self._lock:
            ticket = self._unreleased(key, "wait for", "after its buffer was released")
            if ticket.waited:
                raise CopyOrderError(f"copy {key!r} waited on twice")
            ticket.waited = True
        if ticket.done is not None:
            torch.cuda.current_stream(self.device).wait_event(ticket.done)

    def release(self, key: Hashable) -> None:
        """The forward queued its last read of copy `key`'s destinations: a later copy into them
        may run once those reads are done."""
        with self._lock:
            ticket = self._unreleased(key, "release", "released twice")
            ticket.released = True
            if self.cuda:
                reads_done = torch.cuda.Event()
                reads_done.record(torch.cuda.current_stream(self.device))
                for storage in ticket.dst_storages:
                    self._reads_done[storage] = reads_done

    def _unreleased(self, key: Hashable, action: str, if_released: str) -> Ticket:
        """Copy `key`'s ticket, refused if it was never issued or is released (lock held)."""
        ticket = self._tickets.get(key)
        if ticket is None:
            raise CopyOrderError(f"{action} copy {key!r}, which was never issued")
        if ticket.released:
            raise CopyOrderError(f"{action} copy {key!r}: {if_released}")
        return ticket

    # -- accounting ---------------------------------------------------------------------------
    def take_stats(self) -> CopyStats:
        """Bytes copied and time copying since the last call (on CUDA: of the copies finished)."""
        with self._lock:
            self._harvest()
            stats, self._stats = self._stats, CopyStats()
        return stats

    def _harvest(self) -> None:
        """Count the finished CUDA copies (called with the lock held)."""
        pending = []
        for timing in self._timings:
            if timing.end.query():
                self._stats.bytes += timing.nbytes
                self._stats.copy_s += timing.start.elapsed_time(timing.end) / 1e3
            else:
                pending.append(timing)
        self._timings = pending


def _check(pairs: Sequence[Pair], rows: torch.Tensor, segments: list[tuple[int, int]],
           device: torch.device) -> None:
    """Refuse a copy that would land out of its destination or mix shapes/devices."""
    if rows.dim() != 1 or rows.device.type != "cpu":
        raise ValueError("rows: a 1-D index tensor in host memory")
    if sum(n for _, n in segments) != rows.numel():
        raise ValueError(f"segments hold {sum(n for _, n in segments)} rows, "
                         f"{rows.numel()} were given")
    for src, dst in pairs:
        if src.device.type != "cpu":
            raise ValueError(f"source on {src.device}: the copy engine reads host memory")
        if dst.device != device:
            raise ValueError(f"destination on {dst.device}, the engine copies to {device}")
        if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
            raise ValueError(f"rows of {tuple(src.shape[1:])} {src.dtype} do not fit a "
                             f"destination of {tuple(dst.shape[1:])} {dst.dtype}")
        for start, n in segments:
            if start < 0 or start + n > dst.shape[0]:
                raise ValueError(f"rows [{start}, {start + n}) do not fit a destination of "
                                 f"{dst.shape[0]} rows")


def _runs(segments: list[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    """(position in rows, destination row, count) of each non-empty segment."""
    at = 0
    for start, n in segments:
        if n:
            yield at, start, n
        at += n


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


# -- measurement (the GPU device check) --------------------------------------------------------
def measure_copy(layers: int, rows: int, heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                 compute: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None, *,
                 slots: int | None = None, repeats: int = 3) -> dict[str, float]:
    """H2D throughput of a layer-wise copy of `rows` scattered rows of K and V per layer from a
    host pool of `slots` rows (default 2 * rows), through two reusable device buffers as the
    staging area does (copy layer l+1 while layer l is read).

    With `compute(layer, k, v)`, run per layer on the current stream once the layer landed, it
    also times compute alone and both together: `hidden_fraction` is the share of the copy time
    the compute hid, 1 - (both - compute alone) / copy alone, clamped to [0, 1]. Each time is the
    best of `repeats` passes after a warm-up pass."""
    device = torch.device(device)
    slots = slots or 2 * rows
    shape = (heads, head_dim)
    pool = [(torch.zeros(slots, *shape, dtype=dtype), torch.zeros(slots, *shape, dtype=dtype))
            for _ in range(layers)]
    buffers = [(torch.empty(rows, *shape, dtype=dtype, device=device),
                torch.empty(rows, *shape, dtype=dtype, device=device)) for _ in range(2)]
    index = torch.randperm(slots)[:rows]
    engine = CopyEngine(device)

    def issue(layer: int) -> None:
        k, v = buffers[layer % 2]
        engine.issue(layer, [(pool[layer][0], k), (pool[layer][1], v)], index)

    def one_pass(copy: bool, work: bool) -> None:
        if copy:
            issue(0)
        for layer in range(layers):
            if copy:
                if layer + 1 < layers:
                    issue(layer + 1)
                engine.wait(layer)
            if work and compute is not None:
                compute(layer, *buffers[layer % 2])
            if copy:
                engine.release(layer)

    def best(copy: bool, work: bool) -> tuple[float, CopyStats]:
        """Best time of `repeats` passes after a warm-up one, and what they copied."""
        one_pass(copy, work)
        _synchronize(device)
        engine.take_stats()
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            one_pass(copy, work)
            _synchronize(device)
            times.append(time.perf_counter() - began)
        return min(times), engine.take_stats()

    copy_s, copied = best(copy=True, work=False)
    nbytes = copied.bytes / repeats
    result = {"bytes": nbytes, "copy_s": copy_s, "copy_gbps": nbytes / copy_s / 1e9,
              "h2d_gbps": copied.gbps()}
    if compute is not None:
        compute_s, _ = best(copy=False, work=True)
        both_s, _ = best(copy=True, work=True)
        hidden = 1 - (both_s - compute_s) / copy_s
        result.update(compute_s=compute_s, both_s=both_s,
                      hidden_fraction=min(1.0, max(0.0, hidden)))
    return result


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
