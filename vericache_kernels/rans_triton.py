"""The rANS lanes on a GPU: Triton kernels decoding a level part's or the exact part's lanes,
`BLOCK` lanes per program, one lane per vector element (the algorithm of `rans_ref.py`, whose
numpy decoders these are tested against, bit for bit).

A lane's four states are four vectors; the loop walks the lanes' symbols in step, masking
lanes that have ended. Float arithmetic of the exact part's bins runs with FMA fusion off
(`enable_fp_fusion=False`): the bins must be the CPU's float32 multiply-then-add, bit for bit.
The host side (`decode_level_triton`, `decode_exact_triton`) takes the arrays the codec's
parser produces, as torch tensors on the GPU.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .rans_ref import (
    ESCAPE,
    EXP_SYMBOLS,
    NARROW_LIMIT,
    RANS_L,
    STATES,
    UNIFORM_BITS,
    UNIFORM_CUM,
    lane_map,
)

BLOCK = 32


@triton.jit
def _renorm(x, ptr, words_ptr, last, active):
    low = active & (x < RANS_L)
    w = tl.load(words_ptr + tl.minimum(ptr, last), mask=low, other=0).to(tl.int64)
    return tl.where(low, (x << 16) | w, x), ptr + low.to(tl.int64)


@triton.jit
def _table(x, ptr, words_ptr, last, active, cum_ptr, row, STEPS: tl.constexpr):
    """(symbol, state, read position, empty-table flag): binary search of row `row`."""
    slot = x & 0xFFFF
    base = row * ((1 << STEPS) + 1)
    s = tl.zeros_like(x)
    for k in tl.static_range(STEPS):
        step = 1 << (STEPS - 1 - k)
        c = tl.load(cum_ptr + base + s + step, mask=active, other=1 << 17)
        s = tl.where(slot >= c, s + step, s)
    lo = tl.load(cum_ptr + base + s, mask=active, other=0)
    f = tl.load(cum_ptr + base + s + 1, mask=active, other=1) - lo
    x2 = tl.where(active, f * (x >> 16) + slot - lo, x)
    x2, ptr = _renorm(x2, ptr, words_ptr, last, active)
    return s, x2, ptr, active & (f <= 0)


@triton.jit
def _raw(x, ptr, words_ptr, last, active, k):
    v = x & ((tl.full(x.shape, 1, tl.int64) << k) - 1)
    on = active & (k > 0)
    x2, ptr = _renorm(tl.where(on, x >> k, x), ptr, words_ptr, last, on)
    return v, x2, ptr


@triton.jit
def _state(words_ptr, at, last, live):
    """A lane's initial state: its two words at `at`."""
    return (tl.load(words_ptr + tl.minimum(at, last), mask=live, other=1).to(tl.int64) << 16) | \
        tl.load(words_ptr + tl.minimum(at + 1, last), mask=live, other=0).to(tl.int64)


@triton.jit
def _lanes(words_ptr, last, starts_ptr, lane_pair_ptr, lane_first_ptr, lane_count_ptr,
           pair_layer_ptr, pair_kind_ptr, n_lanes, BLOCK: tl.constexpr):
    """The program's lanes, as both kernels start them: each lane's index, whether it is live,
    where its words end, its (layer, kind) pair, first channel and channel count, layer, kind,
    whether it is too short for its states, its four initial states, and where its words go on."""
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lane < n_lanes
    start = tl.load(starts_ptr + lane, mask=live, other=0)
    end = tl.load(starts_ptr + lane + 1, mask=live, other=0)
    pair = tl.load(lane_pair_ptr + lane, mask=live, other=0)
    first = tl.load(lane_first_ptr + lane, mask=live, other=0)
    count = tl.load(lane_count_ptr + lane, mask=live, other=0)
    layer = tl.load(pair_layer_ptr + pair, mask=live, other=0)
    kind = tl.load(pair_kind_ptr + pair, mask=live, other=0)
    bad = live & (end - start < 2 * STATES)
    ptr = start + 2 * STATES
    return (lane, live, end, pair, first, count, layer, kind, bad,
            _state(words_ptr, start, last, live), _state(words_ptr, start + 2, last, live),
            _state(words_ptr, start + 4, last, live), _state(words_ptr, start + 6, last, live),
            ptr)


@triton.jit
def _finish(x0, x1, x2, x3, ptr, end, bad, bad_ptr, lane, live):
    """A lane decoded well when its four states are back at the start value and it read its
    words exactly: store whether it did not."""
    ok = (x0 == RANS_L) & (x1 == RANS_L) & (x2 == RANS_L) & (x3 == RANS_L) & (ptr == end)
    tl.store(bad_ptr + lane, (bad | ~ok).to(tl.int8), mask=live)


@triton.jit
def _level_kernel(words_ptr, last, starts_ptr, cum_ptr, lane_pair_ptr, lane_first_ptr,
                  lane_count_ptr, pair_layer_ptr, pair_kind_ptr, table_base_ptr, widths_ptr,
                  codes_ptr, bad_ptr, n_lanes, max_len, codes_per_kind, tokens, channels,
                  group, BY_CODE: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    lane, live, end, pair, first, count, layer, kind, bad, x0, x1, x2, x3, ptr = _lanes(
        words_ptr, last, starts_ptr, lane_pair_ptr, lane_first_ptr, lane_count_ptr,
        pair_layer_ptr, pair_kind_ptr, n_lanes, BLOCK)
    base = tl.load(table_base_ptr + pair, mask=live, other=0)
    width = tl.load(widths_ptr + layer, mask=live, other=0)
    out = codes_ptr + (layer * 2 + kind) * codes_per_kind
    for j0 in range(0, max_len, STATES):
        for q in tl.static_range(STATES):
            j = j0 + q
            active = live & (j < count * tokens)
            t = j % tokens
            c = first + tl.minimum(j // tokens, count - 1)
            at = tl.where(kind == 0, ((t // group) * channels + c) * group + t % group,
                          t * channels + c)
            old = tl.load(out + at, mask=active, other=0).to(tl.int64)
            row = base + old if BY_CODE else base + c
            x = x0 if q == 0 else x1 if q == 1 else x2 if q == 2 else x3
            s, x, ptr, empty = _table(x, ptr, words_ptr, last, active, cum_ptr, row, STEPS)
            bad |= empty
            tl.store(out + at, ((old << width) | s).to(tl.uint8), mask=active)
            if q == 0:
                x0 = x
            elif q == 1:
                x1 = x
            elif q == 2:
                x2 = x
            else:
                x3 = x
    _finish(x0, x1, x2, x3, ptr, end, bad, bad_ptr, lane, live)


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def decode_level_triton(words: np.ndarray, starts: np.ndarray, cum: np.ndarray,
                        pairs: np.ndarray, table_base: np.ndarray, widths: np.ndarray,
                        by_code: bool, codes: torch.Tensor, tokens: int, group: int,
                        lane_channels: int, block: int = BLOCK) -> bool:
    """`rans_ref.decode_level_ref` with `codes` a uint8 tensor on the kernel's device
    (updated in place); the other arrays are numpy, as the codec's parser makes them. `block`:
    lanes per program (a power of two; the interpreter runs one wide program fastest)."""
    device = codes.device
    channels = codes.shape[2] // tokens
    rows, first, count = lane_map(pairs, channels, lane_channels)
    lanes = len(rows)
    if lanes == 0:
        return True
    steps = (cum.shape[1] - 1).bit_length() - 1
    bad = torch.zeros(lanes, dtype=torch.int8, device=device)
    _level_kernel[(triton.cdiv(lanes, block),)](
        _tensor(words.astype(np.int32), device), max(len(words) - 1, 0),
        _tensor(starts, device), _tensor(cum, device), _tensor(rows, device),
        _tensor(first, device), _tensor(count, device), _tensor(pairs[:, 0], device),
        _tensor(pairs[:, 1], device), _tensor(table_base, device), _tensor(widths, device),
        codes, bad, lanes, int(count.max()) * tokens, codes.shape[2], tokens, channels, group,
        BY_CODE=by_code, STEPS=steps, BLOCK=block)
    return not bool(bad.any())


@triton.jit
def _mag(mag32, KIND: tl.constexpr):
    """rans_ref._mag: float32 magnitude bits -> the dtype's, toward zero."""
    if KIND == 2:
        return mag32
    elif KIND == 0:
        return mag32 >> 16
    else:
        e = mag32 >> 23
        normal = ((e - 112) << 10) | ((mag32 >> 13) & 0x3FF)
        m = (mag32 & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
        sub = m >> tl.minimum(tl.maximum(126 - e, 0), 63)
        out = tl.where(e >= 113, normal, tl.where(e > 0, sub, 0))
        return tl.where(e >= 143, tl.where(mag32 > 0x7F800000, 0x7E00, 0x7C00), out)


@triton.jit
def _bit_length(v):
    n = tl.zeros_like(v)
    for k in tl.static_range(6):
        step = 32 >> k
        big = (v >> step) > 0
        n = tl.where(big, n + step, n)
        v = tl.where(big, v >> step, v)
    return n + (v > 0).to(tl.int64)


@triton.jit
def _exact_kernel(words_ptr, last, starts_ptr, exp_cum_ptr, lane_pair_ptr, lane_first_ptr,
                  lane_count_ptr, pair_layer_ptr, pair_kind_ptr, codes_ptr, scales_ptr,
                  zeros_ptr, ucum_ptr, out_ptr, bad_ptr, n_lanes, max_len, codes_per_kind,
                  meta_per_kind, tokens, channels, group, v_group,
                  KIND: tl.constexpr, BITS: tl.constexpr, MANTISSA: tl.constexpr,
                  MARGIN: tl.constexpr, BLOCK: tl.constexpr):
    lane, live, end, pair, first, count, layer, kind, bad, x0, x1, x2, x3, ptr = _lanes(
        words_ptr, last, starts_ptr, lane_pair_ptr, lane_first_ptr, lane_count_ptr,
        pair_layer_ptr, pair_kind_ptr, n_lanes, BLOCK)
    slab = layer * 2 + kind
    sign = 1 << (BITS - 1)
    for j0 in range(0, max_len, STATES):
        for q in tl.static_range(STATES):
            j = j0 + q
            active = live & (j < count * tokens)
            t = j % tokens
            c = first + tl.minimum(j // tokens, count - 1)
            at = tl.where(kind == 0, ((t // group) * channels + c) * group + t % group,
                          t * channels + c)
            m = tl.where(kind == 0, (t // group) * channels + c,
                         t * (channels // v_group) + c // v_group)
            code = tl.load(codes_ptr + slab * codes_per_kind + at, mask=active, other=0)
            scale = tl.load(scales_ptr + slab * meta_per_kind + m, mask=active, other=0.0)
            zero = tl.load(zeros_ptr + slab * meta_per_kind + m, mask=active, other=0.0)
            # the bin (rans_ref.plan)
            p = code.to(tl.float32) * scale + zero
            h = scale * 0.5
            a = p - h
            b = p + h
            ab = a.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
            bb = b.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
            ma = _mag(ab & 0x7FFFFFFF, KIND)
            mb = _mag(bb & 0x7FFFFFFF, KIND)
            oa = tl.where((ab >> 31) != 0, -ma - 1, ma)
            ob = tl.where((bb >> 31) != 0, -mb - 1, mb)
            n = ob - oa + 2 * MARGIN + 1
            narrow = ~((a < 0) & (b > 0)) & (n >= 1) & (n <= NARROW_LIMIT)
            top = tl.maximum(ma, mb) >> MANTISSA
            low = oa - MARGIN
            n = tl.where(narrow, n, 1)
            x = x0 if q == 0 else x1 if q == 1 else x2 if q == 2 else x3
            # narrow: the offset, uniform over n + 1 (high part near-uniform, then k raw bits)
            on = active & narrow
            size = n + 1
            k = tl.maximum(_bit_length(size - 1) - UNIFORM_BITS, 0)
            nh = ((size - 1) >> k) + 1
            slot = x & 0xFFFF
            hi = ((slot + 1) * nh - 1) >> 16
            lo = tl.load(ucum_ptr + nh * ((1 << UNIFORM_BITS) + 1) + hi, mask=on, other=0)
            f = tl.load(ucum_ptr + nh * ((1 << UNIFORM_BITS) + 1) + hi + 1, mask=on,
                        other=1) - lo
            x = tl.where(on, f * (x >> 16) + slot - lo, x)
            x, ptr = _renorm(x, ptr, words_ptr, last, on)
            v, x, ptr = _raw(x, ptr, words_ptr, last, on, k)
            off = (hi << k) | v
            # wide: the exponent below the top (table), then sign and mantissa
            wide = active & ~narrow
            sym, x, ptr, empty = _table(x, ptr, words_ptr, last, wide, exp_cum_ptr, layer, 5)
            bad |= empty
            ok = wide & (sym < ESCAPE)
            if MANTISSA + 1 > 16:
                sm, x, ptr = _raw(x, ptr, words_ptr, last, ok, tl.full(x.shape, 16, tl.int64))
                sm2, x, ptr = _raw(x, ptr, words_ptr, last, ok,
                                   tl.full(x.shape, MANTISSA + 1 - 16, tl.int64))
                sm = sm | (sm2 << 16)
            else:
                sm, x, ptr = _raw(x, ptr, words_ptr, last, ok,
                                  tl.full(x.shape, MANTISSA + 1, tl.int64))
            escaped = active & ((narrow & (off >= n)) | (~narrow & (sym >= ESCAPE)))
            if BITS > 16:
                r, x, ptr = _raw(x, ptr, words_ptr, last, escaped,
                                 tl.full(x.shape, 16, tl.int64))
                r2, x, ptr = _raw(x, ptr, words_ptr, last, escaped,
                                  tl.full(x.shape, BITS - 16, tl.int64))
                r = r | (r2 << 16)
            else:
                r, x, ptr = _raw(x, ptr, words_ptr, last, escaped,
                                 tl.full(x.shape, BITS, tl.int64))
            o = low + off
            from_offset = tl.where(o < 0, (-o - 1) | sign, o)
            from_exponent = ((sm >> MANTISSA) << (BITS - 1)) | ((top - sym) << MANTISSA) | (
                sm & ((1 << MANTISSA) - 1))
            u = tl.where(escaped, r, tl.where(narrow, from_offset, from_exponent))
            tl.store(out_ptr + slab * codes_per_kind + t * channels + c, u, mask=active)
            if q == 0:
                x0 = x
            elif q == 1:
                x1 = x
            elif q == 2:
                x2 = x
            else:
                x3 = x
    _finish(x0, x1, x2, x3, ptr, end, bad, bad_ptr, lane, live)


def decode_exact_triton(words: np.ndarray, starts: np.ndarray, exp_cum: np.ndarray,
                        layers: np.ndarray, codes: torch.Tensor, scales: np.ndarray,
                        zeros: np.ndarray, fmt: tuple[int, int, int, int], tokens: int,
                        group: int, v_group: int, lane_channels: int,
                        out: torch.Tensor, block: int = BLOCK) -> bool:
    """`rans_ref.decode_exact_ref` with `codes` (uint8) and `out` (int64, written) tensors on
    the kernel's device; the other arrays are numpy, as the codec's parser makes them."""
    device = codes.device
    channels = codes.shape[2] // tokens
    pairs = np.stack([np.repeat(layers, 2), np.tile([0, 1], len(layers))], 1)
    rows, first, count = lane_map(pairs, channels, lane_channels)
    lanes = len(rows)
    if lanes == 0:
        return True
    assert exp_cum.shape[1] == EXP_SYMBOLS + 1
    kind, bits, mantissa, margin = fmt
    bad = torch.zeros(lanes, dtype=torch.int8, device=device)
    _exact_kernel[(triton.cdiv(lanes, block),)](
        _tensor(words.astype(np.int32), device), max(len(words) - 1, 0),
        _tensor(starts, device), _tensor(exp_cum, device), _tensor(rows, device),
        _tensor(first, device), _tensor(count, device), _tensor(pairs[:, 0], device),
        _tensor(pairs[:, 1], device), codes, _tensor(scales, device), _tensor(zeros, device),
        _tensor(UNIFORM_CUM, device), out, bad, lanes, int(count.max()) * tokens,
        codes.shape[2], scales.shape[2], tokens, channels, group, v_group,
        KIND=kind, BITS=bits, MANTISSA=mantissa, MARGIN=margin, BLOCK=block,
        enable_fp_fusion=False)
    return not bool(bad.any())
