"""The entropy coding stage (CacheGen's arithmetic coding): probability tables and rANS lanes.

Symbols are coded with static tables that the stream carries: a table is a group's histogram
scaled to 8-bit frequencies (CacheGen groups by layer and channel), and every decoder scales it
to the coder's 16-bit precision the same way (`vericache_kernels.rans_ref.normalize`). The coder
itself is rANS in independent lanes (`vericache_kernels.rans_ref`): a part's lanes are stored as
a directory (each lane's word count, zstd) and the lanes' 16-bit words, so a decoder can take
the lanes in parallel (one per core, GPU thread or vector element) without reading the others.
"""

from __future__ import annotations

import numpy as np
import zstandard

from .stream import StreamForeign


def frequency_tables(symbols: np.ndarray, groups: np.ndarray | None, num_groups: int,
                     num_symbols: int) -> np.ndarray:
    """uint8 [num_groups, num_symbols]: each group's histogram scaled so its largest count is
    255; a symbol that occurs keeps a frequency of at least 1. `groups`: each symbol's group
    (None: one group)."""
    symbols = symbols.astype(np.int64, copy=False).ravel()
    index = symbols if groups is None else groups * num_symbols + symbols
    hist = np.bincount(index, minlength=num_groups * num_symbols).reshape(num_groups,
                                                                          num_symbols)
    return scale_histogram(hist)


def scale_histogram(hist: np.ndarray) -> np.ndarray:
    """Counts [groups, symbols] -> the 8-bit tables the stream stores."""
    top = np.maximum(hist.max(axis=1, keepdims=True), 1)
    scaled = np.rint(hist * (255.0 / top))
    return np.where(hist > 0, np.maximum(scaled, 1), 0).astype(np.uint8)


def pack_tables(tables: list[np.ndarray], level: int) -> bytes:
    flat = np.concatenate([t.ravel() for t in tables]) if tables else np.empty(0, np.uint8)
    return zstandard.ZstdCompressor(level=level).compress(flat.tobytes())


def table_bytes(section: memoryview, total: int) -> np.ndarray:
    """Inverse of `pack_tables`: the `total` table bytes, one block after another (writable,
    as numba takes them)."""
    flat = np.frombuffer(bytearray(zstandard.ZstdDecompressor().decompress(
        bytes(section), max_output_size=max(total, 1))), dtype=np.uint8)
    if flat.size != total:
        raise StreamForeign("KV stream tables have the wrong size")
    return flat


def unpack_tables(section: memoryview, sizes: list[tuple[int, int]]) -> list[np.ndarray]:
    """Inverse of `pack_tables`, given each table block's (rows, symbols)."""
    flat = table_bytes(section, sum(rows * symbols for rows, symbols in sizes))
    out, pos = [], 0
    for rows, symbols in sizes:
        out.append(flat[pos:pos + rows * symbols].reshape(rows, symbols))
        pos += rows * symbols
    return out


def pack_lanes(words: np.ndarray, counts: np.ndarray, level: int) -> list[bytes]:
    """A part's lanes as two sections: the directory (word counts, uint32, zstd) and the words
    (uint16, little-endian)."""
    directory = zstandard.ZstdCompressor(level=level).compress(
        counts.astype("<u4").tobytes())
    return [directory, words.astype("<u2", copy=False).tobytes()]


def unpack_lanes(directory: memoryview, data: memoryview,
                 lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `pack_lanes`: the words (uint16) and each lane's start ([lanes + 1])."""
    counts = np.frombuffer(zstandard.ZstdDecompressor().decompress(
        bytes(directory), max_output_size=4 * lanes + 4), dtype="<u4")
    if counts.size != lanes or len(data) % 2:
        raise StreamForeign("KV stream lane directory does not fit its lanes")
    starts = np.zeros(lanes + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    if starts[-1] * 2 != len(data):
        raise StreamForeign("KV stream lanes do not fill their section")
    return np.frombuffer(data, dtype="<u2").astype(np.uint16), starts
