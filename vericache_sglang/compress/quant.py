"""KIVI-style quantization mechanics shared by `kivi` and `kivi_mixed`.

A block is [old tier | recent tier | fp residual] along the tokens. New tokens enter the residual;
once it holds `residual + group` tokens, its oldest whole groups are quantized into the recent
tier (so key groups always span `group` tokens); groups beyond the recent tier's `recent` tokens
move to the old tier, requantized to the old tier's bits when those differ.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

import vericache_kernels as kernels

from .base import CompressedKV, Compressor, check_kv, tensor_bytes


@dataclass(frozen=True)
class QuantPlan:
    """How one layer is quantized (a method's parameters resolved for that layer)."""

    old_bits: int
    """Bits of tokens older than the recent tier."""
    recent_bits: int
    """Bits of the `recent` most recently quantized tokens."""
    recent: int
    """Tokens in the recent tier, a multiple of group (0: one tier)."""
    group: int
    """Tokens per key group; channels per value group is gcd(group, head_dim)."""
    residual: int
    """Newest tokens kept at full precision (up to residual + group - 1 of them)."""


@dataclass(eq=False)
class QuantTier:
    """Tokens quantized at one bit width, in the `kernels.layout` layout."""

    bits: int
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor

    @classmethod
    def quantize(cls, keys: torch.Tensor, values: torch.Tensor, bits: int, group: int) -> QuantTier:
        """Quantize [n, H, D] K/V, n a multiple of `group`."""
        v_group = math.gcd(group, keys.shape[2])
        return cls(bits, *kernels.quantize_keys(keys, group, bits),
                   *kernels.quantize_values(values, v_group, bits))

    def __len__(self) -> int:
        return self.v_codes.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero)

    def dequantize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tier's K/V in `dtype`: a new dense copy, which nothing here keeps."""
        keys = kernels.dequantize_keys(self.k_codes, self.k_scale, self.k_zero, self.bits, dtype)
        values = kernels.dequantize_values(
            self.v_codes, self.v_scale, self.v_zero, self.bits, dtype
        )
        return keys, values

    def split(self, tokens: int, group: int) -> tuple[QuantTier, QuantTier]:
        """(first `tokens` tokens, the rest); `tokens` is a multiple of `group`."""
        cuts = [tokens // group] * 3 + [tokens] * 3
        head = QuantTier(self.bits, *(t[:c] for t, c in zip(self.tensors(), cuts, strict=True)))
        # The tail stays in the block: copy it so it does not pin the head's memory.
        tail = QuantTier(self.bits, *(t[c:].clone() for t, c in zip(self.tensors(), cuts,
                                                                      strict=True)))
        return head, tail

    def concat(self, other: QuantTier) -> QuantTier:
        """This tier followed by `other` (same bits)."""
        pairs = zip(self.tensors(), other.tensors(), strict=True)
        return QuantTier(self.bits, *(torch.cat(p) for p in pairs))

    def packed(self, group: int) -> kernels.PackedKV:
        """This tier as a batch of one for `kernels.decode_attention`."""
        lengths = torch.tensor([len(self)], dtype=torch.int32, device=self.v_codes.device)
        return kernels.PackedKV(*(t[None] for t in self.tensors()), lengths=lengths,
                                bits=self.bits, group=group,
                                v_group=math.gcd(group, self.k_codes.shape[2]))


@dataclass(eq=False)
class QuantizedKV(CompressedKV):
    """[old tier | recent tier | fp residual] of one layer and request."""

    plan: QuantPlan
    old: QuantTier
    recent: QuantTier
    k_res: torch.Tensor
    """[r, H, D] newest keys at full precision."""
    v_res: torch.Tensor
    """[r, H, D] newest values at full precision."""

    def __len__(self) -> int:
        return len(self.old) + len(self.recent) + self.k_res.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_res.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_res.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_res.dtype

    def nbytes(self) -> int:
        return tensor_bytes(*self.old.tensors(), *self.recent.tensors(), self.k_res, self.v_res)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.old.dequantize(self.dtype)
        new_k, new_v = self.recent.dequantize(self.dtype)
        return torch.cat([old_k, new_k, self.k_res]), torch.cat([old_v, new_v, self.v_res])

    def attend_lse(self, q: torch.Tensor, sm_scale: float | None = None,
                   logit_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.head_dim**-0.5 if sm_scale is None else sm_scale
        res_len = torch.tensor([self.k_res.shape[0]], device=q.device)
        empty = self.k_res[:0][None]
        parts = [
            kernels.decode_attention(q[None], tier.packed(self.plan.group), *kv, lengths, scale,
                                     logit_cap=logit_cap)
            for tier, kv, lengths in (
                (self.old, (empty, empty), torch.zeros_like(res_len)),
                (self.recent, (self.k_res[None], self.v_res[None]), res_len),
            )
        ]
        out, lse = kernels.merge_attention(parts)
        return out[0], lse[0]

    def push(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add tokens to the residual, quantize its oldest whole groups beyond `residual`, and
        move what overflows the recent tier to the old tier (requantized if the bits differ)."""
        plan = self.plan
        k_res, v_res = torch.cat([self.k_res, keys]), torch.cat([self.v_res, values])
        fresh = max(k_res.shape[0] - plan.residual, 0) // plan.group * plan.group
        self.k_res, self.v_res = k_res[fresh:].clone(), v_res[fresh:].clone()
        aged = max(len(self.recent) + fresh - plan.recent, 0)
        from_recent = min(aged, len(self.recent))
        if from_recent:
            moved, self.recent = self.recent.split(from_recent, plan.group)
            if moved.bits != plan.old_bits:
                # Requantized from its dequantized values: errors add, scale_hi/2 + scale_lo/2.
                moved = QuantTier.quantize(*moved.dequantize(torch.float32), plan.old_bits,
                                           plan.group)
            self.old = self.old.concat(moved)
        direct = aged - from_recent  # fresh tokens that are already old: quantized once, directly
        if direct:
            self.old = self.old.concat(
                QuantTier.quantize(k_res[:direct], v_res[:direct], plan.old_bits, plan.group)
            )
        if fresh > direct:
            self.recent = self.recent.concat(QuantTier.quantize(
                k_res[direct:fresh], v_res[direct:fresh], plan.recent_bits, plan.group
            ))


class KiviQuantizer(Compressor):
    """Base of KIVI-style quantizers: methods map a layer index to a `QuantPlan`."""

    block_type: ClassVar[type[CompressedKV]] = QuantizedKV

    @property
    def prefix_stable(self) -> bool:  # type: ignore[override]
        # A group's codes depend on its own tokens alone unless tokens are requantized as they
        # age out of a recent tier.
        return self.plan(0).recent == 0

    @abstractmethod
    def plan(self, layer: int) -> QuantPlan:
        """Bit allocation and windows for `layer`."""

    def compress(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scores: torch.Tensor | None = None,
        *,
        layer: int = 0,
    ) -> QuantizedKV:
        check_kv(keys, values, positions, scores)
        if keys.shape[2] % 4:
            raise ValueError(f"{self.spec()}: head_dim {keys.shape[2]} must be a multiple of 4 "
                             "to pack values per token")
        plan = self.plan(layer)
        empty = keys.new_empty((0, *keys.shape[1:]))
        block = QuantizedKV(
            plan,
            QuantTier.quantize(empty, empty, plan.old_bits, plan.group),
            QuantTier.quantize(empty, empty, plan.recent_bits, plan.group),
            empty,
            empty,
        )
        block.push(keys, values)
        return block

    def _append(
        self,
        block: CompressedKV,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scores: torch.Tensor | None,
    ) -> None:
        block.push(keys, values)
