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
    pack_sections,
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


def _channels(kc: torch.Tensor, vc: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Channel index (head * D + d) of every key and value code."""
    _, heads, dim, group = kc.shape
    ch = torch.arange(heads * dim).reshape(heads, dim)
    return (ch[None, :, :, None].expand_as(kc).numpy().ravel(),
            ch[None].expand_as(vc).numpy().ravel())


def coarser(tier: QuantTier, bits: int) -> QuantTier:
    """The tier with its codes' low bits dropped: scales grow and zero points move to the centre
    of each coarse bin (fp16, as the pool stores them)."""
    shift = tier.bits - bits
    if shift == 0:
        return tier
    kc, vc = _codes(tier)

    def meta(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = scale.float()
        return (s * (1 << shift)).half(), (zero.float() + s * ((1 << shift) - 1) / 2).half()

    return QuantTier(bits, kernels.pack_codes(kc >> shift, bits), *meta(tier.k_scale, tier.k_zero),
                     kernels.pack_codes(vc >> shift, bits), *meta(tier.v_scale, tier.v_zero))


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
        kc = torch.zeros(self.k_codes, dtype=torch.uint8)
        vc = torch.zeros(self.v_codes, dtype=torch.uint8)
        k_channel, v_channel = _channels(kc, vc)
        self.channel_groupings = (Grouping.of(k_channel, h * d), Grouping.of(v_channel, h * d))


def _grouping(geo: _Geometry, tables: str, kind: int, previous: torch.Tensor | None,
              prev_bits: int) -> Grouping:
    """The tables of a level's K (kind 0) or V codes: per channel, or per coarser code."""
    if tables == "channel" or previous is None:
        return geo.channel_groupings[kind]
    return Grouping.of(previous.numpy().ravel(), 1 << prev_bits)


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
                previous = c >> (pool - prev[layer]) if prev else None
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


def _bins(tier: QuantTier, group: int, v_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Centre and half width (float32, flat: keys then values) of every element's pool bin."""
    k_pred, v_pred = tier.dequantize(torch.float32)
    k_half = tier.k_scale.float().repeat_interleave(group, 0) / 2
    v_half = tier.v_scale.float().repeat_interleave(v_group, -1) / 2
    return (torch.cat([k_pred.flatten(), v_pred.flatten()]),
            torch.cat([k_half.flatten(), v_half.flatten()]))


def _encode_exact(keys: torch.Tensor, values: torch.Tensor, tier: QuantTier,
                  fmt: exact.FloatFormat, zstd_level: int) -> bytes:
    x = torch.cat([keys.flatten(), values.flatten()])
    pred, half = _bins(tier, len(keys) // tier.k_scale.shape[0], math.gcd(
        len(keys) // tier.k_scale.shape[0], keys.shape[-1]))
    residual = exact.encode_residual(x, pred, half, fmt)
    planes = exact.encode_planes(x, zstd_level)
    if len(planes) < len(residual):
        return bytes([EXACT_PLANES]) + planes
    return bytes([EXACT_RESIDUAL]) + residual


def decode_chunk(blob: bytes | memoryview, level: int | None = None,
                 key: bytes = b"") -> DecodedChunk:
    """Decode lossy `level` (an index into the header's levels; parts past it need not be in
    `blob`), or the exact K/V when `level` is None."""
    from .stream import read_header

    header, _ = read_header(blob)
    levels = header.levels
    want = len(levels) if level is None else level
    if level is None and not header.exact:
        raise StreamError("this KV stream holds no exact part")
    if not 0 <= want <= len(levels):
        raise StreamError(f"level {level} not in this stream (levels 0-{len(levels) - 1})")
    header, parts = read_parts(blob, min(want + 1, header.num_parts), key)
    geo = _Geometry(header)
    try:
        return _decode(header, geo, parts, want)
    except (ValueError, RuntimeError, IndexError) as e:
        if isinstance(e, StreamError):
            raise
        raise StreamError(f"KV stream undecodable: {e}") from None


def _decode(header: Header, geo: _Geometry, parts: list[memoryview], want: int) -> DecodedChunk:
    layers = header.layers
    meta_count = sum(math.prod(s) for s in (geo.k_meta, geo.k_meta, geo.v_meta, geo.v_meta))
    sections0 = unpack_sections(parts[0], 3)
    meta = exact.decode_planes(sections0[0], meta_count * layers, exact.FORMATS["float16"])
    sizes = [math.prod(geo.k_meta)] * 2 + [math.prod(geo.v_meta)] * 2
    shapes = [geo.k_meta, geo.k_meta, geo.v_meta, geo.v_meta]
    metas, offset = [], 0
    for _ in range(layers):
        items = []
        for size, shape in zip(sizes, shapes, strict=True):
            items.append(meta[offset:offset + size].reshape(shape))
            offset += size
        metas.append(items)
    kcodes = [torch.zeros(geo.k_codes, dtype=torch.int32) for _ in range(layers)]
    vcodes = [torch.zeros(geo.v_codes, dtype=torch.int32) for _ in range(layers)]
    top = min(want, len(header.levels) - 1)
    for index in range(top + 1):
        level, prev = header.levels[index], header.levels[index - 1] if index else None
        sections = sections0[1:] if index == 0 else unpack_sections(parts[index], 2)
        reader = SymbolReader(sections[1])
        flat = np.frombuffer(zstandard.ZstdDecompressor().decompress(
            bytes(sections[0]), max_output_size=1 << 28), dtype=np.uint8)
        pos = 0
        for layer in range(layers):
            width = level[layer] - (prev[layer] if prev else 0)
            if width == 0:
                continue
            for kind, codes in enumerate((kcodes[layer], vcodes[layer])):
                previous = codes if prev else None
                grouping = _grouping(geo, header.tables, kind, previous,
                                     prev[layer] if prev else 0)
                num_groups = len(grouping.counts)
                size = num_groups << width
                if pos + size > flat.size:
                    raise StreamError("KV stream tables are short")
                tables = flat[pos:pos + size].reshape(num_groups, 1 << width)
                pos += size
                symbols = reader.grouped(grouping, tables)
                codes.mul_(1 << width).add_(torch.from_numpy(symbols).reshape(codes.shape))
        if pos != flat.size:
            raise StreamError("KV stream tables have unexpected entries")
    pool = header.levels[-1]
    tiers = []
    for layer in range(layers):
        bits = header.levels[top][layer]
        ks, kz, vs, vz = metas[layer]
        pool_tier = QuantTier(pool[layer], *_packed(kcodes[layer], vcodes[layer], bits, ks, kz,
                                                    vs, vz))
        # codes hold `bits` bits: rebuild the pool tier's meta, then coarsen
        tiers.append(pool_tier if bits == pool[layer] else
                     coarser(QuantTier(pool[layer], *_packed(
                         kcodes[layer] << (pool[layer] - bits),
                         vcodes[layer] << (pool[layer] - bits), pool[layer], ks, kz, vs, vz)),
                         bits))
    result = DecodedChunk(header, want, tiers)
    if want == len(header.levels):
        sections = unpack_sections(parts[-1], layers)
        k_out, v_out = [], []
        n = header.tokens * header.heads * header.head_dim
        for layer, section in enumerate(sections):
            if len(section) < 1:
                raise StreamError("KV stream exact section is empty")
            mode, data = section[0], section[1:]
            if mode == EXACT_PLANES:
                x = exact.decode_planes(data, 2 * n, geo.fmt)
            elif mode == EXACT_RESIDUAL:
                pred, half = _bins(tiers[layer], header.group, header.v_group)
                x = exact.decode_residual(data, pred, half, geo.fmt)
            else:
                raise StreamError(f"KV stream exact section of unknown mode {mode}")
            k_out.append(x[:n].reshape(geo.v_codes))
            v_out.append(x[n:].reshape(geo.v_codes))
        result.keys, result.values = torch.stack(k_out), torch.stack(v_out)
    return result


def _packed(kc: torch.Tensor, vc: torch.Tensor, bits: int, *meta: torch.Tensor):
    ks, kz, vs, vz = meta
    return (kernels.pack_codes(kc, bits), ks, kz, kernels.pack_codes(vc, bits), vs, vz)


def encode(keys: torch.Tensor, values: torch.Tensor, spec: CodecSpec,
           key: bytes = b"") -> list[bytes]:
    """[L, T, H, D] K/V as streams of `spec.chunk_tokens` tokens (the last may be shorter, a
    multiple of the group), each decodable on its own."""
    step = spec.chunk_tokens
    return [encode_chunk(keys[:, s:s + step], values[:, s:s + step], spec,
                         key + s.to_bytes(8, "little"))
            for s in range(0, keys.shape[1], step)]
