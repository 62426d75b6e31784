"""The CacheGen codec on real demo-model KV: the whole stream gives back the exact bits, the pool
level is the compressed pool's own pages bit for bit, coarser levels are those codes without
their low bits and decode from a prefix of the stream, and damaged streams are refused, each
with the kind of error a store acts on: cut short, corrupted (a digest fails: the only one a
store removes), or foreign (another format or version)."""

from __future__ import annotations

import random

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from vericache_sglang.codec import (
    CodecSpec,
    StreamCorrupt,
    StreamForeign,
    StreamTruncated,
    coarser,
    decode_chunk,
    encode,
    encode_chunk,
    finer,
    parts_in,
    prefix_length,
    read_header,
)
from vericache_sglang.codec.stream import VERSION, read_parts
from vericache_sglang.compress import parse_compressor_spec
from vericache_sglang.compress.quant import QuantTier
from vericache_sglang.tiers.compressed_pool import CompressedPagePool

LAYERS = 30
KEY = b"page-0"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _chunk(model_kv, dtype: torch.dtype, tokens: int = 256, start: int = 0):
    keys, values = model_kv
    return (keys[:, start:start + tokens].to(dtype).contiguous(),
            values[:, start:start + tokens].to(dtype).contiguous())


def _spec(compressor: str = "kivi:bits=4", **kwargs) -> CodecSpec:
    return CodecSpec.for_compressor(parse_compressor_spec(compressor), LAYERS, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("tables", ["channel", "kind"])
def test_the_whole_stream_is_the_exact_kv(model_kv, dtype, tables):
    keys, values = _chunk(model_kv, dtype)
    blob = encode_chunk(keys, values, _spec(tables=tables), key=KEY)
    out = decode_chunk(blob, key=KEY)
    assert out.keys.dtype == dtype
    assert torch.equal(_bits(out.keys), _bits(keys))
    assert torch.equal(_bits(out.values), _bits(values))
    # smaller than the KV it holds, all metadata included
    assert len(blob) < keys.numel() * 2 * keys.element_size()


def _pool_pages(keys: torch.Tensor, values: torch.Tensor, compressor: str) -> list[QuantTier]:
    """The pages SGLang's KV pool plus VeriCache's compressed pool hold for these tokens,
    one QuantTier per layer (pages in token order)."""
    layers, tokens, heads, dim = keys.shape
    kv = MHATokenToKVPool(size=tokens + 8, page_size=1, dtype=keys.dtype, head_num=heads,
                          head_dim=dim, layer_num=layers, device="cpu",
                          enable_memory_saver=False)
    slots = torch.arange(1, tokens + 1)
    for layer in range(layers):
        kv.k_buffer[layer][slots] = keys[layer]
        kv.v_buffer[layer][slots] = values[layer]
    pool = CompressedPagePool(parse_compressor_spec(compressor), kv, num_pages=tokens // 32 + 2)
    pages = pool.pages(slots)
    return [QuantTier(pool.bits[layer], pool.k_codes[layer][pages], pool.k_scale[layer][pages],
                      pool.k_zero[layer][pages], pool.v_codes[layer][pages].flatten(0, 1),
                      pool.v_scale[layer][pages].flatten(0, 1),
                      pool.v_zero[layer][pages].flatten(0, 1))
            for layer in range(layers)]


def _assert_tier_equal(got: QuantTier, want: QuantTier) -> None:
    assert got.bits == want.bits
    for a, b in zip(got.tensors(), want.tensors(), strict=True):
        assert a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("compressor", ["kivi:bits=4", "kivi:bits=2",
                                        "kivi_mixed:bits_early=8,bits_late=4,recent=0"])
@pytest.mark.parametrize("tables", ["channel", "kind"])
def test_the_pool_level_is_the_compressed_pools_pages(model_kv, dtype, compressor, tables):
    """Tables per code of 4 bits (the 8-bit layers' refinement) take the level decoder's
    search; 2-bit ones its arithmetic, 4-bit ones per channel its quarters."""
    keys, values = _chunk(model_kv, dtype)
    spec = _spec(compressor, tables=tables)
    blob = encode_chunk(keys, values, spec, key=KEY)
    pool_level = len(spec.levels) - 1
    got = decode_chunk(blob, level=pool_level, key=KEY).tiers
    for layer, want in enumerate(_pool_pages(keys, values, compressor)):
        _assert_tier_equal(got[layer], want)
    # the exact decode reports the same pool tiers
    for a, b in zip(decode_chunk(blob, key=KEY).tiers, got, strict=True):
        _assert_tier_equal(a, b)


def test_a_coarse_level_decodes_from_a_prefix_of_the_stream(model_kv):
    keys, values = _chunk(model_kv, torch.bfloat16)
    spec = _spec()
    assert spec.levels[0][0] == 4 and spec.levels[0][-1] == 2  # more bins for early layers
    blob = encode_chunk(keys, values, spec, key=KEY)
    header, _ = read_header(blob)
    prefix = blob[:prefix_length(header, 1)]
    coarse = decode_chunk(prefix, level=0, key=KEY).tiers
    pool = decode_chunk(blob, level=1, key=KEY).tiers
    for layer in range(LAYERS):
        _assert_tier_equal(coarse[layer], coarser(pool[layer], spec.levels[0][layer]))
    # coarser, but close: dequantized error within the coarse bins
    k_coarse, _ = coarse[0].dequantize(torch.float32)
    assert (k_coarse - keys[0].float()).abs().max() <= coarse[0].k_scale.float().max()
    with pytest.raises(StreamTruncated):
        decode_chunk(prefix, level=1, key=KEY)
    with pytest.raises(StreamTruncated):
        decode_chunk(prefix, key=KEY)
    assert parts_in(header, len(prefix)) == 1 and parts_in(header, len(blob)) == 3
    # Lifted back to the pool's bits (a coarse page in the compressed pool), the same values.
    for layer in (0, LAYERS - 1):
        lifted = finer(coarse[layer], spec.levels[1][layer])
        assert lifted.bits == spec.levels[1][layer]
        for mine, theirs in zip(lifted.dequantize(torch.float32),
                                coarse[layer].dequantize(torch.float32), strict=True):
            assert torch.equal(mine, theirs)


def test_chunks_decode_on_their_own(model_kv):
    keys, values = _chunk(model_kv, torch.bfloat16, tokens=512)
    streams = encode(keys, values, _spec(), key=KEY)
    assert len(streams) == 2
    second = decode_chunk(streams[1], key=KEY + (256).to_bytes(8, "little"))
    assert torch.equal(_bits(second.keys), _bits(keys[:, 256:]))
    with pytest.raises(StreamCorrupt, match="not this stream"):
        decode_chunk(streams[1], key=KEY)  # stored under another chunk's name


@pytest.fixture(scope="module")
def blob(model_kv) -> bytes:
    keys, values = _chunk(model_kv, torch.bfloat16, tokens=64)
    return encode_chunk(keys, values, _spec(), key=KEY)


def test_truncated_streams_are_refused(blob):
    cuts = sorted(random.Random(0).sample(range(len(blob)), 40)) + [0, 3, 10, len(blob) - 1]
    for cut in cuts:
        with pytest.raises(StreamTruncated):
            decode_chunk(blob[:cut], key=KEY)


def test_flipped_bits_are_refused(blob):
    """A flipped bit in the magic or version makes another format; in the header's length
    (bytes 5-8) a header cut short or failing its digest; anywhere else a failed digest."""
    rng = random.Random(1)
    for position in [*rng.sample(range(len(blob)), 60), 0, 4, 5, 8, 9, len(blob) - 1]:
        damaged = bytearray(blob)
        damaged[position] ^= 1 << rng.randrange(8)
        kind = (StreamForeign if position < 5 else (StreamTruncated, StreamCorrupt)
                if position < 9 else StreamCorrupt)
        with pytest.raises(kind):
            decode_chunk(bytes(damaged), key=KEY)


def test_reordered_foreign_and_extended_streams_are_refused(blob, model_kv):
    header, parts = read_parts(blob, key=KEY)
    head = blob[:prefix_length(header, 0)]
    swapped = head + bytes(parts[1]) + bytes(parts[0]) + b"".join(bytes(p) for p in parts[2:])
    with pytest.raises(StreamCorrupt):
        decode_chunk(swapped, key=KEY)
    keys, values = _chunk(model_kv, torch.bfloat16, tokens=64, start=64)
    other = encode_chunk(keys, values, _spec(), key=KEY)
    other_header, other_parts = read_parts(other, key=KEY)
    spliced = head + bytes(parts[0]) + bytes(other_parts[1]) + bytes(parts[2])
    with pytest.raises(StreamCorrupt):
        decode_chunk(spliced, key=KEY)
    with pytest.raises(StreamForeign, match="not a VeriCache KV stream"):
        decode_chunk(b"\x89PNG\r\n\x1a\n" + blob[8:], key=KEY)
    with pytest.raises(StreamForeign, match="version"):
        decode_chunk(blob[:4] + bytes([99]) + blob[5:], key=KEY)
    with pytest.raises(StreamCorrupt, match="unexpected bytes"):
        decode_chunk(blob + b"\0", key=KEY)
    with pytest.raises(StreamCorrupt, match="not this stream"):
        decode_chunk(blob, key=b"page-1")


def test_a_stream_of_a_previous_version_is_foreign(blob):
    """Version 3 digested parts with keyed BLAKE2b, version 2 range coded each part as one
    sequence, version 1 keyed part digests by 64 bytes of the key: such streams are another
    format, not damaged ones (a store leaves them in place)."""
    assert blob[4] == VERSION == 4
    for old in (1, 2, 3):
        with pytest.raises(StreamForeign, match=f"version {old}"):
            decode_chunk(blob[:4] + bytes([old]) + blob[5:], key=KEY)


def test_the_part_digests_bind_the_whole_key(model_kv):
    """Two storage keys alike in their first 64 bytes (a Mooncake page name and its rank
    suffix): neither verifies the other's parts."""
    keys, values = _chunk(model_kv, torch.bfloat16, tokens=64)
    page = b"%064x" % 12345
    rank0, rank1 = page + b"_0_c", page + b"_1_c"
    blob = encode_chunk(keys, values, _spec(), key=rank0)
    assert torch.equal(_bits(decode_chunk(blob, key=rank0).keys), _bits(keys))
    for other in (rank1, page):
        with pytest.raises(StreamCorrupt, match="not this stream"):
            decode_chunk(blob, key=other)
        with pytest.raises(StreamCorrupt, match="not this stream"):
            read_parts(blob, 1, key=other)


def test_unusual_values_round_trip():
    """Zeros, denormals, infinities, NaN, constant groups and huge outliers: escapes and wide
    bins keep every bit."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        keys = torch.randn(2, 64, 3, 64, generator=gen).to(dtype)
        values = torch.randn(2, 64, 3, 64, generator=gen).to(dtype)
        keys[0, :32] = 0.5  # a constant key group
        keys[1, 3, 0, :8] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, float("inf"),
                                          float("-inf"), float("nan"), 3e4]).to(dtype)
        values[0, 5, 1] = torch.finfo(dtype).tiny / 4  # subnormal
        values[1, 7, 2, :4] = torch.tensor([6e4, -6e4, 1e-3, 0.0]).to(dtype)
        spec = CodecSpec((4, 8), coarse=((2, 4),))
        out = decode_chunk(encode_chunk(keys, values, spec))
        assert torch.equal(_bits(out.keys), _bits(keys))
        assert torch.equal(_bits(out.values), _bits(values))


def test_specs_and_inputs_that_cannot_be_coded_are_refused():
    with pytest.raises(ValueError, match="at most the next"):
        CodecSpec((4, 4), coarse=((8, 2),))
    with pytest.raises(ValueError, match="attention kernels"):
        CodecSpec((4, 4), coarse=((3, 2),))
    with pytest.raises(ValueError, match="tables"):
        CodecSpec((4,), tables="token")
    with pytest.raises(ValueError, match="multiple of the group"):
        CodecSpec((4,), chunk_tokens=100)
    x = torch.zeros(1, 40, 3, 64)
    with pytest.raises(ValueError, match="multiple of the group"):
        encode_chunk(x, x, CodecSpec((4,)))
    with pytest.raises(ValueError, match="layers"):
        encode_chunk(x[:, :32], x[:, :32], CodecSpec((4, 4)))
    with pytest.raises(ValueError, match="codec takes"):
        encode_chunk(x[:, :32].double(), x[:, :32].double(), CodecSpec((4,)))


def test_levels_cost_what_the_header_says(blob):
    """prefix_length counts exactly the bytes before each part."""
    header, parts = read_parts(blob, key=KEY)
    assert prefix_length(header, header.num_parts) == len(blob)
    for i in range(header.num_parts):
        start = prefix_length(header, i)
        assert blob[start:start + header.part_lengths[i]] == bytes(parts[i])
