"""The compressor interface: what a KV compressor takes and what its compressed block offers.

A `Compressor` is a frozen dataclass whose fields are its spec parameters. `compress` turns one
layer's post-RoPE K/V for a run of tokens ([T, H, D] each, int64 positions [T], and optionally
attention probabilities [Hq, W, T] of W observation queries) into a `CompressedKV`; `append`
adds decoded tokens to it. Blocks report their exact storage and give attention what it reads.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from .params import CompressorSpecError, check_value, describe, format_value, spec_params

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors` (None counts as nothing), each storage once: what
    is really allocated, including what a view keeps alive beyond its own elements."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """`storage_bytes` of the given tensors."""
    return storage_bytes(tensors)


def round_half_up(x: float) -> int:
    """round() without banker's rounding, so budgets grow monotonically with the token count."""
    return math.floor(x + 0.5)


class CompressedKV(ABC):
    """One layer's compressed K/V for one request.

    Slots: each KV head holds the same number of slots; slot i of head h is one token. For
    quantizers slot i is the i-th token given; droppers keep per-head subsets (see `positions`).
    """

    @abstractmethod
    def __len__(self) -> int:
        """Number of slots per KV head."""

    @property
    @abstractmethod
    def num_kv_heads(self) -> int: ...

    @property
    @abstractmethod
    def head_dim(self) -> int: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """dtype of the K/V that was compressed (and of `dense`)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Exact bytes of the compressed storage: codes, scales, zero points, index arrays and
        any full-precision part (tensors only; caches kept for reading are not storage)."""

    @abstractmethod
    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [len, H, D] in `dtype`: dequantized and/or kept slots."""

    def positions(self) -> torch.Tensor | None:
        """[H, len] int64 original positions of each head's slots; None when nothing was dropped
        (slot i is then the i-th token given)."""
        return None

    @abstractmethod
    def attend_lse(
        self, q: torch.Tensor, sm_scale: float | None = None, logit_cap: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode attention of one query token q [Hq, D] over this block, reading the compressed
        form directly (no dense copy is kept): (out [Hq, D], lse [Hq]) float32, the log-sum-exp
        letting attention over other keys be merged in (`vericache_kernels.merge_attention`).
        sm_scale defaults to D**-0.5; `logit_cap` > 0 softcaps the logits (Gemma 2)."""

    def attend(self, q: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
        """`attend_lse` without the log-sum-exp."""
        return self.attend_lse(q, sm_scale)[0]


def check_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scores: torch.Tensor | None = None,
    scored_tokens: int | None = None,
) -> None:
    """Validate compress/append inputs; scores cover `scored_tokens` keys (default: the run)."""
    if keys.dim() != 3 or keys.shape != values.shape:
        raise ValueError(f"keys and values must both be [T, H, D], got {tuple(keys.shape)}, "
                         f"{tuple(values.shape)}")
    if keys.dtype not in FLOAT_DTYPES or values.dtype != keys.dtype:
        raise ValueError(f"K/V must share one of {FLOAT_DTYPES}, got {keys.dtype}, {values.dtype}")
    if positions.shape != (keys.shape[0],) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 [{keys.shape[0]}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if scores is not None:
        scored = keys.shape[0] if scored_tokens is None else scored_tokens
        heads = keys.shape[1]
        if scores.dim() != 3 or scores.shape[2] != scored or scores.shape[0] % heads:
            raise ValueError(f"scores must be [Hq, W, {scored}] with Hq a multiple of {heads} "
                             f"KV heads, got {tuple(scores.shape)}")


def check_append(block: CompressedKV, keys: torch.Tensor) -> None:
    """New tokens must match the block's heads, head dim and dtype."""
    expected = (block.num_kv_heads, block.head_dim, block.dtype)
    if (keys.shape[1], keys.shape[2], keys.dtype) != expected:
        raise ValueError(f"appended K/V [T, {keys.shape[1]}, {keys.shape[2]}] {keys.dtype} do not "
                         f"match the block's (H, D, dtype) = {expected}")


class Compressor(ABC):
    """Base of all compressors. Subclasses are frozen dataclasses registered under a name; their
    `param(...)` fields are exactly the keys of their spec string."""

    name: ClassVar[str] = ""
    """Registered method name (set by `register_compressor`)."""
    needs_scores: ClassVar[bool] = False
    """Whether `compress` requires attention scores (token selection by attention)."""
    prefix_stable: ClassVar[bool] = False
    """Whether a whole group of tokens compresses to the same bytes whatever came before or
    after it, so requests sharing a prefix can share its compressed pages
    (`tiers.compressed_pool`). Token droppers pick tokens per request: they cannot."""

    def __post_init__(self) -> None:
        for key, (f, typ) in spec_params(type(self)).items():
            object.__setattr__(self, key, check_value(self.name, f, typ, getattr(self, key)))
        self.check()

    def check(self) -> None:
        """Cross-parameter validation; raise `self.invalid(...)`."""
        return None

    def score_window(self) -> int | None:
        """How many of the last prompt queries `scores` must cover when `needs_scores`; None
        means all of them, which may be passed summed over the queries as [Hq, 1, T]."""
        return None

    def invalid(self, param: str, problem: str) -> CompressorSpecError:
        """The one error type for a bad parameter, naming method and parameter."""
        f, typ = spec_params(type(self))[param]
        return CompressorSpecError(
            f"{self.name}: parameter '{param}' {problem}; valid: {describe(f, typ)}"
        )

    def spec(self) -> str:
        """Canonical spec with every parameter: parse_compressor_spec(c.spec()) == c."""
        params = ",".join(
            f"{key}={format_value(getattr(self, key))}" for key in spec_params(type(self))
        )
        return f"{self.name}:{params}" if params else self.name

    @abstractmethod
    def compress(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scores: torch.Tensor | None = None,
        *,
        layer: int = 0,
    ) -> CompressedKV:
        """Compress one layer's K/V for a run of tokens (see the module docstring for shapes)."""

    block_type: ClassVar[type[CompressedKV]] = CompressedKV
    """The block class this compressor makes; `append` accepts only those."""

    def append(
        self,
        block: CompressedKV,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scores: torch.Tensor | None = None,
    ) -> None:
        """Add decoded tokens [n, H, D] to `block` in place. `scores`, if given, are the new
        queries' attention probabilities over the block's slots then the new tokens:
        [Hq, n, len(block) + n] (GQA: query head j reads slots of KV head j // (Hq // H))."""
        if not isinstance(block, self.block_type):
            raise TypeError(f"{self.name or type(self).__name__} appends to its own "
                            f"{self.block_type.__name__} blocks, got {type(block)}")
        check_kv(keys, values, positions, scores, scored_tokens=len(block) + keys.shape[0])
        check_append(block, keys)
        self._append(block, keys, values, positions, scores)

    @abstractmethod
    def _append(
        self,
        block: CompressedKV,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scores: torch.Tensor | None,
    ) -> None:
        """The method's own part of `append`, on inputs `append` has validated."""

    def ratio_vs_bf16(
        self, num_tokens: int, num_kv_heads: int, head_dim: int, *, layer: int = 0
    ) -> float:
        """Nominal compression: bf16 bytes of that K/V over this compressor's bytes, measured by
        compressing zeros of that shape (uniform scores for methods that need them)."""
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        keys, values = (torch.zeros(num_tokens, num_kv_heads, head_dim, dtype=torch.bfloat16)
                        for _ in range(2))
        scores = None
        if self.needs_scores:
            scores = torch.full((num_kv_heads, 1, num_tokens), 1.0 / max(num_tokens, 1))
        block = self.compress(keys, values, torch.arange(num_tokens), scores, layer=layer)
        return tensor_bytes(keys, values) / block.nbytes()
