"""CacheGen-style coding of one chunk of KV: progressive lossy levels, then the exact bits.

A chunk is `tokens` consecutive tokens of every layer ([L, n, H, D] keys and values, n a multiple
of the key group). Its stream has one part per level:

- part 0: the KIVI scales and zero points of every layer (byte planes through zstd), and the
  coarsest codes: the pool level's codes with their low bits dropped, fewer bits for deep
  layers than early ones (CacheGen's layer-wise bins);
- part i: the next bits of each code, down to the compressed pool's own bits: decoding parts
  0..i gives level i, the last lossy level being the pool's pages bit for bit;
- the last part: the exact K/V (`exact.py`).

Codes are range coded with one table per (layer, K or V, channel) (CacheGen's grouping) or per
(layer, K or V, coarser code) (`tables="kind"`). Level i's codes come with fp16 scales and zero
points derived from the pool level's, so every level is a KIVI tier the attention kernels read.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import zstandard

import vericache_kernels as kernels
from vericache_sglang.compress.quant import KiviQuantizer, QuantTier

from . import exact
from .entropy import Grouping, SymbolReader, SymbolWriter
from .stream import (
    Header,
    StreamError,
    StreamForeign,
    pack_sections,
    read_header,
    read_parts,
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


@functools.lru_cache(maxsize=16)
def _channel_groupings(k_codes: tuple[int, ...], v_codes: tuple[int, ...]) -> tuple[Grouping,
                                                                                  Grouping]:
    """Per-channel tables of K and V codes: a chunk shape's argsort, done once per process."""
    _, heads, dim, _ = k_codes
    ch = np.arange(heads * dim).reshape(heads, dim)
    return (Grouping.of(np.broadcast_to(ch[None, :, :, None], k_codes), heads * dim),
            Grouping.of(np.broadcast_to(ch[None], v_codes), heads * dim))


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


def _tables_section(tables: list[np.ndarray], level: int) -> bytes:
    flat = np.concatenate([t.ravel() for t in tables]) if tables else np.empty(0, np.uint8)
    return zstandard.ZstdCompressor(level=level).compress(flat.tobytes())


class _Geometry:
    """Shapes of one chunk, from the header."""

    def __init__(self, header: Header) -> None:
        self.header = header
        self.fmt = exact.float_format(header.dtype)
        n, h, d, g = header.tokens, header.heads, header.head_dim, header.group
        self.k_codes = (n // g, h, d, g)
        self.v_codes = (n, h, d)
        self.k_meta = (n // g, h, d)
        self.v_meta = (n, h, d // header.v_group)
        self.codes = n * h * d
        """Codes (and elements) per layer and kind."""
        self.channel_groupings = _channel_groupings(self.k_codes, self.v_codes)


def _grouping(geo: _Geometry, tables: str, kind: int, previous: np.ndarray | None,
              prev_bits: int) -> Grouping:
    """The tables of a level's K (kind 0) or V codes: per channel, or per coarser code."""
    if tables == "channel" or previous is None:
        return geo.channel_groupings[kind]
    return Grouping.of(previous, 1 << prev_bits)


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
    fmt = exact.float_format(keys.dtype)
    keys, values = keys.cpu(), values.cpu()
    tiers = [QuantTier.quantize(keys[layer], values[layer], bits, spec.group)
             for layer, bits in enumerate(spec.pool_bits)]
    fields = dict(layers=layers, tokens=tokens, heads=heads, head_dim=dim,
                  dtype=str(keys.dtype).removeprefix("torch."), group=spec.group,
                  v_group=math.gcd(spec.group, dim),
                  levels=[list(level) for level in spec.levels], tables=spec.tables,
                  exact=spec.exact)
    geo = _Geometry(Header(**fields, part_lengths=[], part_digests=[]))
    codes = [_codes(tier) for tier in tiers]
    parts = []
    for index, level in enumerate(spec.levels):
        prev = spec.levels[index - 1] if index else None
        writer, tables = SymbolWriter(), []
        for layer, (kc, vc) in enumerate(codes):
            pool, bits = spec.pool_bits[layer], level[layer]
            width = bits - (prev[layer] if prev else 0)
            if width == 0:
                continue
            for kind, c in enumerate((kc, vc)):
                symbols = (c >> (pool - bits)) & ((1 << width) - 1)
                previous = (c >> (pool - prev[layer])).numpy() if prev else None
                grouping = _grouping(geo, spec.tables, kind, previous,
                                     prev[layer] if prev else 0)
                tables.append(writer.grouped(symbols.numpy().ravel(), grouping, 1 << width))
        sections = [_tables_section(tables, spec.zstd_level), writer.finish()]
        if index == 0:
            sections.insert(0, _meta_bytes(tiers, spec.zstd_level))
        parts.append(pack_sections(sections))
    if spec.exact:
        parts.append(pack_sections([_encode_exact(keys[layer], values[layer], tier, fmt,
                                                  spec.zstd_level)
                                    for layer, tier in enumerate(tiers)]))
    return write_stream(fields, parts, key)


def _bins(tier: QuantTier, group: int, v_group: int,
          layers: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Centre and half width (float32, [layers, keys then values]) of every element's pool bin;
    `tier` holds `layers` layers' tokens one after the other (one dequantization for all)."""
    k_pred, v_pred = tier.dequantize(torch.float32)
    k_half = tier.k_scale.float().repeat_interleave(group, 0) / 2
    v_half = tier.v_scale.float().repeat_interleave(v_group, -1) / 2
    return (torch.cat([k_pred.reshape(layers, -1), v_pred.reshape(layers, -1)], 1),
            torch.cat([k_half.reshape(layers, -1), v_half.reshape(layers, -1)], 1))


def _encode_exact(keys: torch.Tensor, values: torch.Tensor, tier: QuantTier,
                  fmt: exact.FloatFormat, zstd_level: int) -> bytes:
    x = torch.cat([keys.flatten(), values.flatten()])
    pred, half = _bins(tier, len(keys) // tier.k_scale.shape[0], math.gcd(
        len(keys) // tier.k_scale.shape[0], keys.shape[-1]))
    residual = exact.encode_residual(x, pred.ravel(), half.ravel(), fmt)
    planes = exact.encode_planes(x, zstd_level)
    if len(planes) < len(residual):
        return bytes([EXACT_PLANES]) + planes
    return bytes([EXACT_RESIDUAL]) + residual


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
        return _decode(header, _Geometry(header), parts, want)
    except (ValueError, TypeError, RuntimeError, IndexError, zstandard.ZstdError) as e:
        if isinstance(e, StreamError):
            raise
        raise StreamForeign(f"KV stream undecodable: {e}") from None


def _decode(header: Header, geo: _Geometry, parts: list[memoryview], want: int) -> DecodedChunk:
    sections0 = unpack_sections(parts[0], 3)
    meta = _decode_meta(sections0[0], geo)
    codes = np.zeros((header.layers, 2, geo.codes), dtype=np.int32)
    top = min(want, len(header.levels) - 1)
    for index in range(top + 1):
        sections = sections0[1:] if index == 0 else unpack_sections(parts[index], 2)
        _decode_level(header, geo, sections, index, codes)
    tiers = _tiers(header, geo, codes, meta, top)
    result = DecodedChunk(header, want, tiers)
    if want == len(header.levels):
        result.keys, result.values = _decode_exact(header, geo, parts[-1], tiers)
    return result


def _decode_meta(section: memoryview, geo: _Geometry) -> list[torch.Tensor]:
    """Every layer's K scales, K zeros, V scales, V zeros: four fp16 [L, *meta shape]."""
    shapes = [geo.k_meta, geo.k_meta, geo.v_meta, geo.v_meta]
    sizes = [math.prod(shape) for shape in shapes]
    layers = geo.header.layers
    meta = exact.decode_planes(section, sum(sizes) * layers, exact.FORMATS["float16"])
    items = meta.reshape(layers, -1).split(sizes, 1)
    return [item.reshape(layers, *shape) for item, shape in zip(items, shapes, strict=True)]


def _decode_level(header: Header, geo: _Geometry, sections: list[memoryview], index: int,
                  codes: np.ndarray) -> None:
    """Append level `index`'s bits to `codes` ([L, K or V, codes], holding the previous
    level's)."""
    level = header.levels[index]
    prev = header.levels[index - 1] if index else [0] * header.layers
    reader = SymbolReader(sections[1])
    flat = np.frombuffer(zstandard.ZstdDecompressor().decompress(
        bytes(sections[0]), max_output_size=1 << 28), dtype=np.uint8)
    pos = 0
    for layer in range(header.layers):
        width = level[layer] - prev[layer]
        if width == 0:
            continue
        for kind in range(2):
            layer_codes = codes[layer, kind]
            grouping = _grouping(geo, header.tables, kind, layer_codes if index else None,
                                 prev[layer])
            num_groups = len(grouping.counts)
            size = num_groups << width
            if pos + size > flat.size:
                raise StreamForeign("KV stream tables are short")
            tables = flat[pos:pos + size].reshape(num_groups, 1 << width)
            pos += size
            layer_codes <<= width
            layer_codes |= reader.grouped(grouping, tables)
    if pos != flat.size:
        raise StreamForeign("KV stream tables have unexpected entries")


def _tiers(header: Header, geo: _Geometry, codes: np.ndarray, meta: list[torch.Tensor],
           top: int) -> list[QuantTier]:
    """Level `top`'s tier per layer from its codes and the pool level's meta, packed in one
    call per (bits, pool bits) of all the layers sharing them."""
    layers = header.layers
    bits, pool = header.levels[top], header.levels[-1]
    tiers: list[QuantTier] = [None] * layers  # type: ignore[list-item]
    for b, p in sorted(set(zip(bits, pool, strict=True))):
        members = [layer for layer in range(layers) if (bits[layer], pool[layer]) == (b, p)]
        sel = torch.tensor(members)
        kc = kernels.pack_codes(torch.from_numpy(
            codes[members, 0].reshape(len(members), *geo.k_codes)), b)
        vc = kernels.pack_codes(torch.from_numpy(
            codes[members, 1].reshape(len(members), *geo.v_codes)), b)
        ks, kz, vs, vz = (m[sel] for m in meta)
        if b != p:
            (ks, kz), (vs, vz) = _coarse_meta(ks, kz, p - b), _coarse_meta(vs, vz, p - b)
        for i, layer in enumerate(members):
            tiers[layer] = QuantTier(b, kc[i], ks[i], kz[i], vc[i], vs[i], vz[i])
    return tiers


def _decode_exact(header: Header, geo: _Geometry, part: memoryview,
                  tiers: list[QuantTier]) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact [L, n, H, D] keys and values. The pool bins of all layers of one bit width are
    computed at once; the rest goes layer by layer (a layer's int64 arrays stay in cache)."""
    layers, n = header.layers, geo.codes
    sections = unpack_sections(part, layers)
    out = np.empty((2, layers, n), dtype=f"u{geo.fmt.bits // 8}")
    for bits in sorted({tier.bits for tier in tiers}):
        members = [layer for layer in range(layers) if tiers[layer].bits == bits]
        shared = QuantTier(bits, *(torch.cat(t) for t in zip(
            *(tiers[layer].tensors() for layer in members), strict=True)))
        pred, half = _bins(shared, header.group, header.v_group, len(members))
        for i, layer in enumerate(members):
            section = sections[layer]
            if len(section) < 1:
                raise StreamForeign("KV stream exact section is empty")
            mode, data = section[0], section[1:]
            if mode == EXACT_PLANES:
                x = exact.decode_planes(data, 2 * n, geo.fmt).view(geo.fmt.int_dtype).numpy()
                out[:, layer] = x.view(out.dtype).reshape(2, n)
            elif mode == EXACT_RESIDUAL:
                plan = exact.bin_plan(pred[i], half[i], geo.fmt)
                out[:, layer] = exact.decode_residual(data, plan, geo.fmt).reshape(2, n)
            else:
                raise StreamForeign(f"KV stream exact section of unknown mode {mode}")
    keys, values = (exact.floats(x, geo.fmt).reshape(layers, *geo.v_codes) for x in out)
    return keys, values


def encode(keys: torch.Tensor, values: torch.Tensor, spec: CodecSpec,
           key: bytes = b"") -> list[bytes]:
    """[L, T, H, D] K/V as streams of `spec.chunk_tokens` tokens (the last may be shorter, a
    multiple of the group), each decodable on its own."""
    step = spec.chunk_tokens
    return [encode_chunk(keys[:, s:s + step], values[:, s:s + step], spec,
                         key + s.to_bytes(8, "little"))
            for s in range(0, keys.shape[1], step)]
