"""Page coding in a child process, so a store's reads and writes do not wait on the scheduler's GIL.

SGLang runs a storage backend's reads in its prefetch thread and its writes in its backup
thread, both inside the scheduler process. Coding a page's stream is many short numpy and
torch calls (before stream version 3 also hundreds of range-coder calls), each releasing and
taking back the GIL; beside the scheduler's
loop, which keeps polling while a request waits for its prefetch, every take-back waits. A
64-token float32 page that decodes in about 0.1 s alone took 0.47 s per page inside a server
(`python -m bench.remote_prefix`, store reads column), and 21 s beside a thread spinning in pure
Python. Child processes code instead: each a fresh interpreter running this module (no CUDA
context, none of the scheduler's state or imports), one torch thread, a pipe, tensors crossing
as bytes; it exits when the pipe closes, with its parent. Several children code a read's pages
side by side (`CodecPool`, `--vericache-store-codec-processes`): one page's stream is a serial
chain of entropy-decoding calls, so pages, not a page's parts, are what runs in parallel. If a
child dies, its page is coded in the calling thread and a new child started for the next:
slower, never lost. A child that stops answering (stopped, swapped out, stuck) would hold the
store's read, and with early drafting the scheduler, for ever: every wait on a child has a
deadline (`--vericache-store-timeout`), past which the child is killed and replaced and the
page fails with `CodecTimeout` (its prefix is recomputed; the page is not coded in the calling
thread, where whatever held the child could hold the store's thread too).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np
import torch

from vericache_sglang.compress.quant import QuantTier
from vericache_sglang.config import VeriCacheConfig

logger = logging.getLogger(__name__)

Wire = tuple[bytes, str, tuple[int, ...]]
"""A tensor as (raw bytes, dtype name, shape): plain bytes cross the process boundary without
torch's shared-memory reductions."""

Decoded = tuple[torch.Tensor, torch.Tensor, list[QuantTier]]
"""A page's keys and values [L, page, H, D] (exact, or the drafting level's reconstruction),
and its pool-level codes per layer."""


class PageCodec(Protocol):
    """What the child needs of a store's coder (`pages.PageCoder`, pickled to it)."""

    def encode_page(self, flat: torch.Tensor, key: str) -> bytes: ...

    def decode_page(self, blob: bytes | memoryview, key: str,
                    drafting: bool = False) -> Decoded: ...


def to_wire(tensor: torch.Tensor) -> Wire:
    raw = tensor.contiguous().flatten().view(torch.uint8).numpy().tobytes()
    return raw, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)


def from_wire(wire: Wire) -> torch.Tensor:
    """Built in numpy, with one torch call (two for bfloat16, which numpy lacks): a torch call
    releases the GIL and, beside a busy scheduler, waits to take it back."""
    raw, dtype, shape = wire
    if dtype == "bfloat16":
        array = np.frombuffer(bytearray(raw), dtype=np.int16).reshape(shape)
        return torch.from_numpy(array).view(torch.bfloat16)
    return torch.from_numpy(np.frombuffer(bytearray(raw), dtype=dtype).reshape(shape))


def _encode(coder: PageCodec, flat: Wire, key: str) -> bytes:
    return coder.encode_page(from_wire(flat), key)


def _decode(coder: PageCodec, blob: bytes, key: str,
            drafting: bool) -> tuple[Wire, Wire, list]:
    keys, values, tiers = coder.decode_page(blob, key, drafting)
    return to_wire(keys), to_wire(values), [
        (tier.bits, [to_wire(t) for t in tier.tensors()]) for tier in tiers]


def _serve(conn: Connection) -> None:
    """The child: run what arrives until the pipe closes. One torch thread: the scheduler's
    process keeps the other core."""
    torch.set_num_threads(1)
    while True:
        try:
            job, args = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, job(*args)))
        except Exception as error:  # noqa: BLE001 - raised in the caller (a StreamError)
            conn.send((False, error))


class _ChildGone(RuntimeError):
    """The child died before answering."""


class CodecTimeout(RuntimeError):
    """A codec child did not answer within the deadline (`--vericache-store-timeout`); it was
    killed, and a new one codes the next page. Not a `StreamError`: nothing is known to be wrong
    with the stored page, so it is a failed read (its prefix recomputes), never a reason to
    delete the page."""


def _limit(conn: Connection, seconds: float) -> None:
    """Bound each read and write on `conn` to `seconds` without progress: a duplex pipe is a
    Unix socket pair, and past its SO_RCVTIMEO or SO_SNDTIMEO a call raises `BlockingIOError`.
    This holds wherever the child stops: before it takes the whole page (larger than the
    socket's buffer), while it codes, or midway through its answer. A new child's start (its
    imports, a second or two) counts toward its first page's wait."""
    timeval = struct.pack("ll", *divmod(max(1, round(seconds * 1e6)), 1_000_000))
    sock = socket.socket(fileno=conn.fileno())
    try:
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            sock.setsockopt(socket.SOL_SOCKET, option, timeval)
    finally:
        sock.detach()


class CodecWorker:
    """One child process that codes pages, over a pipe: each page is one send and one receive,
    which wait without the GIL (an executor's feeder and result threads would each need it, and
    wait for it beside a busy scheduler)."""

    def __init__(self, timeout: float) -> None:
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._child: subprocess.Popen | None = None
        self._timeout = timeout
        self.restarts = 0

    def set_timeout(self, seconds: float) -> None:
        """Let each wait on the child go `seconds` without progress (`_limit`)."""
        with self._lock:
            self._timeout = seconds
            if self._conn is not None:
                _limit(self._conn, seconds)

    def _connection(self) -> Connection:
        if self._conn is None:
            # `python -m` this module, not multiprocessing's spawn: a spawned child re-imports
            # the parent's main module (SGLang's launcher: 0.3 GB more of imports)
            conn, child_conn = multiprocessing.Pipe()
            fd = child_conn.fileno()
            try:
                self._child = subprocess.Popen([sys.executable, "-m", __name__, str(fd)],
                                               pass_fds=(fd,))
            finally:
                child_conn.close()
            _limit(conn, self._timeout)
            self._conn = conn
        return self._conn

    def _end_child(self) -> int | None:
        """Kill the child if it still runs, reap it and close its pipe, so that the next call
        starts a new one; its process id (None when none had started)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return None
        conn.close()
        self._child.kill()
        self._child.wait()
        self.restarts += 1
        return self._child.pid

    def start(self) -> None:
        """Spawn the child now (its imports take a second or two, the first page's wait)."""
        with self._lock:
            self._connection()

    def _run(self, job: Callable[..., Any], *args: Any) -> Any:
        """`job(*args)` in the child. An exception the job raises (a `StreamError`) is raised
        here; `_ChildGone` if the child died, `CodecTimeout` if it stopped answering (it is
        killed); either way the next call starts a new one."""
        with self._lock:
            try:
                conn = self._connection()
                conn.send((job, args))
                ok, result = conn.recv()
            except BlockingIOError:  # the deadline passed (`_limit`)
                pid = self._end_child()
                logger.warning("VeriCache: page codec process %d made no progress for %g s "
                               "(--vericache-store-timeout): killed; this page fails (its "
                               "prefix is recomputed) and a new process codes the next",
                               pid, self._timeout)
                raise CodecTimeout(f"codec process {pid} did not answer within "
                                   f"{self._timeout:g} s") from None
            except (EOFError, OSError):
                self._end_child()
                logger.warning("VeriCache: the page codec process died; this page is coded in "
                               "the store's thread and a new process started for the next")
                raise _ChildGone from None
        if not ok:
            raise result
        return result

    def encode(self, coder: PageCodec, flat: torch.Tensor, key: str) -> bytes:
        """`coder.encode_page(flat, key)`, run in the child."""
        try:
            return self._run(_encode, coder, to_wire(flat), key)
        except _ChildGone:
            return coder.encode_page(flat, key)

    def decode(self, coder: PageCodec, blob: bytes | memoryview, key: str,
               drafting: bool = False) -> Decoded:
        """`coder.decode_page(blob, key, drafting)`, run in the child."""
        try:
            keys, values, tiers = self._run(_decode, coder, bytes(blob), key, drafting)
        except _ChildGone:
            return coder.decode_page(blob, key, drafting)
        return from_wire(keys), from_wire(values), [
            QuantTier(bits, *(from_wire(t) for t in tensors)) for bits, tensors in tiers]

    def pid(self) -> int:
        """The child's process id."""
        with self._lock:
            self._connection()
            return self._child.pid


class CodecPool:
    """Children that code pages side by side: each call takes an idle child (waiting for one
    when all are busy), so as many pages are coded at once as there are children and
    threads calling."""

    def __init__(self, size: int = 1) -> None:
        self._lock = threading.Lock()
        self._workers: list[CodecWorker] = []
        self._idle: queue.SimpleQueue[CodecWorker] = queue.SimpleQueue()
        self._timeout = VeriCacheConfig.vericache_store_timeout
        self.resize(size)

    @property
    def size(self) -> int:
        return len(self._workers)

    @property
    def timeout(self) -> float:
        """Seconds a wait on a child may go without progress before the child is killed and
        the page fails with `CodecTimeout` (`--vericache-store-timeout`)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        with self._lock:
            self._timeout = seconds
            for worker in self._workers:
                worker.set_timeout(seconds)

    def resize(self, size: int) -> None:
        """Have `size` children (0: one per CPU core, at most 4). Children beyond the size are
        kept until their pipes close with this process."""
        size = size or min(4, os.cpu_count() or 1)
        with self._lock:
            while len(self._workers) < size:
                worker = CodecWorker(self._timeout)
                self._workers.append(worker)
                self._idle.put(worker)
            del self._workers[size:]

    def start(self) -> None:
        """Spawn every child now (imports take a second or two, the first pages' wait)."""
        for worker in list(self._workers):
            worker.start()

    def _call(self, method: str, *args: Any) -> Any:
        worker = self._idle.get()
        while worker not in self._workers:  # idle when a resize dropped it: not used again
            worker = self._idle.get()
        try:
            return getattr(worker, method)(*args)
        finally:
            if worker in self._workers:
                self._idle.put(worker)

    def encode(self, coder: PageCodec, flat: torch.Tensor, key: str) -> bytes:
        """`coder.encode_page(flat, key)`, run in an idle child."""
        return self._call("encode", coder, flat, key)

    def decode(self, coder: PageCodec, blob: bytes | memoryview, key: str,
               drafting: bool = False) -> Decoded:
        """`coder.decode_page(blob, key, drafting)`, run in an idle child."""
        return self._call("decode", coder, blob, key, drafting)

    @property
    def restarts(self) -> int:
        return sum(worker.restarts for worker in self._workers)

    def pids(self) -> list[int]:
        """The children's process ids (each started if it was not)."""
        return [worker.pid() for worker in self._workers]


CODEC_WORKER = CodecPool()
"""This process's page coders: one child until a store sizes the pool from its server's
flags."""

if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
