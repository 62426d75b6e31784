"""What every VeriCache store shares: the coded page form, pages coded side by side, and the
storage counters.

`PageCoder` turns a host pool's flat page (SGLang's `get_data_page` layout) into one CacheGen
stream (`vericache_sglang.codec`) and back; `PageWindow` runs a batch's page jobs several at once
and hands them back in order; `StoreStats` counts, per server (its `state.StoreState`), pages,
bytes and codec time by direction and form, and faults by kind (`/metrics`, `/server_info`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from vericache_sglang.codec import (
    CodecSpec,
    Header,
    StreamCorrupt,
    StreamError,
    StreamForeign,
    StreamTruncated,
    decode_chunk,
    encode_chunk,
    finer,
    parts_in,
    prefix_length,
    read_header,
)
from vericache_sglang.codec.exact import FORMATS
from vericache_sglang.compress.kivi import Kivi
from vericache_sglang.compress.quant import KiviQuantizer, QuantTier
from vericache_sglang.compress.registry import parse_compressor_spec
from vericache_sglang.config import served_config

from .codec_worker import CODEC_WORKER, Decoded

logger = logging.getLogger(__name__)

FAULT_KINDS = ("missing", "short", "corrupt", "foreign", "timeout", "read_error",
               "write_error", "unavailable")
CODED_LAYOUTS = ("layer_first", "page_first")
"""Host pool layouts whose flat page the coded form reads as [2, L, page, H, D] (or with page
and layer swapped)."""


class StoreStats:
    """A server's storage counts: faults by kind (each logged the first time only), and
    pages, bytes and codec seconds by direction and form."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.faults: Counter[str] = Counter()
        self.io: Counter[tuple[str, str, str]] = Counter()
        """(direction, form, unit) -> running total; form `kv` is the host pool's bytes of
        those pages, form `codec` the seconds spent coding them."""

    def record(self, kind: str, key: str, detail: str) -> None:
        with self._lock:
            first = self.faults[kind] == 0
            self.faults[kind] += 1
        if first:
            logger.warning("VeriCache store: %s page %s (%s); that prefix is recomputed "
                           "from here on (logged once per kind, counted in "
                           "vericache:disk_faults)", kind, key[:16], detail)

    def add(self, direction: str, form: str, stored: int, kv: int, seconds: float) -> None:
        """One page `direction` ('written' or 'read') in `form`: `stored` bytes in the store
        for `kv` bytes of KV in the host pool."""
        with self._lock:
            self.io[direction, form, "pages"] += 1
            self.io[direction, form, "bytes"] += stored
            self.io[direction, "kv", "bytes"] += kv
            self.io[direction, "codec", "seconds"] += seconds

    def totals(self) -> tuple[dict[str, int], dict[tuple[str, str, str], float]]:
        """The running totals: faults by kind, and io by (direction, form, unit)."""
        with self._lock:
            return {kind: self.faults[kind] for kind in FAULT_KINDS}, dict(self.io)

    def snapshot(self) -> dict[str, Any]:
        """The totals as `/server_info` shows them (io as `direction_form_unit`)."""
        faults, io = self.totals()
        return {"faults": faults, "io": {"_".join(key): n for key, n in io.items()}}


class ReconnectStats:
    """A server's attempts to reach a store that was unreachable, and how many failed
    (`/metrics`: vericache:store_reconnect_attempts and _failures)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.attempts = 0
        self.failures = 0

    def record(self, failed: bool) -> None:
        with self._lock:
            self.attempts += 1
            self.failures += failed


class PageCoder:
    """The coded form of a host pool's pages: flat page (host layout) <-> codec stream."""

    def __init__(self, host_pool: Any, spec: CodecSpec, *, pool_level: bool) -> None:
        self.spec = spec
        self.pool_level = pool_level
        """Whether the stream's last lossy level is the compressed pool's pages."""
        self.dtype = host_pool.dtype
        self.dtype_name = str(host_pool.dtype).removeprefix("torch.")
        self.page_first = host_pool.layout == "page_first"
        rows = (host_pool.page_size, host_pool.layer_num)
        self.shape = (2, *(rows if self.page_first else rows[::-1]),
                      host_pool.head_num, host_pool.head_dim)
        self.chunk_shape = (host_pool.layer_num, host_pool.page_size, host_pool.head_num,
                            host_pool.head_dim)
        """[L, page, H, D]: a decoded stream's keys (and values)."""

    @classmethod
    def for_pool(cls, host_pool: Any, compressor_spec: str) -> PageCoder | None:
        """The coder for `host_pool`'s pages, or None where they are stored raw. The stream's
        lossy levels are the compressor's pool pages when it is a prefix-stable KIVI
        quantizer; otherwise (token droppers, mixed windows) 4-bit KIVI bins serve only as the
        exact part's predictor."""
        if (getattr(host_pool, "layout", None) not in CODED_LAYOUTS
                or not hasattr(host_pool, "head_num")
                or str(host_pool.dtype).removeprefix("torch.") not in FORMATS):
            return None
        compressor = parse_compressor_spec(compressor_spec)
        pool_level = isinstance(compressor, KiviQuantizer) and compressor.prefix_stable
        spec = CodecSpec.for_compressor(compressor if pool_level else Kivi(bits=4),
                                        host_pool.layer_num)
        if host_pool.page_size % spec.group:
            return None
        return cls(host_pool, spec, pool_level=pool_level)

    def kv(self, flat: torch.Tensor) -> torch.Tensor:
        """[2, L, page, H, D] view of a flat page."""
        kv = flat.view(self.dtype).reshape(self.shape)
        return kv.transpose(1, 2) if self.page_first else kv

    def encode(self, flat: torch.Tensor, key: str) -> bytes:
        """The stream of the flat page `flat`, coded in the codec process
        (`codec_worker.py`)."""
        return CODEC_WORKER.encode(self, flat, key)

    def encode_page(self, flat: torch.Tensor, key: str) -> bytes:
        kv = self.kv(flat)
        return encode_chunk(kv[0], kv[1], self.spec, key.encode())

    @staticmethod
    def split(blob: bytes) -> tuple[bytes, bytes, bytes]:
        """`blob` as (coarse, refinement, exact): the header with the first lossy level (what
        drafting reads on a slow link), the finer lossy levels up to the compressed pool's
        (empty when the stream has one level), and the exact KV. Stored as objects of their
        own, so the first can arrive alone and the second when the link allows; joined again
        they are the stream."""
        header, _ = read_header(blob)
        coarse, pool = prefix_length(header, 1), prefix_length(header, len(header.levels))
        return blob[:coarse], blob[coarse:pool], blob[pool:]

    @staticmethod
    def refinement_bytes(head: bytes | memoryview) -> int:
        """Bytes of the refinement part that `head`, the start of a stream (its coarse part,
        or coarse and refinement parts), still lacks: 0 once it holds every lossy level."""
        header, _ = read_header(head)
        return max(prefix_length(header, len(header.levels)) - len(head), 0)

    def decode(self, blob: bytes | memoryview, key: str, target: torch.Tensor,
               drafting: bool = False) -> list[QuantTier]:
        """Decode the exact KV of `blob` (with `drafting`: the finest lossy level it holds,
        `decode_page`) into the flat page `target`, in the codec process (`codec_worker.py`);
        its pool-level codes are returned, for the store to offer them for the reloaded
        compressed pages (`ReloadedCodes.decoded`: a coder, pickled to the codec processes,
        holds no registry)."""
        keys, values, tiers = CODEC_WORKER.decode(self, blob, key, drafting=drafting)
        kv = self.kv(target)
        kv[0].copy_(keys)
        kv[1].copy_(values)
        return tiers

    def own_pool_level(self, header: Header) -> bool:
        """Whether the pool level of `header`'s stream is this coder's (bits per layer and key
        group): then its codes are the compressed pool's pages bit for bit."""
        return (header.levels[-1] == list(self.spec.pool_bits)
                and header.group == self.spec.group)

    def decode_page(self, blob: bytes | memoryview, key: str,
                    drafting: bool = False) -> Decoded:
        """The exact keys and values of `blob` and its pool-level codes: none where the
        stream's levels only predict, or are another compressor's (its exact KV is this page's
        all the same). With `drafting`, the reconstruction of the finest lossy level whose
        part `blob` holds (a prefix of the stream), its codes lifted to the pool's bits
        (`finer`: the same values). A stream of another page shape or dtype, and another
        compressor's drafting level, raise `StreamForeign`: another configuration's valid page,
        which a store leaves in place."""
        header, _ = read_header(blob)
        shape = (header.layers, header.tokens, header.heads, header.head_dim)
        if shape != self.chunk_shape or header.dtype != self.dtype_name:
            raise StreamForeign(f"the stream holds {shape} {header.dtype}, the page is "
                                f"{self.chunk_shape} {self.dtype_name}")
        own = self.own_pool_level(header)
        if drafting:
            if not own:
                raise StreamForeign(f"the stream's drafting levels are another compressor's "
                                    f"(pool level {header.levels[-1]} bits, group "
                                    f"{header.group}; this pool's {list(self.spec.pool_bits)}, "
                                    f"{self.spec.group})")
            level = min(parts_in(header, len(blob)), len(header.levels)) - 1
            if level < 0:
                raise StreamTruncated("the drafting part holds no whole lossy level")
            chunk = decode_chunk(blob, level=level, key=key.encode())
            chunk.tiers = [finer(tier, bits) for tier, bits in
                           zip(chunk.tiers, header.levels[-1], strict=True)]
            pairs = [tier.dequantize(self.dtype) for tier in chunk.tiers]
            keys = torch.stack([k for k, _ in pairs])
            values = torch.stack([v for _, v in pairs])
        else:
            chunk = decode_chunk(blob, key=key.encode())
            keys, values = chunk.keys, chunk.values
        return keys, values, chunk.tiers if self.pool_level and own else []


def fault_kind(error: StreamError) -> str:
    """The fault a stream that does not decode counts as: `corrupt` (which a store removes)
    only where a digest failed, `short` where it ends early, else `foreign`."""
    if isinstance(error, StreamCorrupt):
        return "corrupt"
    return "short" if isinstance(error, StreamTruncated) else "foreign"


def store_reads_auto() -> bool:
    """Whether this process's server measures reads against prefill (`stores/admission.py`)."""
    config = served_config()
    return config.enable_vericache and config.vericache_store_reads == "auto"


class PageWindow:
    """A batch's page jobs (read or write, then code), several at once, handed back in order: a
    page's transfer (file reads and Mooncake's `get` and `put` release the GIL) and its coding
    (in a codec process) overlap other pages', so a batch takes about the slower of the
    transfer and the coders, not their sum. One job per codec process runs, and one more in
    transfer."""

    def __init__(self) -> None:
        self.in_flight = 1
        self._workers: ThreadPoolExecutor | None = None

    def start(self) -> int:
        """Size this process's codec processes from its server's flags
        (`--vericache-store-codec-processes`) and start them; how many."""
        config = served_config()
        CODEC_WORKER.resize(config.vericache_store_codec_processes)
        CODEC_WORKER.timeout = config.vericache_store_timeout
        CODEC_WORKER.start()
        processes = CODEC_WORKER.size
        self.in_flight = processes + 1
        self._workers = ThreadPoolExecutor(self.in_flight,
                                           thread_name_prefix="vericache-store-io")
        return processes

    def run(self, job: Callable[..., Any], items: list[tuple]) -> Iterator[Future]:
        """`job(*item)` for each item, as futures in order. Jobs past where the caller stops
        (closing the iterator) are cancelled, or run out unused."""
        pending: deque[Future] = deque()
        upcoming = iter(items)
        try:
            while True:
                while len(pending) < self.in_flight:
                    item = next(upcoming, None)
                    if item is None:
                        break
                    pending.append(self._workers.submit(job, *item))
                if not pending:
                    return
                yield pending.popleft()
        finally:
            for future in pending:
                future.cancel()


def vericache_compressor() -> str | None:
    """The compressor spec of the server this process runs, or None without VeriCache."""
    config = served_config()
    return config.vericache_compressor if config.enable_vericache else None
