"""A store's pages are coded in a child process (`stores/codec_worker.py`), on real demo-model
KV: the same bytes and bits as coding in the calling thread, a damaged stream's error raised to
the caller, a child killed between pages loses nothing (the page is coded in the caller, a
new child takes the next), and a child that stops answering is killed and replaced, its page
failing with `CodecTimeout` once the pool's deadline passes."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.support.host_pools import HostPool, flat_page
from vericache_sglang.codec import StreamError, decode_chunk
from vericache_sglang.stores.codec_worker import CODEC_WORKER, CodecPool, CodecTimeout
from vericache_sglang.stores.pages import PageCoder


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def page(request, model_kv) -> tuple[PageCoder, bytes, torch.Tensor]:
    """A coder for 64-token pages of `dtype`, one page of real KV (tokens 64-127) coded, and
    that page flat."""
    coder = PageCoder.for_pool(HostPool("layer_first", request.param), "kivi:bits=4")
    keys, values = (t[:, 64:128].to(request.param) for t in model_kv)
    flat = flat_page(keys, values, "layer_first")
    return coder, coder.encode(flat, "page-key"), flat


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.flatten().view(torch.uint8), b.flatten().view(torch.uint8))


def test_the_child_codes_the_same_bits_as_the_caller(page):
    coder, blob, flat = page
    assert coder.encode_page(flat, "page-key") == blob  # `blob` was coded by the child
    here = coder.decode_page(blob, "page-key")
    there = CODEC_WORKER.decode(coder, blob, "page-key")
    assert os.getpid() not in CODEC_WORKER.pids()
    assert _same(there[0], here[0]) and _same(there[1], here[1])
    assert len(there[2]) == len(here[2]) == 30
    for mine, theirs in zip(here[2], there[2], strict=True):
        assert mine.bits == theirs.bits
        assert all(_same(a, b) for a, b in zip(mine.tensors(), theirs.tensors(), strict=True))
    target = torch.zeros_like(flat)
    coder.decode(blob, "page-key", target)
    assert _same(target, flat)


def test_a_damaged_stream_raises_in_the_caller(page):
    coder, blob, _ = page
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 0xFF
    with pytest.raises(StreamError, match="corrupted"):
        CODEC_WORKER.decode(coder, bytes(damaged), "page-key")
    with pytest.raises(StreamError):
        CODEC_WORKER.decode(coder, blob, "another-key")  # digests keyed by the page's key


def test_a_killed_child_loses_no_page(page):
    coder, blob, flat = page
    CODEC_WORKER.resize(1)
    (first,) = CODEC_WORKER.pids()
    restarts = CODEC_WORKER.restarts
    os.kill(first, signal.SIGKILL)
    os.waitpid(first, 0)
    target = torch.zeros_like(flat)
    coder.decode(blob, "page-key", target)  # decoded in this thread
    assert _same(target, flat)
    assert CODEC_WORKER.restarts == restarts + 1
    os.kill(CODEC_WORKER.pids()[0], signal.SIGKILL)
    assert coder.encode(flat, "page-key") == blob  # coded in this thread
    assert CODEC_WORKER.restarts == restarts + 2
    target.zero_()
    coder.decode(blob, "page-key", target)  # by a new child
    assert _same(target, flat)
    assert CODEC_WORKER.pids()[0] not in (first, os.getpid())


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T in /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"


@pytest.mark.parametrize("page", [torch.float32], ids=["float32"], indirect=True)
@pytest.mark.parametrize("length", [None, 100], ids=["whole page", "a few bytes"])
def test_a_child_that_stops_answering_is_killed_and_replaced(page, length):
    """SIGSTOP the child, then give it a page: the whole stream, more than the pipe's buffer
    holds (the send waits), or its first bytes (the send completes, the answer never comes).
    Past the pool's deadline the call raises `CodecTimeout`, the stopped child is killed and
    reaped, and a new child decodes the next page."""
    coder, blob, _ = page
    pool = CodecPool(1)
    (stopped,) = pool.pids()
    pool.timeout = 1.0  # applied to the running child's pipe
    os.kill(stopped, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while not _stopped(stopped):
        assert time.monotonic() < deadline, "SIGSTOP did not stop the child"
        time.sleep(0.01)
    with pytest.raises(CodecTimeout, match=f"codec process {stopped} did not answer within 1 s"):
        pool.decode(coder, blob[:length], "page-key")
    with pytest.raises(ChildProcessError):  # reaped: no longer a child of this process
        os.waitpid(stopped, os.WNOHANG)
    assert pool.restarts == 1
    pool.timeout = 60.0  # the new child's imports count toward its first page's wait
    keys, values, _ = pool.decode(coder, blob, "page-key")
    assert pool.pids() != [stopped]
    here = coder.decode_page(blob, "page-key")
    assert _same(keys, here[0]) and _same(values, here[1])


def test_pages_are_coded_side_by_side_in_separate_children(page):
    """Two children, four threads decoding and encoding at once: every call gets an idle
    child of its own, and every result is the page's."""
    coder, blob, flat = page
    CODEC_WORKER.resize(2)
    pids = CODEC_WORKER.pids()
    assert len(set(pids)) == 2 and os.getpid() not in pids
    with ThreadPoolExecutor(4) as threads:
        decoded = list(threads.map(lambda _: CODEC_WORKER.decode(coder, blob, "page-key"),
                                   range(4)))
        encoded = list(threads.map(lambda _: CODEC_WORKER.encode(coder, flat, "page-key"),
                                   range(4)))
    keys, values, _ = coder.decode_page(blob, "page-key")
    assert all(_same(k, keys) and _same(v, values) for k, v, _ in decoded)
    assert encoded == [blob] * 4
    assert CODEC_WORKER.pids() == pids  # no child died or was replaced


def test_a_stream_splits_into_its_coarse_refinement_and_exact_parts(page):
    """The coarse and refinement parts decode the pool level; joined, the parts are the
    stream."""
    coder, blob, _ = page
    coarse, refinement, tail = PageCoder.split(blob)
    head = coarse + refinement
    assert head + tail == blob and 0 < len(coarse) < len(head) < len(blob)
    levels = decode_chunk(head, level=len(coder.spec.levels) - 1, key=b"page-key")
    exact = coder.decode_page(blob, "page-key")
    for mine, theirs in zip(levels.tiers, exact[2], strict=True):
        assert all(_same(a, b) for a, b in zip(mine.tensors(), theirs.tensors(), strict=True))
    with pytest.raises(StreamError):
        coder.decode_page(head, "page-key")  # the exact part is missing
