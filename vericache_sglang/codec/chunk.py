"""CacheGen-style coding of one chunk of KV: progressive lossy levels, then the exact bits.

A chunk is `tokens` consecutive tokens of every layer ([L, n, H, D] keys and values, n a multiple
of the key group). Its stream has one part per level:

- part 0: the KIVI scales and zero points of every layer (byte planes through zstd), and the
  coarsest codes: the pool level's codes with their low bits dropped, fewer bits for deep
  layers than early ones (CacheGen's layer-wise bins);
- part i: the next bits of each code, down to the compressed pool's own bits: decoding parts
  0..i gives level i, the last lossy level being the pool's pages bit for bit;
- the last part: the exact K/V (`exact.py`).

Codes are rANS coded in independent lanes (`entropy.py`) with one table per (layer, K or V,
channel) (CacheGen's grouping) or per (layer, K or V, coarser code) (`tables="kind"`). Level
i's codes come with fp16 scales and zero points derived from the pool level's, so every level is
a KIVI tier the attention kernels read.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import zstandard

import vericache_kernels as kernels
from vericache_kernels import rans_cpu, rans_ref
from vericache_sglang.compress.quant import KiviQuantizer, QuantTier

from . import entropy, exact
from .stream import (
    Header,
    StreamError,
    StreamForeign,
    pack_sections,
    read_header,
    read_parts,
    unpack_all,
    unpack_sections,
    write_stream,
)

TABLE_GROUPINGS = ("channel", "kind")
EXACT_RESIDUAL, EXACT_PLANES = 0, 1


def layerwise_bits(num_layers: int, early: int, late: int, early_share: float = 0.25) -> list[int]:
    """`early` bits for the first `early_share` of the layers, `late` for the rest."""
    cut = math.ceil(num_layers * early_share)
    return [early if layer < cut else late for layer in range(num_layers)]


@dataclass(frozen=True)
class CodecSpec:
    """How chunks are coded. `pool_bits[layer]` are the compressed pool's bits (the last lossy
    level); `coarse` lists coarser levels, each one's bits per layer at most the next's."""

    pool_bits: tuple[int, ...]
    group: int = 32
    coarse: tuple[tuple[int, ...], ...] = ()
    tables: str = "channel"
    exact: bool = True
    zstd_level: int = 3
    chunk_tokens: int = 256
    lane_channels: int = 16
    """Channels (of one layer and kind) per rANS lane: fewer lanes cost fewer bytes (each
    carries its 4-byte final state and a directory entry), more let a GPU run more at once."""
    levels: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        levels = (*self.coarse, tuple(self.pool_bits))
        object.__setattr__(self, "levels", levels)
        if self.tables not in TABLE_GROUPINGS:
            raise ValueError(f"tables must be one of {TABLE_GROUPINGS}, got {self.tables!r}")
        for level in levels:
            if len(level) != len(self.pool_bits):
                raise ValueError("every level needs one bit width per layer")
            if any(b not in kernels.SUPPORTED_BITS for b in level):
                raise ValueError(f"level bits must be one of {kernels.SUPPORTED_BITS} (what the "
                                 f"attention kernels read), got {level}")
        for coarse, fine in zip(levels, levels[1:], strict=False):
            if any(c > f for c, f in zip(coarse, fine, strict=True)):
                raise ValueError("each level must have at most the next level's bits per layer")
        if self.group % rans_ref.STATES:
            raise ValueError(f"the group ({self.group}) must be a multiple of "
                             f"{rans_ref.STATES} (a lane's interleaved coder states)")
        if self.lane_channels < 1:
            raise ValueError(f"lane_channels must be positive, got {self.lane_channels}")
        if self.chunk_tokens % self.group:
            raise ValueError(f"chunk_tokens ({self.chunk_tokens}) must be a multiple of the "
                             f"group ({self.group})")

    @classmethod
    def for_compressor(cls, compressor: KiviQuantizer, num_layers: int, *,
                       coarse: tuple[int, int] | None = (4, 2), **kwargs) -> CodecSpec:
        """The spec whose last lossy level is `compressor`'s pool pages; `coarse` = (early,
        late) bits of one coarser level (None: none), capped at the pool's bits."""
        plans = [compressor.plan(layer) for layer in range(num_layers)]
        pool = tuple(plan.old_bits for plan in plans)
        levels = ()
        if coarse is not None:
            level = tuple(min(b, p) for b, p in zip(layerwise_bits(num_layers, *coarse), pool,
                                                    strict=True))
            levels = (level,) if level != pool else ()
        return cls(pool, group=plans[0].group, coarse=levels, **kwargs)


@dataclass
class DecodedChunk:
    header: Header
    level: int
    """Index of the lossy level decoded, or len(levels) for the exact KV."""
    tiers: list[QuantTier]
    """Per layer, the codes of `level` (the pool level when the exact KV was decoded)."""
    keys: torch.Tensor | None = None
    """[L, n, H, D] exact keys, when the whole stream was decoded."""
    values: torch.Tensor | None = None


def _codes(tier: QuantTier) -> tuple[torch.Tensor, torch.Tensor]:
    return (kernels.unpack_codes(tier.k_codes, tier.bits),
            kernels.unpack_codes(tier.v_codes, tier.bits))


def _coarse_meta(scale: torch.Tensor, zero: torch.Tensor,
                 shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scale and zero point of bins `1 << shift` times wider, the zero at the coarse bin's
    centre."""
    s = scale.float()
    return (s * (1 << shift)).half(), (zero.float() + s * ((1 << shift) - 1) / 2).half()


def coarser(tier: QuantTier, bits: int) -> QuantTier:
    """The tier with its codes' low bits dropped: scales grow and zero points move to the centre
    of each coarse bin (fp16, as the pool stores them)."""
    shift = tier.bits - bits
    if shift == 0:
        return tier
    kc, vc = _codes(tier)
    return QuantTier(bits, kernels.pack_codes(kc >> shift, bits),
                     *_coarse_meta(tier.k_scale, tier.k_zero, shift),
                     kernels.pack_codes(vc >> shift, bits),
                     *_coarse_meta(tier.v_scale, tier.v_zero, shift))


def finer(tier: QuantTier, bits: int) -> QuantTier:
    """The tier's values at `bits` bits (at least its own), unchanged: codes shifted up, scales
    divided by the same power of two (exact in fp16), zero points kept. A coarse level read
    alone fills the compressed pool's pages, which have the pool's bits, this way."""
    shift = bits - tier.bits
    if shift == 0:
        return tier
    kc, vc = _codes(tier)
    return QuantTier(bits, kernels.pack_codes(kc << shift, bits), tier.k_scale / (1 << shift),
                     tier.k_zero, kernels.pack_codes(vc << shift, bits),
                     tier.v_scale / (1 << shift), tier.v_zero)


def _meta_bytes(tiers: list[QuantTier], level: int) -> bytes:
    meta = torch.cat([t.flatten() for tier in tiers for t in
                      (tier.k_scale, tier.k_zero, tier.v_scale, tier.v_zero)])
    return exact.encode_planes(meta, level)


@dataclass(frozen=True)
class LevelPlan:
    """What level `index`'s part codes, from the header: the coded (layer, kind) pairs [P, 2],
    each layer's new bits (`widths`) and the bits before them (`prev`), each pair's table block
    as (rows, symbols) [P, 2], and whether tables are per coarser code (else per channel)."""

    pairs: np.ndarray
    widths: np.ndarray
    prev: np.ndarray
    shapes: np.ndarray
    by_code: bool

    @property
    def widest(self) -> int:
        """The widest coded pair's bits: the coder's table rows are padded to it."""
        return int(self.widths[self.pairs[:, 0]].max()) if len(self.pairs) else 0


class Geometry:
    """Shapes of one chunk, from the header."""

    def __init__(self, header: Header) -> None:
        self.header = header
        self.fmt = exact.float_format(header.dtype)
        if header.group % rans_ref.STATES or header.lane_channels < 1:
            raise StreamForeign(f"KV stream group {header.group} or lanes of "
                                f"{header.lane_channels} channels: not this codec's")
        n, h, d, g = header.tokens, header.heads, header.head_dim, header.group
        self.k_codes = (n // g, h, d, g)
        self.v_codes = (n, h, d)
        self.k_meta = (n // g, h, d)
        self.v_meta = (n, h, d // header.v_group)
        self.channels = h * d
        self.codes = n * h * d
        """Codes (and elements) per layer and kind."""
        self.lanes_per_pair = -(-self.channels // header.lane_channels)
        self.channel_of = _channel_of(n, self.channels, g)
        self._levels: dict[int, LevelPlan] = {}

    def level(self, index: int) -> LevelPlan:
        """Level `index`'s plan, made once (numpy's small calls cost 0.2 ms a decode)."""
        if index not in self._levels:
            levels = self.header.levels
            bits = np.asarray(levels[index], dtype=np.int64)
            prev = np.asarray(levels[index - 1] if index else [0] * len(bits), dtype=np.int64)
            widths = bits - prev
            layers = np.repeat(np.flatnonzero(widths > 0), 2)
            pairs = np.stack([layers, np.arange(len(layers)) % 2], 1)
            by_code = self.header.tables == "kind" and index > 0
            rows = (1 << prev[layers]) if by_code else np.full(len(layers), self.channels)
            shapes = np.stack([rows, 1 << widths[layers]], 1)
            self._levels[index] = LevelPlan(np.ascontiguousarray(pairs, dtype=np.int64), widths,
                                            prev, np.ascontiguousarray(shapes, dtype=np.int64),
                                            by_code)
        return self._levels[index]


@functools.lru_cache(maxsize=16)
def _channel_of(tokens: int, channels: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Each K and V code's channel, in the pool layout (a chunk shape's, made once)."""
    n = tokens * channels
    return (np.arange(n) // group % channels, np.arange(n) % channels)


def _cum(flat: np.ndarray, plan: LevelPlan) -> tuple[np.ndarray, np.ndarray]:
    """The coder's tables of a part's table blocks (`flat`: uint8, one block after another),
    padded to its widest, and each block's first row."""
    rows = plan.shapes[:, 0]
    base = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(rows[:-1], out=base[1:])
    cum = np.empty((int(rows.sum()), (1 << plan.widest) + 1), dtype=np.int64)
    rans_cpu.normalize_blocks(flat, plan.shapes, cum)
    return cum, base


def _layer_codes(tiers: list[QuantTier]) -> np.ndarray:
    """uint8 [L, 2, n * H * D]: every layer's K and V pool codes in the pool layout."""
    return np.stack([np.stack([kernels.unpack_codes(tier.k_codes, tier.bits).numpy().ravel(),
                               kernels.unpack_codes(tier.v_codes, tier.bits).numpy().ravel()])
                     for tier in tiers])


def _float_meta(tiers_meta: list[torch.Tensor], layers: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V scales and zeros ([L, ...] each, fp16) -> float32 [L, 2, M] scales and zeros
    (the shorter kind zero-padded)."""
    k_scale, k_zero, v_scale, v_zero = (m.reshape(layers, -1).float().numpy()
                                        for m in tiers_meta)
    width = max(k_scale.shape[1], v_scale.shape[1])
    scales = np.zeros((layers, 2, width), dtype=np.float32)
    zeros = np.zeros((layers, 2, width), dtype=np.float32)
    scales[:, 0, :k_scale.shape[1]], scales[:, 1, :v_scale.shape[1]] = k_scale, v_scale
    zeros[:, 0, :k_zero.shape[1]], zeros[:, 1, :v_zero.shape[1]] = k_zero, v_zero
    return scales, zeros


def encode_chunk(keys: torch.Tensor, values: torch.Tensor, spec: CodecSpec,
                 key: bytes = b"") -> bytes:
    """One chunk's stream. keys, values: [L, n, H, D] (n a multiple of the group) on any
    device; coded on the CPU. `key` binds the stream to a name (e.g. its storage key)."""
    if keys.shape != values.shape or keys.dim() != 4:
        raise ValueError(f"keys and values must both be [L, n, H, D], got {tuple(keys.shape)} "
                         f"and {tuple(values.shape)}")
    layers, tokens, heads, dim = keys.shape
    if layers != len(spec.pool_bits):
        raise ValueError(f"the spec codes {len(spec.pool_bits)} layers, the chunk has {layers}")
    if tokens == 0 or tokens % spec.group:
        raise ValueError(f"a chunk's tokens ({tokens}) must be a positive multiple of the "
                         f"group ({spec.group})")
    exact.float_format(keys.dtype)  # refuses a dtype the codec does not take
    keys, values = keys.cpu(), values.cpu()
    tiers = [QuantTier.quantize(keys[layer], values[layer], bits, spec.group)
             for layer, bits in enumerate(spec.pool_bits)]
    fields = dict(layers=layers, tokens=tokens, heads=heads, head_dim=dim,
                  dtype=str(keys.dtype).removeprefix("torch."), group=spec.group,
                  v_group=math.gcd(spec.group, dim),
                  levels=[list(level) for level in spec.levels], tables=spec.tables,
                  exact=spec.exact, lane_channels=spec.lane_channels)
    geo = Geometry(Header(**fields, part_lengths=[], part_digests=[]))
    codes = _layer_codes(tiers)
    pool = np.asarray(spec.pool_bits, dtype=np.int64)
    parts = []
    for index, level in enumerate(spec.levels):
        plan = geo.level(index)
        pairs, widths, by_code = plan.pairs, plan.widths, plan.by_code
        shift, prev_shift = pool - np.asarray(level, dtype=np.int64), pool - plan.prev
        tables = []
        for (layer, kind), (rows, size) in zip(pairs, plan.shapes, strict=True):
            c = codes[layer, kind].astype(np.int64)
            symbols = (c >> shift[layer]) & ((1 << widths[layer]) - 1)
            groups = c >> prev_shift[layer] if by_code else geo.channel_of[kind]
            tables.append(entropy.frequency_tables(symbols, groups, rows, size))
        flat = np.concatenate([t.ravel() for t in tables]) if tables else np.empty(0, np.uint8)
        cum, base = _cum(flat, plan)
        words, counts = rans_cpu.encode_level(codes, pairs, cum, base, shift, widths, prev_shift,
                                              by_code, tokens, spec.group, spec.lane_channels)
        sections = [entropy.pack_tables(tables, spec.zstd_level),
                    *entropy.pack_lanes(words, counts, spec.zstd_level)]
        if index == 0:
            sections.insert(0, _meta_bytes(tiers, spec.zstd_level))
        parts.append(pack_sections(sections))
    if spec.exact:
        parts.append(_encode_exact(keys, values, tiers, codes, geo, spec.zstd_level))
    return write_stream(fields, parts, key)


def _encode_exact(keys: torch.Tensor, values: torch.Tensor, tiers: list[QuantTier],
                  codes: np.ndarray, geo: Geometry, zstd_level: int) -> bytes:
    """The exact part: per layer a mode (rANS lanes of the residual given the pool bins, or
    zstd byte planes, whichever is smaller), then the residual layers' exponent tables, lane
    directory and words, then the byte-plane layers' sections."""
    header, fmt = geo.header, geo.fmt
    layers = header.layers
    x = torch.stack([keys, values], 1).reshape(2 * layers, -1)
    x_bits = np.ascontiguousarray(exact.unsigned(x, fmt))
    scales, zeros = _float_meta([torch.stack(m) for m in zip(
        *((t.k_scale, t.k_zero, t.v_scale, t.v_zero) for t in tiers), strict=True)], layers)
    every = np.arange(layers, dtype=np.int64)
    model = (*fmt.model, header.tokens, header.group, header.v_group)
    tables = entropy.scale_histogram(rans_cpu.exponent_histogram(
        x_bits, every, codes, scales, zeros, *model))
    exp_cum = rans_ref.normalize(tables, 5)
    words, counts = rans_cpu.encode_exact(x_bits, every, exp_cum, codes, scales, zeros, *model,
                                          header.lane_channels)
    per = 2 * geo.lanes_per_pair
    lane_words = counts.reshape(layers, per).sum(1)
    planes = [exact.encode_planes(x[2 * layer:2 * layer + 2], zstd_level)
              for layer in range(layers)]
    # a residual layer costs its words, its exponent table and about a byte of directory a lane
    modes = np.array([EXACT_PLANES if len(planes[layer]) < 2 * lane_words[layer] + 32 + per
                      else EXACT_RESIDUAL for layer in range(layers)], dtype=np.uint8)
    residual = modes == EXACT_RESIDUAL
    ends = np.cumsum(counts)
    keep = np.repeat(residual, per)
    kept = [words[end - count:end] for end, count, k in zip(ends, counts, keep, strict=True)
            if k]
    sections = [modes.tobytes(), entropy.pack_tables([tables[residual]], zstd_level),
                *entropy.pack_lanes(np.concatenate(kept) if kept else np.empty(0, np.uint16),
                                    counts[keep], zstd_level)]
    return pack_sections(sections + [planes[layer] for layer in np.flatnonzero(~residual)])


def decode_chunk(blob: bytes | memoryview, level: int | None = None,
                 key: bytes = b"") -> DecodedChunk:
    """Decode lossy `level` (an index into the header's levels; parts past it need not be in
    `blob`), or the exact K/V when `level` is None. Raises a `StreamError` kind; a stream whose
    digests pass but that does not decode is `StreamForeign`: its bytes are what its writer
    stored, so another writer's format, not damage."""
    header, _ = read_header(blob)
    levels = header.levels
    want = len(levels) if level is None else level
    if level is None and not header.exact:
        raise StreamForeign("this KV stream holds no exact part")
    if not 0 <= want <= len(levels):
        raise StreamForeign(f"level {level} not in this stream (levels 0-{len(levels) - 1})")
    header, parts = read_parts(blob, min(want + 1, header.num_parts), key)
    try:
        return _decode(header, Geometry(header), parts, want)
    except (ValueError, TypeError, RuntimeError, IndexError, zstandard.ZstdError) as e:
        if isinstance(e, StreamError):
            raise
        raise StreamForeign(f"KV stream undecodable: {e}") from None


def _decode(header: Header, geo: Geometry, parts: list[memoryview], want: int) -> DecodedChunk:
    sections0 = unpack_sections(parts[0], 4)
    meta = decode_meta(sections0[0], geo)
    codes = np.zeros((header.layers, 2, geo.codes), dtype=np.uint8)
    top = min(want, len(header.levels) - 1)
    for index in range(top + 1):
        sections = sections0[1:] if index == 0 else unpack_sections(parts[index], 3)
        _decode_level(geo, sections, index, codes)
    tiers = _tiers(header, geo, codes, meta, top)
    result = DecodedChunk(header, want, tiers)
    if want == len(header.levels):
        result.keys, result.values = _decode_exact(geo, parts[-1], codes, meta)
    return result


def decode_meta(section: memoryview, geo: Geometry) -> list[torch.Tensor]:
    """Every layer's K scales, K zeros, V scales, V zeros: four fp16 [L, *meta shape]."""
    shapes = [geo.k_meta, geo.k_meta, geo.v_meta, geo.v_meta]
    sizes = [math.prod(shape) for shape in shapes]
    layers = geo.header.layers
    meta = exact.decode_planes(section, sum(sizes) * layers, exact.FORMATS["float16"])
    items = meta.reshape(layers, -1).split(sizes, 1)
    return [item.reshape(layers, *shape) for item, shape in zip(items, shapes, strict=True)]


def level_lanes(geo: Geometry, sections: list[memoryview], index: int,
                codes: np.ndarray) -> tuple:
    """The arguments of a lane decoder (`vericache_kernels.rans_*.decode_level*`) for level
    `index`'s sections (tables, lane directory, words), appending to `codes`."""
    header = geo.header
    plan = geo.level(index)
    flat = entropy.table_bytes(sections[0], int(plan.shapes.prod(1).sum()))
    cum, base = _cum(flat, plan)
    words, starts = entropy.unpack_lanes(sections[1], sections[2],
                                         len(plan.pairs) * geo.lanes_per_pair)
    return (words, starts, cum, plan.pairs, base, plan.widths, plan.by_code, codes,
            header.tokens, header.group, header.lane_channels)


def _decode_level(geo: Geometry, sections: list[memoryview], index: int,
                  codes: np.ndarray) -> None:
    """Append level `index`'s bits to `codes` ([L, K or V, codes], holding the previous
    level's)."""
    if not rans_cpu.decode_level(*level_lanes(geo, sections, index, codes)):
        raise StreamForeign(f"KV stream level {index} does not decode")


def _tiers(header: Header, geo: Geometry, codes: np.ndarray, meta: list[torch.Tensor],
           top: int) -> list[QuantTier]:
    """Level `top`'s tier per layer from its codes and the pool level's meta, packed in one
    call per (bits, pool bits) of all the layers sharing them, each tensor split into its
    layers by one `unbind` (indexing them one by one cost 0.5 ms a decode)."""
    layers = header.layers
    bits, pool = header.levels[top], header.levels[-1]
    tiers: list[QuantTier] = [None] * layers  # type: ignore[list-item]
    for b, p in sorted(set(zip(bits, pool, strict=True))):
        members = [layer for layer in range(layers) if (bits[layer], pool[layer]) == (b, p)]
        rows = np.asarray(members, dtype=np.int64)
        kc, vc = (torch.from_numpy(rans_cpu.pack_codes(codes, rows, kind, b)).reshape(
            len(members), *shape[:-1], shape[-1] * b // 8)
            for kind, shape in ((0, geo.k_codes), (1, geo.v_codes)))
        # layer-wise bits give runs of layers: a slice is a view, a list of them a copy
        run = members[-1] - members[0] + 1 == len(members)
        sel = slice(members[0], members[-1] + 1) if run else torch.from_numpy(rows)
        ks, kz, vs, vz = (m[sel] for m in meta)
        if b != p:
            (ks, kz), (vs, vz) = _coarse_meta(ks, kz, p - b), _coarse_meta(vs, vz, p - b)
        for layer, *tensors in zip(members, kc.unbind(), ks.unbind(), kz.unbind(), vc.unbind(),
                                   vs.unbind(), vz.unbind(), strict=True):
            tiers[layer] = QuantTier(b, *tensors)
    return tiers


def exact_lanes(geo: Geometry, part: memoryview, codes: np.ndarray, meta: list[torch.Tensor],
                out: np.ndarray) -> tuple[tuple | None, list[tuple[int, memoryview]]]:
    """The arguments of a lane decoder (`vericache_kernels.rans_*.decode_exact*`) for the exact
    part's residual layers (None if there are none), writing `out` ([2 * L, n * H * D]), and
    the byte-plane layers' sections."""
    header, fmt = geo.header, geo.fmt
    layers = header.layers
    sections = unpack_all(part)
    if len(sections) < 4 or len(sections[0]) != layers:
        raise StreamForeign("KV stream exact part does not fit its layers")
    modes = np.frombuffer(sections[0], dtype=np.uint8)
    if not np.isin(modes, (EXACT_RESIDUAL, EXACT_PLANES)).all():
        raise StreamForeign("KV stream exact part of unknown mode")
    residual = np.flatnonzero(modes == EXACT_RESIDUAL)
    planes = np.flatnonzero(modes == EXACT_PLANES)
    if len(sections) != 4 + len(planes):
        raise StreamForeign("KV stream exact part has the wrong number of sections")
    args = None
    if len(residual):
        (tables,) = entropy.unpack_tables(sections[1], [(len(residual), rans_ref.EXP_SYMBOLS)])
        exp_cum = np.zeros((layers, rans_ref.EXP_SYMBOLS + 1), dtype=np.int64)
        exp_cum[residual] = rans_ref.normalize(tables, 5)
        words, starts = entropy.unpack_lanes(sections[2], sections[3],
                                             len(residual) * 2 * geo.lanes_per_pair)
        scales, zeros = _float_meta(meta, layers)
        args = (words, starts, exp_cum, residual.astype(np.int64), codes, scales, zeros,
                fmt.model, header.tokens, header.group, header.v_group, header.lane_channels,
                out)
    return args, list(zip(planes.tolist(), sections[4:], strict=True))


def _decode_exact(geo: Geometry, part: memoryview, codes: np.ndarray,
                  meta: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact [L, n, H, D] keys and values from the pool level's codes and meta."""
    fmt, layers = geo.fmt, geo.header.layers
    # not zeroed (0.8 ms of 24 MB): every layer is residual or planes (`exact_lanes` checks the
    # modes), a decoder that returns True wrote each element of its layers, planes fill theirs
    out = np.empty((2 * layers, geo.codes), dtype=np.int64)
    args, planes = exact_lanes(geo, part, codes, meta, out)
    if args is not None:
        words, starts, exp_cum, residual, codes, scales, zeros, model, *rest = args
        if not rans_cpu.decode_exact(words, starts, exp_cum, residual, codes, scales, zeros,
                                     *model, *rest):
            raise StreamForeign("KV stream exact part does not decode")
    for layer, section in planes:
        x = exact.decode_planes(section, 2 * geo.codes, fmt).view(fmt.int_dtype).numpy()
        out[2 * layer:2 * layer + 2] = x.reshape(2, -1)
    x = exact.floats(out.reshape(layers, 2, -1).transpose(1, 0, 2), fmt)
    return x[0].reshape(layers, *geo.v_codes), x[1].reshape(layers, *geo.v_codes)


def encode(keys: torch.Tensor, values: torch.Tensor, spec: CodecSpec,
           key: bytes = b"") -> list[bytes]:
    """[L, T, H, D] K/V as streams of `spec.chunk_tokens` tokens (the last may be shorter, a
    multiple of the group), each decodable on its own."""
    step = spec.chunk_tokens
    return [encode_chunk(keys[:, s:s + step], values[:, s:s + step], spec,
                         key + s.to_bytes(8, "little"))
            for s in range(0, keys.shape[1], step)]
