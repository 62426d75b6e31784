"""Range coding of symbol arrays through `constriction` (CacheGen's arithmetic coding stage).

Symbols are coded in groups that share a probability table (CacheGen groups by layer and
channel). A table is the group's histogram scaled to 8-bit frequencies: stored beside the
symbols, and rebuilt into the same `Categorical` model by the decoder. Symbols with a known
bounded range and no useful distribution (residual offsets, mantissas, raw escapes) are coded
with `Uniform` models whose sizes the decoder computes itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import constriction
import numpy as np

from .stream import StreamForeign

_model = constriction.stream.model
_UNIFORM = _model.Uniform()


@dataclass(frozen=True)
class Grouping:
    """Which table codes each symbol of an array layout: the symbols' table indices, their
    order grouped by table (stable), and each table's count. Built once per layout: a chunk's
    layers share their channel layout, so its sort is not redone per layer and level."""

    groups: np.ndarray | None
    """int64 table index per symbol, or None: one table for all."""
    order: np.ndarray | None
    counts: list[int]

    @classmethod
    def of(cls, groups: np.ndarray, num_groups: int) -> Grouping:
        groups = groups.astype(np.int64, copy=False).ravel()
        return cls(groups, np.argsort(groups, kind="stable"),
                   np.bincount(groups, minlength=num_groups).tolist())

    @classmethod
    def single(cls, size: int) -> Grouping:
        return cls(None, None, [size])

    @functools.cached_property
    def coded(self) -> np.ndarray:
        """Which tables code at least one symbol."""
        return np.asarray(self.counts) > 0

    def sort(self, symbols: np.ndarray) -> np.ndarray:
        return symbols if self.order is None else symbols[self.order]

    def unsort(self, ordered: np.ndarray) -> np.ndarray:
        if self.order is None:
            return ordered
        symbols = np.empty_like(ordered)
        symbols[self.order] = ordered
        return symbols


def frequency_tables(symbols: np.ndarray, grouping: Grouping, num_symbols: int) -> np.ndarray:
    """uint8 [num_groups, num_symbols]: each group's histogram scaled so its largest count is
    255; a symbol that occurs keeps a frequency of at least 1."""
    num_groups = len(grouping.counts)
    index = symbols if grouping.groups is None else grouping.groups * num_symbols + symbols
    hist = np.bincount(index, minlength=num_groups * num_symbols).reshape(num_groups,
                                                                          num_symbols)
    top = np.maximum(hist.max(axis=1, keepdims=True), 1)
    scaled = np.rint(hist * (255.0 / top))
    return np.where(hist > 0, np.maximum(scaled, 1), 0).astype(np.uint8)


_categorical = functools.partial(_model.Categorical, perfect=False)
"""The model both sides build from a table (a C-level partial: no Python frame per group, of
which a page has tens of thousands)."""


class SymbolWriter:
    """Appends symbol arrays to one range-coded bit stream."""

    def __init__(self) -> None:
        self._encoder = constriction.stream.queue.RangeEncoder()

    def grouped(self, symbols: np.ndarray, grouping: Grouping, num_symbols: int) -> np.ndarray:
        """Code `symbols` (ints in [0, num_symbols)), each with its group's table; returns the
        tables, which the decoder needs."""
        symbols = symbols.astype(np.int32, copy=False).ravel()
        tables = frequency_tables(symbols, grouping, num_symbols)
        freqs = tables.astype(np.float64)
        ordered = grouping.sort(symbols)
        start = 0
        for group, count in enumerate(grouping.counts):
            if count:
                self._encoder.encode(ordered[start:start + count], _categorical(freqs[group]))
                start += count
        return tables

    def uniform(self, symbols: np.ndarray, sizes: np.ndarray) -> None:
        """Code `symbols[i]` in [0, sizes[i]) (2 <= sizes < 2**24) with equal probabilities."""
        if symbols.size:
            self._encoder.encode(symbols.astype(np.int32, copy=False).ravel(), _UNIFORM,
                                 sizes.astype(np.int32, copy=False).ravel())

    def finish(self) -> bytes:
        return self._encoder.get_compressed().tobytes()


class SymbolReader:
    """Reads back what a `SymbolWriter` wrote, call for call."""

    def __init__(self, data: bytes | memoryview) -> None:
        if len(data) % 4:
            raise StreamForeign("range-coded section is not a whole number of words")
        words = np.frombuffer(data, dtype=np.uint32).copy()
        self._decoder = constriction.stream.queue.RangeDecoder(words)

    def grouped(self, grouping: Grouping, tables: np.ndarray) -> np.ndarray:
        if not tables[grouping.coded].any(axis=1).all():
            raise StreamForeign("KV stream table has no symbols for a coded group")
        decode = self._decoder.decode
        parts = [decode(_categorical(freqs), count)
                 for freqs, count in zip(tables.astype(np.float64), grouping.counts, strict=True)
                 if count]
        return grouping.unsort(np.concatenate(parts) if parts else np.empty(0, dtype=np.int32))

    def uniform(self, sizes: np.ndarray) -> np.ndarray:
        if not sizes.size:
            return np.empty(0, dtype=np.int32)
        return self._decoder.decode(_UNIFORM, sizes.astype(np.int32, copy=False).ravel())
