"""Range coding of symbol arrays through `constriction` (CacheGen's arithmetic coding stage).

Symbols are coded in groups that share a probability table (CacheGen groups by layer and
channel). A table is the group's histogram scaled to 8-bit frequencies: stored beside the
symbols, and rebuilt into the same `Categorical` model by the decoder. Symbols with a known
bounded range and no useful distribution (residual offsets, mantissas, raw escapes) are coded
with `Uniform` models whose sizes the decoder computes itself.
"""

from __future__ import annotations

import constriction
import numpy as np

from .stream import StreamError

_model = constriction.stream.model
_UNIFORM = _model.Uniform()


def frequency_tables(symbols: np.ndarray, groups: np.ndarray, num_groups: int,
                     num_symbols: int) -> np.ndarray:
    """uint8 [num_groups, num_symbols]: each group's histogram scaled so its largest count is
    255; a symbol that occurs keeps a frequency of at least 1."""
    hist = np.bincount(groups * num_symbols + symbols,
                       minlength=num_groups * num_symbols).reshape(num_groups, num_symbols)
    top = np.maximum(hist.max(axis=1, keepdims=True), 1)
    scaled = np.rint(hist * (255.0 / top))
    return np.where(hist > 0, np.maximum(scaled, 1), 0).astype(np.uint8)


def _order(groups: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    return np.argsort(groups, kind="stable"), np.bincount(groups, minlength=num_groups)


def _categorical(freqs: np.ndarray):
    return _model.Categorical(freqs.astype(np.float64), perfect=False)


class SymbolWriter:
    """Appends symbol arrays to one range-coded bit stream."""

    def __init__(self) -> None:
        self._encoder = constriction.stream.queue.RangeEncoder()

    def grouped(self, symbols: np.ndarray, groups: np.ndarray, num_groups: int,
                num_symbols: int) -> np.ndarray:
        """Code `symbols` (ints in [0, num_symbols)), each with its group's table; returns the
        tables, which the decoder needs."""
        symbols = symbols.astype(np.int32, copy=False).ravel()
        groups = groups.astype(np.int64, copy=False).ravel()
        tables = frequency_tables(symbols, groups, num_groups, num_symbols)
        order, counts = _order(groups, num_groups)
        ordered = symbols[order]
        start = 0
        for group, count in enumerate(counts.tolist()):
            if count:
                self._encoder.encode(ordered[start:start + count], _categorical(tables[group]))
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
            raise StreamError("range-coded section is not a whole number of words")
        words = np.frombuffer(data, dtype=np.uint32).copy()
        self._decoder = constriction.stream.queue.RangeDecoder(words)

    def grouped(self, groups: np.ndarray, num_groups: int, tables: np.ndarray) -> np.ndarray:
        groups = groups.astype(np.int64, copy=False).ravel()
        order, counts = _order(groups, num_groups)
        ordered = np.empty(groups.size, dtype=np.int32)
        start = 0
        for group, count in enumerate(counts.tolist()):
            if count:
                if not tables[group].any():
                    raise StreamError("KV stream table has no symbols for a coded group")
                ordered[start:start + count] = self._decoder.decode(
                    _categorical(tables[group]), count)
                start += count
        symbols = np.empty_like(ordered)
        symbols[order] = ordered
        return symbols

    def uniform(self, sizes: np.ndarray) -> np.ndarray:
        if not sizes.size:
            return np.empty(0, dtype=np.int32)
        return self._decoder.decode(_UNIFORM, sizes.astype(np.int32, copy=False).ravel())
