"""A CacheGen-style KV codec: chunked, progressive (coarse levels, the compressed pool's pages,
then the exact KV bits), rANS coded in independent lanes, self-describing.

    from vericache_sglang.codec import CodecSpec, encode_chunk, decode_chunk
    spec = CodecSpec.for_compressor(kivi, num_layers=30)
    blob = encode_chunk(keys, values, spec, key=b"page-key")   # [L, n, H, D] each
    coarse = decode_chunk(blob, level=0, key=b"page-key")      # a prefix of blob is enough
    full = decode_chunk(blob, key=b"page-key")                 # full.keys: the exact bits
"""

from .chunk import CodecSpec, DecodedChunk, coarser, decode_chunk, encode, encode_chunk, finer
from .stream import (
    Header,
    StreamCorrupt,
    StreamError,
    StreamForeign,
    StreamTruncated,
    parts_in,
    prefix_length,
    read_header,
)

__all__ = ["CodecSpec", "DecodedChunk", "Header", "StreamCorrupt", "StreamError",
           "StreamForeign", "StreamTruncated", "coarser", "decode_chunk", "encode",
           "encode_chunk", "finer", "parts_in", "prefix_length", "read_header"]
