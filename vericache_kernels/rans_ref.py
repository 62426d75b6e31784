"""Static-model rANS lanes for the KV codec: shared definitions and the numpy reference decoder.

The codec's stream codes each part as independent **lanes**: a lane is `lane_channels`
consecutive channels of one (layer, K or V), each channel's tokens in order, coded by one rANS
coder (32-bit state, 16-bit words). A lane starts with its final encoder state (two words) and
its words follow in the order the decoder reads them; the part's directory holds each lane's
word count. Lanes share nothing, so a decoder runs them in any order: one numba loop per lane on
a CPU core (`rans_cpu.py`), one vector element per lane in Triton (`rans_triton.py`), and one
numpy vector element per lane here (readable and slow: the reference the others are tested
against).

Symbols are coded three ways, each at its own precision P (a symbol owns `freq` of the 2**P
slots from `cum`):
- **table** symbols (P = 16): the codec stores 8-bit histograms; both sides scale them to sum
  2**16 with `normalize` (integer arithmetic only, so every decoder derives the same `cum`);
- **uniform** symbols over N values: the low `k` bits raw, the rest over at most 2**7 values
  with near-equal frequencies from `UNIFORM_CUM` (decoded by a multiply and two table reads,
  no division);
- **raw** bits (P = k, freq 1).

The exact part's element model (the bin a pool code implies, the escape and exponent paths) is
`plan` below; the level parts' codes are table symbols. Both decoders here take the arrays the
codec's parser produces; see `vericache_sglang/codec/chunk.py` for the stream layout.
"""

from __future__ import annotations

import numpy as np

PROB_BITS = 16
RANS_L = 1 << 16
"""Lower bound of the coder states; a lane ends (decoded) with every state exactly this."""
STATES = 4
"""Coder states per lane, interleaved: a lane's symbol j is coded by state j % 4, and the
states read their words from the lane's one sequence in turn. Four independent dependency
chains let a CPU core overlap four symbols' table searches."""
UNIFORM_BITS = 7
UNIFORM_CUM = np.array([[(s << PROB_BITS) // max(n, 1) if s <= n else 0
                         for s in range((1 << UNIFORM_BITS) + 1)]
                        for n in range((1 << UNIFORM_BITS) + 1)], dtype=np.int64)
"""cum[N, s] of a near-uniform model over N values (N <= 2**UNIFORM_BITS)."""
NARROW_LIMIT = 1 << 22
"""Widest bin coded as an offset; wider ones (and bins spanning zero) are coded as exponent,
sign and mantissa."""
EXP_SYMBOLS = 32
"""Exponents below the bin's largest, 0..30; 31 is the escape (raw bits follow)."""
ESCAPE = EXP_SYMBOLS - 1
BF16, FP16, FP32 = 0, 1, 2
FORMATS = {"bfloat16": (BF16, 16, 7, 1), "float16": (FP16, 16, 10, 1),
           "float32": (FP32, 32, 23, 4)}
"""dtype -> (kind, bits, mantissa bits, margin: ordered-integer slack around a bin)."""


def normalize(tables: np.ndarray, width: int | None = None) -> np.ndarray:
    """8-bit histograms [T, K] -> cum [T, 2**width + 1] (int64) of frequencies summing to
    2**16: each scaled by 2**16 / its total (floor), the remainder given to the first largest
    entry; entries past K are padded with 2**16 (empty). A table of zeros gets all-2**16 (every
    symbol empty): a decoder that lands on it reports the stream as undecodable."""
    t = tables.astype(np.int64)
    count, k = t.shape
    size = 1 << (width if width is not None else max(k - 1, 0).bit_length())
    total = t.sum(1, keepdims=True)
    freq = (t << PROB_BITS) // np.maximum(total, 1)
    rest = (1 << PROB_BITS) - freq.sum(1)
    freq[np.arange(count), t.argmax(1)] += np.where(total[:, 0] > 0, rest, 0)
    cum = np.full((count, size + 1), 1 << PROB_BITS, dtype=np.int64)
    cum[:, 0] = np.where(total[:, 0] > 0, 0, 1 << PROB_BITS)
    cum[:, 1:k + 1] = np.where(total > 0, np.cumsum(freq, 1), 1 << PROB_BITS)
    return cum


def _mag(mag32: np.ndarray, kind: int) -> np.ndarray:
    """Float32 magnitude bits -> the dtype's magnitude bits, rounded toward zero (monotone)."""
    if kind == FP32:
        return mag32
    if kind == BF16:
        return mag32 >> 16
    e = mag32 >> 23
    normal = ((e - 112) << 10) | ((mag32 >> 13) & 0x3FF)
    m = (mag32 & 0x7FFFFF) | np.where(e > 0, 0x800000, 0)
    sub = m >> np.minimum(np.maximum(126 - e, 0), 63)
    out = np.where(e >= 113, normal, np.where(e > 0, sub, 0))
    return np.where(e >= 143, np.where(mag32 > 0x7F800000, 0x7E00, 0x7C00), out)


def _ordered(v: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> (the dtype's ordered integer, rounded toward zero; its magnitude bits)."""
    bits = v.astype(np.float32).view(np.uint32).astype(np.int64)
    mag = _mag(bits & 0x7FFFFFFF, kind)
    return np.where(bits >> 31 != 0, -mag - 1, mag), mag


def plan(code: np.ndarray, scale: np.ndarray, zero: np.ndarray, fmt: tuple[int, int, int, int]
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each element's bin from its pool code and float32 scale and zero, as both sides compute
    it: (lowest ordered integer, count, narrow, exponent field of the larger magnitude). The
    bin is code * scale + zero +- scale / 2 in float32 (two roundings, as the pool dequantizes)."""
    kind, _, mantissa, margin = fmt
    p = code.astype(np.float32) * scale + zero
    h = scale * np.float32(0.5)
    a, b = p - h, p + h
    oa, ma = _ordered(a, kind)
    ob, mb = _ordered(b, kind)
    low = oa - margin
    count = ob - oa + 2 * margin + 1
    narrow = ~((a < 0) & (b > 0)) & (count >= 1) & (count <= NARROW_LIMIT)
    return low, count, narrow, np.maximum(ma, mb) >> mantissa


class _Lanes:
    """Every lane's coder states and read position, one numpy row per lane: symbol j of a lane
    uses state j % STATES (`state` below), and a state that falls below L reads the lane's
    next word."""

    def __init__(self, words: np.ndarray, starts: np.ndarray) -> None:
        self.words = np.concatenate([words.astype(np.int64), np.zeros(2 * STATES, np.int64)])
        first = starts[:-1].astype(np.int64)
        self.end = starts[1:].astype(np.int64)
        self.bad = self.end - first < 2 * STATES
        at = np.minimum(first, len(words))[:, None] + 2 * np.arange(STATES)
        self.x = (self.words[at] << 16) | self.words[at + 1]
        self.ptr = first + 2 * STATES
        self.state = 0

    def _advance(self, active: np.ndarray, x: np.ndarray) -> None:
        low = active & (x < RANS_L)
        word = self.words[np.minimum(self.ptr, len(self.words) - 1)]
        self.x[:, self.state] = np.where(active, np.where(low, (x << 16) | word, x),
                                         self.x[:, self.state])
        self.ptr += low

    def table(self, active: np.ndarray, cum: np.ndarray, rows: np.ndarray) -> np.ndarray:
        x = self.x[:, self.state]
        slot = x & 0xFFFF
        s = (cum[rows, 1:] <= slot[:, None]).sum(1)
        lo, hi = cum[rows, s], cum[rows, np.minimum(s + 1, cum.shape[1] - 1)]
        self.bad |= active & (hi <= lo)
        self._advance(active, (hi - lo) * (x >> 16) + slot - lo)
        return s

    def raw(self, active: np.ndarray, k: np.ndarray | int) -> np.ndarray:
        """`k` raw bits (k <= 16)."""
        x = self.x[:, self.state].copy()
        self._advance(active & (np.asarray(k) > 0), x >> k)
        return x & ((1 << k) - 1)

    def bits(self, active: np.ndarray, bits: int) -> np.ndarray:
        """`bits` raw bits, the low 16 first."""
        v = self.raw(active, min(bits, 16))
        return v | self.raw(active, bits - 16) << 16 if bits > 16 else v

    def uniform(self, active: np.ndarray, size: np.ndarray) -> np.ndarray:
        """A symbol in [0, size): the high part near-uniform, then the low k bits raw."""
        k = np.maximum(_bit_length(size - 1) - UNIFORM_BITS, 0)
        nh = ((size - 1) >> k) + 1
        x = self.x[:, self.state]
        slot = x & 0xFFFF
        s = ((slot + 1) * nh - 1) >> 16
        lo, hi = UNIFORM_CUM[nh, s], UNIFORM_CUM[nh, s + 1]
        self._advance(active, (hi - lo) * (x >> 16) + slot - lo)
        return s << k | self.raw(active, k)

    def done(self) -> bool:
        """Whether every lane ended with its states at L and exactly its words read."""
        return bool((~self.bad & (self.x == RANS_L).all(1) & (self.ptr == self.end)).all())


def _bit_length(v: np.ndarray) -> np.ndarray:
    return np.frexp(np.maximum(v, 0).astype(np.float64))[1].astype(np.int64)


def lane_map(pairs: np.ndarray, channels: int,
             lane_channels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The lanes of the (layer, kind) pairs `pairs` ([P, 2]) in stream order: each lane's
    pair, first channel and channel count."""
    per = -(-channels // lane_channels)
    first = np.tile(np.arange(per) * lane_channels, len(pairs))
    return (np.repeat(np.arange(len(pairs)), per), first,
            np.minimum(channels - first, lane_channels))


def code_index(kind: np.ndarray, t: int, c: np.ndarray, channels: int,
               group: int) -> np.ndarray:
    """Token t, channel c's position in a layer's K ([n/g, H, D, g]) or V ([n, H, D]) codes."""
    return np.where(kind == 0, ((t // group) * channels + c) * group + t % group,
                    t * channels + c)


def meta_index(kind: np.ndarray, t: int, c: np.ndarray, channels: int, group: int,
               v_group: int) -> np.ndarray:
    """Its scale's and zero's position in K meta ([n/g, H, D]) or V meta ([n, H, D / v_group])."""
    return np.where(kind == 0, (t // group) * channels + c,
                    t * (channels // v_group) + c // v_group)


def decode_level_ref(words: np.ndarray, starts: np.ndarray, cum: np.ndarray,
                     pairs: np.ndarray, table_base: np.ndarray, widths: np.ndarray,
                     by_code: bool, codes: np.ndarray, tokens: int, group: int,
                     lane_channels: int) -> bool:
    """Append one level's bits to `codes` ([L, 2, n * H * D] uint8, the previous level's codes
    in the pool layout). `pairs` [P, 2]: the coded (layer, kind) pairs in lane order;
    `table_base[p]`: the first table of pair p (tables per channel, or per previous code when
    `by_code`); `cum` from `normalize`. False when the lanes do not decode."""
    channels = codes.shape[2] // tokens
    rows, first, count = lane_map(pairs, channels, lane_channels)
    lanes = _Lanes(words, starts)
    layer, kind = pairs[rows, 0], pairs[rows, 1]
    for j in range(int(count.max(initial=0)) * tokens):
        lanes.state = j % STATES
        active = j < count * tokens
        c = first + np.minimum(j // tokens, count - 1)
        at = code_index(kind, j % tokens, c, channels, group)
        old = codes[layer, kind, at].astype(np.int64)
        table = table_base[rows] + (old if by_code else c)
        s = lanes.table(active, cum, np.where(active, table, 0))
        codes[layer[active], kind[active], at[active]] = (old << widths[layer] | s)[active]
    return lanes.done()


def decode_exact_ref(words: np.ndarray, starts: np.ndarray, exp_cum: np.ndarray,
                     layers: np.ndarray, codes: np.ndarray, scales: np.ndarray,
                     zeros: np.ndarray, fmt: tuple[int, int, int, int], tokens: int,
                     group: int, v_group: int, lane_channels: int,
                     out: np.ndarray) -> bool:
    """The exact part's residual lanes of `layers` (both kinds each, in lane order): unsigned
    bit patterns into `out` ([2 * L, n * H * D]: a layer's keys, then its values). `codes`
    [L, 2, n * H * D] are the pool level's; `scales`, `zeros` [L, 2, M] float32, each element's
    at `meta_index`; `exp_cum` [L, 33] the exponent tables. False when the lanes do not decode.
    Per element (after `plan`): a narrow bin's offset (uniform over count + 1, the last an
    escape), or a wide bin's exponent below its top (table) then sign and mantissa (raw);
    after an escape, the raw bits."""
    bits, mantissa = fmt[1], fmt[2]
    channels = codes.shape[2] // tokens
    pairs = np.stack([np.repeat(layers, 2), np.tile([0, 1], len(layers))], 1)
    rows, first, count = lane_map(pairs, channels, lane_channels)
    lanes = _Lanes(words, starts)
    layer, kind = pairs[rows, 0], pairs[rows, 1]
    for j in range(int(count.max(initial=0)) * tokens):
        lanes.state = j % STATES
        active = j < count * tokens
        t, c = j % tokens, first + np.minimum(j // tokens, count - 1)
        meta = meta_index(kind, t, c, channels, group, v_group)
        low, n, narrow, top = plan(codes[layer, kind, code_index(kind, t, c, channels, group)],
                                   scales[layer, kind, meta], zeros[layer, kind, meta], fmt)
        n = np.where(narrow, n, 1)
        off = lanes.uniform(active & narrow, n + 1)
        sym = lanes.table(active & ~narrow, exp_cum, layer)
        ok = ~narrow & (sym < ESCAPE)
        sm = lanes.bits(active & ok, mantissa + 1)
        escaped = (narrow & (off >= n)) | (~narrow & ~ok)
        raw = lanes.bits(active & escaped, bits)
        o = low + off
        from_offset = np.where(o < 0, (-o - 1) | (1 << (bits - 1)), o)
        from_exponent = ((sm >> mantissa) << (bits - 1)) | (top - sym) << mantissa | (
            sm & ((1 << mantissa) - 1))
        u = np.where(escaped, raw, np.where(narrow, from_offset, from_exponent))
        target = layer * 2 + kind
        out[target[active], (t * channels + c)[active]] = u[active]
    return lanes.done()
