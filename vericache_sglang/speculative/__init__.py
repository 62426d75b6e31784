"""Lossless decoding over a compressed KV tier, as an SGLang speculative algorithm.

The target model drafts k tokens attending to a compressed copy of its KV, then one forward
over the full KV verifies them; only tokens equal to the full model's greedy choice are
emitted. See `worker` for a round's mechanics and `policy` for the adaptive draft length.
"""

from vericache_sglang.speculative.algorithm import ALGORITHM, configure, register

__all__ = ["ALGORITHM", "configure", "register"]
