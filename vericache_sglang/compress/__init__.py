"""KV-cache compressors for drafting on a lossy cache: quantizers, token droppers, compositions.

    from vericache_sglang.compress import parse_compressor_spec
    c = parse_compressor_spec("snapkv:ratio=0.5+kivi:bits=4")
    block = c.compress(keys, values, positions, scores, layer=3)   # [T, H, D] post-RoPE
    c.append(block, new_keys, new_values, new_positions)
    out = block.attend(q)            # reads the compressed form; block.nbytes() is exact

See docs/compressors.md for the methods, their parameters and how to add one.
"""

from . import h2o, kivi, kivi_mixed, snapkv, streaming  # noqa: F401  (registers the built-ins)
from .base import CompressedKV, Compressor
from .composed import ComposedCompressor, ComposedKV
from .dropper import DroppedKV, TokenDropper
from .params import CompressorSpecError, param
from .quant import KiviQuantizer, QuantizedKV, QuantPlan
from .registry import available_compressors, parse_compressor_spec, register_compressor

__all__ = [
    "ComposedCompressor",
    "ComposedKV",
    "CompressedKV",
    "Compressor",
    "CompressorSpecError",
    "DroppedKV",
    "KiviQuantizer",
    "QuantPlan",
    "QuantizedKV",
    "TokenDropper",
    "available_compressors",
    "param",
    "parse_compressor_spec",
    "register_compressor",
]
