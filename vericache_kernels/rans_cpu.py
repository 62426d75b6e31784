"""The rANS lanes on a CPU core: numba-compiled encoder and decoder of the codec's level and
exact parts (the definitions and the numpy reference are in `rans_ref.py`).

Every function is compiled for its one signature when this module is imported and cached on
disk (`cache=True`, in `__pycache__` beside this file or `NUMBA_CACHE_DIR`): the first import on
a machine compiles (about 20 s), later ones load the cache (well under a second). The codec
imports this module, so a server or codec process pays that when it starts, never on a request.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.cpython.unsafe.numbers import leading_zeros
from numba.extending import intrinsic

from .rans_ref import (
    BF16,
    ESCAPE,
    EXP_SYMBOLS,
    FP32,
    NARROW_LIMIT,
    PROB_BITS,
    RANS_L,
    STATES,
    UNIFORM_BITS,
    UNIFORM_CUM,
)

_jit = numba.njit(cache=True, nogil=True)
_LOW = np.int64(RANS_L)
_UCUM = UNIFORM_CUM


@_jit
def _bit_length(v: int) -> int:
    return 64 - leading_zeros(np.uint64(v))


# -- the element model of the exact part (rans_ref.plan, one element) -------------------------

@intrinsic
def _f32_bits(typingctx, v):  # noqa: ARG001 (numba's intrinsic signature)
    """A float32's bit pattern (an LLVM bitcast: no array round trip per element)."""
    def codegen(context, builder, signature, args):  # noqa: ARG001
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@_jit
def _mag(mag32: int, kind: int) -> int:
    if kind == FP32:
        return mag32
    if kind == BF16:
        return mag32 >> 16
    e = mag32 >> 23
    if e >= 143:
        return 0x7E00 if mag32 > 0x7F800000 else 0x7C00
    if e >= 113:
        return ((e - 112) << 10) | ((mag32 >> 13) & 0x3FF)
    if e == 0:
        return 0
    shift = 126 - e
    return 0 if shift > 63 else ((mag32 & 0x7FFFFF) | 0x800000) >> shift


@_jit
def _plan(code: int, scale: np.float32, zero: np.float32, kind: int, mantissa: int,
          margin: int) -> tuple[int, int, bool, int]:
    p = np.float32(code) * scale + zero
    h = scale * np.float32(0.5)
    a = p - h
    b = p + h
    ab = np.int64(_f32_bits(a))
    bb = np.int64(_f32_bits(b))
    ma = _mag(ab & 0x7FFFFFFF, kind)
    mb = _mag(bb & 0x7FFFFFFF, kind)
    oa = ma ^ -(ab >> 31)  # -ma - 1 if negative: no data-dependent branch
    ob = mb ^ -(bb >> 31)
    count = ob - oa + 2 * margin + 1
    spans_zero = (a < 0) & (b > 0)
    narrow = (count >= 1) & (count <= NARROW_LIMIT) & (not spans_zero)  # & : no branches
    return oa - margin, count, narrow, max(ma, mb) >> mantissa


# -- the coder's tables (rans_ref.normalize, one table block) -----------------------------------

@numba.njit("void(uint8[:, ::1], int64[:, ::1])", cache=True, nogil=True)
def normalize_into(tables, cum):
    """`rans_ref.normalize` of 8-bit histograms `tables` [T, K] into `cum` [T, 2**width + 1]
    (a decoder's tables, 11,520 a level-0 chunk: numpy's dozen passes over them took 3 ms).
    Each frequency is divided once (`freq`), not again for the running sum."""
    k = tables.shape[1]
    freq = np.empty(k, dtype=np.int64)
    for r in range(tables.shape[0]):
        total, top = np.int64(0), 0
        for s in range(k):
            v = np.int64(tables[r, s])
            total += v
            if v > tables[r, top]:
                top = s  # the first largest, as argmax
        cum[r, :] = 1 << PROB_BITS
        if total == 0:
            continue
        rest = np.int64(1 << PROB_BITS)
        for s in range(k):
            freq[s] = (np.int64(tables[r, s]) << PROB_BITS) // total
            rest -= freq[s]
        freq[top] += rest
        cum[r, 0] = 0
        acc = np.int64(0)
        for s in range(k):
            acc += freq[s]
            cum[r, s + 1] = acc


@numba.njit("void(uint8[::1], int64[:, ::1], int64[:, ::1])", cache=True, nogil=True)
def normalize_blocks(flat, shapes, cum):
    """`normalize_into` of each of a part's table blocks (block b: `shapes[b]` = (rows,
    symbols), one after another in `flat` and in `cum`'s rows, padded to its width): one call
    a part, where one a block cost 60 dispatches (0.3 ms) a level-0 decode."""
    pos, row = 0, 0
    for b in range(len(shapes)):
        rows, symbols = shapes[b, 0], shapes[b, 1]
        normalize_into(flat[pos:pos + rows * symbols].reshape((rows, symbols)),
                       cum[row:row + rows])
        pos += rows * symbols
        row += rows


@numba.njit("uint8[:, ::1](uint8[:, :, ::1], int64[::1], int64, int64)", cache=True, nogil=True)
def pack_codes(codes, layers, kind, bits):
    """`vericache_kernels.pack_codes` of `codes[layer, kind]` (decoded, [L, 2, n * H * D]) for
    each of `layers`, flat (the packing runs along the last axis, so flat is the same): one
    pass, a loop per width so it vectorises (torch's shift-or per lane took 3 ms a chunk)."""
    n = codes.shape[2]
    out = np.empty((len(layers), n * bits // 8), dtype=np.uint8)
    for r in range(len(layers)):
        c, o = codes[layers[r], kind], out[r]
        if bits == 8:
            o[:] = c
        elif bits == 4:
            for j in range(len(o)):
                o[j] = c[2 * j] | (c[2 * j + 1] << np.uint8(4))
        else:
            for j in range(len(o)):
                o[j] = c[4 * j] | (c[4 * j + 1] << np.uint8(2)) | (
                    c[4 * j + 2] << np.uint8(4)) | (c[4 * j + 3] << np.uint8(6))
    return out


# -- encoder: symbols are put in reverse; words come out reversed -------------------------------

@_jit
def _put(x: int, cum: int, freq: int, prec: int, out: np.ndarray, n: int) -> tuple[int, int]:
    if x >= freq << (32 - prec):
        out[n] = x & 0xFFFF
        n += 1
        x >>= 16
    return ((x // freq) << prec) + x % freq + cum, n


@_jit
def _put_raw(x: int, v: int, k: int, out: np.ndarray, n: int) -> tuple[int, int]:
    if k == 0:
        return x, n
    return _put(x, v, 1, k, out, n)


@_jit
def _put_bits(x: int, v: int, bits: int, out: np.ndarray, n: int) -> tuple[int, int]:
    """`bits` raw bits, low 16 read first (so put last)."""
    if bits > 16:
        x, n = _put_raw(x, v >> 16, bits - 16, out, n)
        return _put_raw(x, v & 0xFFFF, 16, out, n)
    return _put_raw(x, v, bits, out, n)


@_jit
def _put_uniform(x: int, s: int, size: int, out: np.ndarray, n: int) -> tuple[int, int]:
    k = max(_bit_length(size - 1) - UNIFORM_BITS, 0)
    nh = ((size - 1) >> k) + 1
    x, n = _put_raw(x, s & ((1 << k) - 1), k, out, n)
    hi = s >> k
    lo = _UCUM[nh, hi]
    return _put(x, lo, _UCUM[nh, hi + 1] - lo, PROB_BITS, out, n)


@_jit
def _finish_lane(x: np.ndarray, scratch: np.ndarray, n: int, out: np.ndarray, at: int) -> int:
    """The lane's words in reading order (the final states first) at out[at:]; returns the
    count."""
    for j in range(STATES):
        out[at + 2 * j] = x[j] >> 16
        out[at + 2 * j + 1] = x[j] & 0xFFFF
    for i in range(n):
        out[at + 2 * STATES + i] = scratch[n - 1 - i]
    return n + 2 * STATES


@_jit
def _index(kind: int, t: int, c: int, channels: int, group: int) -> int:
    """Token t, channel c's code in a layer's K ([n/g, H, D, g]) or V ([n, H, D]) codes."""
    if kind == 0:
        return ((t // group) * channels + c) * group + t % group
    return t * channels + c


@_jit
def _meta(kind: int, t: int, c: int, channels: int, group: int, v_group: int) -> int:
    """Its scale's and zero's position in K meta ([n/g, H, D]) or V meta ([n, H, D/v_group])."""
    if kind == 0:
        return (t // group) * channels + c
    return t * (channels // v_group) + c // v_group


@numba.njit(
    "Tuple((uint16[::1], int64[::1]))(uint8[:, :, ::1], int64[:, ::1], int64[:, ::1], int64[::1],"
    " int64[::1], int64[::1], int64[::1], boolean, int64, int64, int64)",
    cache=True, nogil=True)
def encode_level(codes, pairs, cum, table_base, shift, widths, prev_shift, by_code, tokens,
                 group, lane_channels):
    """Code one level's symbols: for each coded (layer, kind) in `pairs`, the pool codes
    `codes[layer, kind]` shifted right by `shift[layer]`, low `widths[layer]` bits, each with
    table `table_base[p]` + channel (or + the code shifted by `prev_shift[layer]` when
    `by_code`). Returns the lanes' words and each lane's word count."""
    channels = codes.shape[2] // tokens
    per = (channels + lane_channels - 1) // lane_channels
    lanes = len(pairs) * per
    out = np.empty(lanes * 2 * STATES + len(pairs) * codes.shape[2] * 2, dtype=np.uint16)
    counts = np.empty(lanes, dtype=np.int64)
    scratch = np.empty(lane_channels * tokens * 2 + 2, dtype=np.uint16)
    x = np.empty(STATES, dtype=np.int64)
    at = 0
    for p in range(len(pairs)):
        layer, kind = pairs[p, 0], pairs[p, 1]
        mask = (1 << widths[layer]) - 1
        for lane in range(per):
            first = lane * lane_channels
            last = min(first + lane_channels, channels)
            x[:] = _LOW
            n = 0
            for j in range((last - first) * tokens - 1, -1, -1):
                c, t = first + j // tokens, j % tokens
                code = np.int64(codes[layer, kind, _index(kind, t, c, channels, group)])
                s = (code >> shift[layer]) & mask
                row = table_base[p] + ((code >> prev_shift[layer]) if by_code else c)
                lo = cum[row, s]
                x[j % STATES], n = _put(x[j % STATES], lo, cum[row, s + 1] - lo, PROB_BITS,
                                        scratch, n)
            counts[p * per + lane] = _finish_lane(x, scratch, n, out, at)
            at += counts[p * per + lane]
    return out[:at], counts


@_jit
def _put_element(x: int, u: int, low: int, count: int, narrow: bool, top: int, exp_cum,
                 layer: int, bits: int, mantissa: int, scratch, n: int) -> tuple[int, int]:
    """One exact element: its offset in a narrow bin, or exponent, sign and mantissa in a wide
    one; raw bits after an escape."""
    sign_shift = bits - 1
    mag = u & ((1 << sign_shift) - 1)
    o = -mag - 1 if u >> sign_shift else mag
    if narrow:
        off = o - low
        if off < 0 or off >= count:
            x, n = _put_bits(x, u, bits, scratch, n)
            off = count
        return _put_uniform(x, off, count + 1, scratch, n)
    exponent = (u >> mantissa) & ((1 << (bits - 1 - mantissa)) - 1)
    below = top - exponent
    if exponent > 0 and 0 <= below < ESCAPE:
        sm = ((u >> sign_shift) << mantissa) | (u & ((1 << mantissa) - 1))
        x, n = _put_bits(x, sm, mantissa + 1, scratch, n)
        sym = below
    else:
        x, n = _put_bits(x, u, bits, scratch, n)
        sym = ESCAPE
    lo = exp_cum[layer, sym]
    return _put(x, lo, exp_cum[layer, sym + 1] - lo, PROB_BITS, scratch, n)


@numba.njit(
    "Tuple((uint16[::1], int64[::1]))(int64[:, ::1], int64[::1], int64[:, ::1], uint8[:, :, ::1],"
    " float32[:, :, ::1], float32[:, :, ::1], int64, int64, int64, int64, int64, int64, int64,"
    " int64)", cache=True, nogil=True)
def encode_exact(x_bits, layers, exp_cum, codes, scales, zeros, kind, bits, mantissa, margin,
                 tokens, group, v_group, lane_channels):
    """Code the exact K/V bits `x_bits` ([2 * L, n * H * D]: keys then values of each layer,
    unsigned patterns) of `layers` given the pool codes and float32 scales and zeros, with
    each layer's exponent table `exp_cum[layer]` (see `rans_ref.decode_exact_ref`)."""
    channels = codes.shape[2] // tokens
    per = (channels + lane_channels - 1) // lane_channels
    lanes = len(layers) * 2 * per
    out = np.empty(lanes * 2 * STATES + len(layers) * 2 * codes.shape[2] * 4, dtype=np.uint16)
    counts = np.empty(lanes, dtype=np.int64)
    scratch = np.empty(lane_channels * tokens * 4 + 2, dtype=np.uint16)
    x = np.empty(STATES, dtype=np.int64)
    at, lane_index = 0, 0
    for li in range(len(layers)):
        layer = layers[li]
        for kd in range(2):
            for lane in range(per):
                first = lane * lane_channels
                last = min(first + lane_channels, channels)
                x[:] = _LOW
                n = 0
                for j in range((last - first) * tokens - 1, -1, -1):
                    c, t = first + j // tokens, j % tokens
                    m = _meta(kd, t, c, channels, group, v_group)
                    low, count, narrow, top = _plan(
                        np.int64(codes[layer, kd, _index(kd, t, c, channels, group)]),
                        scales[layer, kd, m], zeros[layer, kd, m], kind, mantissa, margin)
                    x[j % STATES], n = _put_element(
                        x[j % STATES], x_bits[layer * 2 + kd, t * channels + c], low, count,
                        narrow, top, exp_cum, layer, bits, mantissa, scratch, n)
                counts[lane_index] = _finish_lane(x, scratch, n, out, at)
                at += counts[lane_index]
                lane_index += 1
    return out[:at], counts


@numba.njit(
    "int64[:, ::1](int64[:, ::1], int64[::1], uint8[:, :, ::1], float32[:, :, ::1],"
    " float32[:, :, ::1], int64, int64, int64, int64, int64, int64, int64)",
    cache=True, nogil=True)
def exponent_histogram(x_bits, layers, codes, scales, zeros, kind, bits, mantissa, margin,
                       tokens, group, v_group):
    """Per layer of `layers`, how often each exponent symbol (0..30 below the bin's top, 31
    escape) occurs in the wide bins: what `encode_exact`'s exponent tables are made from."""
    channels = codes.shape[2] // tokens
    hist = np.zeros((codes.shape[0], ESCAPE + 1), dtype=np.int64)
    emask = (1 << (bits - 1 - mantissa)) - 1
    for li in range(len(layers)):
        layer = layers[li]
        for kd in range(2):
            for t in range(tokens):
                for c in range(channels):
                    m = _meta(kd, t, c, channels, group, v_group)
                    _, _, narrow, top = _plan(
                        np.int64(codes[layer, kd, _index(kd, t, c, channels, group)]),
                        scales[layer, kd, m], zeros[layer, kd, m], kind, mantissa, margin)
                    if not narrow:
                        exponent = (x_bits[layer * 2 + kd, t * channels + c] >> mantissa) & emask
                        below = top - exponent
                        ok = exponent > 0 and 0 <= below < ESCAPE
                        hist[layer, below if ok else ESCAPE] += 1
    return hist


# -- decoder: four states per lane, advanced in turn (four independent dependency chains) -------

@_jit
def _take(x: int, words: np.ndarray, ptr: int) -> tuple[int, int]:
    """Renormalise: read a word if the state fell below L (a lane that runs past its end reads
    its neighbour's words or the last word, and is caught when it ends). Branch-free, with
    the sign of x - L as a mask: whether a word is read is data-dependent, so a branch
    mispredicts often (and numba compiles arithmetic on the comparison's bool slowly)."""
    m = (x - _LOW) >> 63
    return (x << (16 & m)) | (np.int64(words[min(ptr, len(words) - 1)]) & m), ptr - m


@_jit
def _search(cum: np.ndarray, at: np.uint64, slot: int, steps: int) -> np.uint64:
    """The symbol whose range holds `slot`: binary search of the cumulative frequencies at
    `cum[at:]` (2**steps + 1 entries). Written as plain ifs on unsigned indices, which LLVM
    turns into conditional moves without index checks (a multiply by the comparison, or signed
    indices, compiled to code several times slower)."""
    s = np.uint64(0)
    if steps >= 8 and slot >= cum[at + s + np.uint64(128)]:
        s += np.uint64(128)
    if steps >= 7 and slot >= cum[at + s + np.uint64(64)]:
        s += np.uint64(64)
    if steps >= 6 and slot >= cum[at + s + np.uint64(32)]:
        s += np.uint64(32)
    if steps >= 5 and slot >= cum[at + s + np.uint64(16)]:
        s += np.uint64(16)
    if steps >= 4 and slot >= cum[at + s + np.uint64(8)]:
        s += np.uint64(8)
    if steps >= 3 and slot >= cum[at + s + np.uint64(4)]:
        s += np.uint64(4)
    if steps >= 2 and slot >= cum[at + s + np.uint64(2)]:
        s += np.uint64(2)
    if steps >= 1 and slot >= cum[at + s + np.uint64(1)]:
        s += np.uint64(1)
    return s


@_jit
def _get_table(x: int, cum: np.ndarray, row: int, steps: int) -> tuple[int, int]:
    """(symbol, state before renormalisation; -1 for an empty table); `cum` flat, rows of
    2**steps + 1 entries."""
    at = np.uint64(row) * np.uint64((1 << steps) + 1)
    slot = x & 0xFFFF
    s = _search(cum, at, slot, steps)
    lo = cum[at + s]
    f = cum[at + s + np.uint64(1)] - lo
    return np.int64(s), f * (x >> 16) + slot - lo if f > 0 else -1


@_jit
def _get_bits(x: int, words: np.ndarray, ptr: int, bits: int) -> tuple[int, int, int]:
    """`bits` raw bits (low 16 first)."""
    k = min(bits, 16)
    v = x & ((1 << k) - 1)
    x, ptr = _take(x >> k, words, ptr)
    if bits > 16:
        k2 = bits - 16
        v |= (x & ((1 << k2) - 1)) << 16
        x, ptr = _take(x >> k2, words, ptr)
    return v, x, ptr


@_jit
def _start(words: np.ndarray, ptr: int, j: int) -> int:
    return (np.int64(words[ptr + 2 * j]) << 16) | np.int64(words[ptr + 2 * j + 1])


BLOCK = 16
"""Lanes the level decoder advances in lockstep: their 4 * BLOCK coder states are independent,
so each step's arithmetic is one loop over them that LLVM vectorises (a lane alone has four
dependency chains, a dozen dependent instructions each)."""


@_jit
def _lane_block(words, starts, flat, row_size, base, width, by_code, out, kind, lane, li, nb,
                nch, lane_channels, tokens, group, x, sym, rows, ptrs, k1, k2, k3,
                bound) -> bool:
    """Decode `nb` lanes of one pair from its lane `lane` (the stream's lane `li`), each of
    `nch` channels, in lockstep: block lane b's state q is x[4 * b + q]. False when a lane does
    not decode."""
    last = np.uint64(len(words) - 1)
    n = nb * STATES
    channels = len(out) // tokens
    # K codes [n/g, H, D, g]: a channel's g tokens in a row, then its next group's;
    # V codes [n, H, D]: a channel's tokens `channels` apart
    run, stride, jump = (group, 1, channels * group) if kind == 0 else (tokens, channels, 0)
    lane_step = lane_channels * (group if kind == 0 else 1)
    for b in range(nb):
        ptr, end = starts[li + b], starts[li + b + 1]
        if end - ptr < 2 * STATES:
            return False
        for q in range(STATES):
            x[b * STATES + q] = _start(words, ptr, q)
        ptrs[b] = ptr + 2 * STATES
    # width <= 2: the symbol and its range as arithmetic on comparisons with the table's three
    # bounds (k1..k3, per state), no loads in the vectorised loop (a binary search's dependent
    # loads do not vectorise); 3 or 4 bits (rows of 17, tables per channel): the same twice,
    # the quarter and then the symbol in it; others (wider, or 3-4 bits per code): a binary
    # search per state
    direct = width <= 2 and row_size >= 5
    quartered = not direct and width <= 4 and row_size >= 17
    empty = False
    fmin = np.int64(1)
    for cc in range(nch):
        c = lane * lane_channels + cc
        for z in range(n):  # per channel tables: each state's row
            rows[z] = np.uint64(base + c + z // STATES * lane_channels) * row_size
        if not by_code:
            for z in range(n):
                row = rows[z]
                empty |= flat[row] != 0
                if direct:
                    k1[z] = flat[row + np.uint64(1)]
                    k2[z] = flat[row + np.uint64(2)]
                    k3[z] = flat[row + np.uint64(3)]
                elif quartered:
                    for j in range(1, 17):
                        bound[j, z] = flat[row + np.uint64(j)]
        start = c * group if kind == 0 else c
        for t0 in range(0, tokens, run):
            i = start + t0 // run * jump
            for _ in range(run // STATES):
                if by_code:  # a table per previous code: each state's, every step
                    for z in range(n):
                        at = np.uint64(i + z // STATES * lane_step + z % STATES * stride)
                        row = np.uint64(base + np.int64(out[at])) * row_size
                        rows[z] = row
                        if direct:
                            empty |= flat[row] != 0
                            k1[z] = flat[row + np.uint64(1)]
                            k2[z] = flat[row + np.uint64(2)]
                            k3[z] = flat[row + np.uint64(3)]
                if direct:
                    for z in range(n):
                        v = x[z]
                        slot = v & 0xFFFF
                        e1, e2, e3 = k1[z], k2[z], k3[z]
                        b1 = np.int64(slot >= e1)
                        b2 = np.int64(slot >= e2)
                        b3 = np.int64(slot >= e3)
                        lo = b1 * e1 + b2 * (e2 - e1) + b3 * (e3 - e2)
                        f = e1 + b1 * (e2 - 2 * e1) + b2 * (e3 - 2 * e2 + e1) + b3 * (
                            (1 << PROB_BITS) - 2 * e3 + e2)
                        x[z] = f * (v >> 16) + slot - lo
                        sym[z] = b1 + b2 + b3
                elif quartered and not by_code:
                    for z in range(n):
                        v = x[z]
                        slot = v & 0xFFFF
                        # the quarter: bounds 4, 8, 12; then the symbol in it: its 3 bounds
                        h1 = np.int64(slot >= bound[4, z])
                        h2 = np.int64(slot >= bound[8, z])
                        h3 = np.int64(slot >= bound[12, z])
                        e0 = h1 * bound[4, z] + h2 * (bound[8, z] - bound[4, z]) + h3 * (
                            bound[12, z] - bound[8, z])
                        e4 = bound[4, z] + h1 * (bound[8, z] - bound[4, z]) + h2 * (
                            bound[12, z] - bound[8, z]) + h3 * (bound[16, z] - bound[12, z])
                        e1 = bound[1, z] + h1 * (bound[5, z] - bound[1, z]) + h2 * (
                            bound[9, z] - bound[5, z]) + h3 * (bound[13, z] - bound[9, z])
                        e2 = bound[2, z] + h1 * (bound[6, z] - bound[2, z]) + h2 * (
                            bound[10, z] - bound[6, z]) + h3 * (bound[14, z] - bound[10, z])
                        e3 = bound[3, z] + h1 * (bound[7, z] - bound[3, z]) + h2 * (
                            bound[11, z] - bound[7, z]) + h3 * (bound[15, z] - bound[11, z])
                        c1 = np.int64(slot >= e1)
                        c2 = np.int64(slot >= e2)
                        c3 = np.int64(slot >= e3)
                        lo = e0 + c1 * (e1 - e0) + c2 * (e2 - e1) + c3 * (e3 - e2)
                        f = e1 - e0 + c1 * (e2 - 2 * e1 + e0) + c2 * (e3 - 2 * e2 + e1) + c3 * (
                            e4 - 2 * e3 + e2)
                        x[z] = f * (v >> 16) + slot - lo
                        sym[z] = 4 * (h1 + h2 + h3) + c1 + c2 + c3
                else:
                    for z in range(n):
                        row = rows[z]
                        v = x[z]
                        slot = v & 0xFFFF
                        s = _search(flat, row, slot, width)
                        lo = flat[row + s]
                        f = flat[row + s + np.uint64(1)] - lo
                        fmin = min(fmin, f)
                        x[z] = f * (v >> 16) + slot - lo
                        sym[z] = np.int64(s)
                # renormalise: a lane's states read its words in turn (m: x < L as a mask)
                for b in range(nb):
                    ptr = ptrs[b]
                    for q in range(STATES):
                        z = b * STATES + q
                        v = x[z]
                        m = (v - _LOW) >> 63
                        x[z] = (v << (16 & m)) | (np.int64(words[min(np.uint64(ptr), last)]) & m)
                        ptr -= m
                    ptrs[b] = ptr
                for z in range(n):
                    at = np.uint64(i + z // STATES * lane_step + z % STATES * stride)
                    out[at] = (np.int64(out[at]) << width) | sym[z]
                i += STATES * stride
    if empty or fmin <= 0:
        return False
    for b in range(nb):
        if ptrs[b] != starts[li + b + 1]:
            return False
    for z in range(n):
        if x[z] != _LOW:
            return False
    return True


@numba.njit(
    "boolean(uint16[::1], int64[::1], int64[:, ::1], int64[:, ::1], int64[::1], int64[::1],"
    " boolean, uint8[:, :, ::1], int64, int64, int64)", cache=True, nogil=True)
def decode_level(words, starts, cum, pairs, table_base, widths, by_code, codes, tokens, group,
                 lane_channels):
    """Inverse of `encode_level`: shift each coded pair's codes left by its width and add the
    decoded bits. False when a lane does not decode (lands on an empty table, or does not end
    with every state at L and exactly its words read)."""
    channels = codes.shape[2] // tokens
    per = (channels + lane_channels - 1) // lane_channels
    full = channels // lane_channels
    steps = _bit_length(cum.shape[1] - 1) - 1
    row_size = np.uint64((1 << steps) + 1)
    if cum.shape[1] != row_size or steps > 8:
        return False
    flat = cum.ravel()
    slots = BLOCK * STATES
    x, sym, k1, k2, k3 = (np.empty(slots, dtype=np.int64), np.empty(slots, dtype=np.int64),
                          np.empty(slots, dtype=np.int64), np.empty(slots, dtype=np.int64),
                          np.empty(slots, dtype=np.int64))
    rows = np.empty(slots, dtype=np.uint64)
    bound = np.empty((17, slots), dtype=np.int64)  # a 4-bit table's cum[1..16] per state
    ptrs = np.empty(BLOCK, dtype=np.int64)
    for p in range(len(pairs)):
        layer, kind = pairs[p, 0], pairs[p, 1]
        width = widths[layer]
        if width > steps:
            return False
        lane = 0
        while lane < per:  # blocks of whole lanes, then a last narrower lane alone
            nb = min(BLOCK, full - lane) if lane < full else 1
            nch = lane_channels if lane < full else channels - full * lane_channels
            if not _lane_block(words, starts, flat, row_size, table_base[p], width, by_code,
                               codes[layer, kind], kind, lane, p * per + lane, nb, nch,
                               lane_channels, tokens, group, x, sym, rows, ptrs, k1, k2, k3,
                               bound):
                return False
            lane += nb
    return True


@_jit
def _bins(cs: np.ndarray, ss: np.ndarray, zs: np.ndarray, per: int, kind: int, mantissa: int,
          margin: int, low: np.ndarray, info: np.ndarray) -> None:
    """Every element's bin of one (layer, K or V), before its lanes decode: element i's scale
    and zero are at i // per (K: g, V: v_group) in both layouts. A loop of its own, outside
    the coder's dependency chains (12% less time than computing each bin in the element
    step), one scale and zero per inner loop (no division per element). `info`: the count of
    a narrow bin, -1 - the exponent field of a wide one's top."""
    for m in range(len(cs) // per):
        scale, zero = ss[m], zs[m]
        for i in range(m * per, (m + 1) * per):
            lo, count, narrow, top = _plan(np.int64(cs[i]), scale, zero, kind, mantissa, margin)
            low[i] = lo
            info[i] = count if narrow else -1 - top


@_jit
def _element(x: int, ptr: int, words, exp_cum, layer: int, low: int, info: int, bits: int,
             mantissa: int) -> tuple[int, int, int]:
    """(unsigned bits of one exact element in the bin (`low`, `info`) from `_bins`, state,
    read position); state -1 if its table is empty."""
    sign = 1 << (bits - 1)
    if info > 0:
        count = info
        size = count + 1
        k = max(_bit_length(size - 1) - UNIFORM_BITS, 0)
        nh = ((size - 1) >> k) + 1
        slot = x & 0xFFFF
        hi = ((slot + 1) * nh - 1) >> 16
        lo = _UCUM[nh, hi]
        x, ptr = _take((_UCUM[nh, hi + 1] - lo) * (x >> 16) + slot - lo, words, ptr)
        off = hi << k
        if k:
            v, x, ptr = _get_bits(x, words, ptr, k)
            off |= v
        if off < count:
            o = low + off
            return ((-o - 1) | sign) if o < 0 else o, x, ptr
    else:
        sym, x = _get_table(x, exp_cum, layer, 5)
        if x < 0:
            return 0, x, ptr
        x, ptr = _take(x, words, ptr)
        if sym < ESCAPE:
            sm, x, ptr = _get_bits(x, words, ptr, mantissa + 1)
            return ((sm >> mantissa) * sign) | ((-1 - info - sym) << mantissa) | (
                sm & ((1 << mantissa) - 1)), x, ptr
    return _get_bits(x, words, ptr, bits)


@numba.njit(
    "boolean(uint16[::1], int64[::1], int64[:, ::1], int64[::1], uint8[:, :, ::1],"
    " float32[:, :, ::1], float32[:, :, ::1], int64, int64, int64, int64, int64, int64, int64,"
    " int64, int64[:, ::1])", cache=True, nogil=True)
def decode_exact(words, starts, exp_cum, layers, codes, scales, zeros, kind, bits, mantissa,
                 margin, tokens, group, v_group, lane_channels, out):
    """Inverse of `encode_exact`: the unsigned bit patterns into `out` ([2 * L, n * H * D]).
    False when a lane does not decode."""
    channels = codes.shape[2] // tokens
    per = (channels + lane_channels - 1) // lane_channels
    if exp_cum.shape[1] != EXP_SYMBOLS + 1 or channels % v_group:
        return False
    exp_cum = exp_cum.ravel()
    low = np.empty(codes.shape[2], dtype=np.int64)
    info = np.empty(codes.shape[2], dtype=np.int64)
    lane_index = 0
    for li in range(len(layers)):
        layer = layers[li]
        for kd in range(2):
            _bins(codes[layer, kd], scales[layer, kd], zeros[layer, kd],
                  group if kd == 0 else v_group, kind, mantissa, margin, low, info)
            x_out = out[layer * 2 + kd]
            # bins in the codes' layout, as in decode_level: K runs of g tokens, V strided
            run, stride, jump = (group, 1, channels * group) if kd == 0 else (
                tokens, channels, 0)
            for lane in range(per):
                ptr, end = starts[lane_index], starts[lane_index + 1]
                lane_index += 1
                if end - ptr < 2 * STATES:
                    return False
                x0, x1 = _start(words, ptr, 0), _start(words, ptr, 1)
                x2, x3 = _start(words, ptr, 2), _start(words, ptr, 3)
                ptr += 2 * STATES
                first = lane * lane_channels
                for c in range(first, min(first + lane_channels, channels)):
                    start = c * group if kd == 0 else c
                    for t0 in range(0, tokens, run):
                        i = start + t0 // run * jump
                        t = t0
                        for _ in range(run // STATES):
                            i1, i2, i3 = i + stride, i + 2 * stride, i + 3 * stride
                            u0, x0, ptr = _element(x0, ptr, words, exp_cum, layer, low[i],
                                                   info[i], bits, mantissa)
                            u1, x1, ptr = _element(x1, ptr, words, exp_cum, layer, low[i1],
                                                   info[i1], bits, mantissa)
                            u2, x2, ptr = _element(x2, ptr, words, exp_cum, layer, low[i2],
                                                   info[i2], bits, mantissa)
                            u3, x3, ptr = _element(x3, ptr, words, exp_cum, layer, low[i3],
                                                   info[i3], bits, mantissa)
                            if min(x0, x1, x2, x3) < 0:
                                return False
                            at = t * channels + c
                            x_out[at] = u0
                            x_out[at + channels] = u1
                            x_out[at + 2 * channels] = u2
                            x_out[at + 3 * channels] = u3
                            i += STATES * stride
                            t += STATES
                if max(x0, x1, x2, x3) != _LOW or min(x0, x1, x2, x3) != _LOW or ptr != end:
                    return False
    return True
