"""Full-precision attention over a full tier in host memory, streamed through the staging area.

With `--vericache-full-tier host`, every forward that attends to the full KV (prefill and its
chunks, verification, a plain decode step) runs through this backend. Before layer 0 it plans
the forward's staging units (`tiers/staging.py`): each request's prefix rows of the full tier,
one layer at a time; verification's units are planned and started by the worker when the round's
drafting starts, so the copies run behind the draft steps. Per layer it waits for that layer's
units only, writes the forward's own new K/V in behind each staged prefix, and runs exactly the
attention SGLang's torch_native backend (or, for verification, `VerifyAttnBackend`) runs, over
the staged rows instead of the pool: the same keys in the same order, so the same result. On a
server whose attention backend is SGLang's Triton backend, verification runs that backend's own
extend kernel over each unit instead, reading every request's staged prefix by index and its
chain as the extend part, causally, as Triton's TARGET_VERIFY does over the pool.

New K/V go to the host tier as they are computed (prefill, plain decode); a verify chain's K/V
are kept for the round and only the accepted tokens' are written (`commit_chain`), so rejected
drafts reach neither tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from vericache_sglang.attention.features import logit_cap, sliding_window
from vericache_sglang.attention.verify import VerifyAttnBackend, VerifyPlan
from vericache_sglang.compress.base import storage_bytes
from vericache_sglang.tiers.staging import Fetch, StagingArea, Unit

Observer = Callable[[torch.Tensor, object, object], None]
"""Called with (q, layer, forward_batch) after a prefill layer (prompt scores for droppers)."""


class StagedFullKVAttnBackend(VerifyAttnBackend):
    """SGLang attention whose full KV is read from the staging area, not the pool."""

    def __init__(self, model_runner, staging: StagingArea, observer: Observer | None = None,
                 *, triton_verify: bool = False) -> None:
        """`triton_verify`: verify with SGLang's Triton extend kernel (the server decodes with
        SGLang's Triton backend), else with `VerifyAttnBackend`'s masked SDPA."""
        super().__init__(model_runner)
        self.staging = staging
        self.observer = observer
        self.triton_verify = triton_verify
        self._fetch: Fetch | None = None
        self._reads: dict[tuple[int, ...], VerifyPlan | TritonReads] = {}
        """The verify forward's reads per unit group, the same at every layer."""
        self._chain: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- planning -------------------------------------------------------------------------------
    def prefetch(self, req_slots: list[int], prefix_lens: list[int], new_tokens: int) -> None:
        """Start staging a forward's full KV ahead of it (verification: when drafting starts)."""
        self.finish()
        self._reads.clear()
        req_to_token = self.req_to_token_pool.req_to_token
        rows = [req_to_token[slot, :n] for slot, n in zip(req_slots, prefix_lens, strict=True)]
        self._fetch = self.staging.start(self.staging.plan(rows, [new_tokens] * len(rows)))

    def init_forward_metadata(self, forward_batch) -> None:
        super().init_forward_metadata(forward_batch)
        if self._fetch is not None:
            return
        mode = forward_batch.forward_mode
        slots = forward_batch.req_pool_indices.tolist()
        if mode.is_decode():
            lens = _cpu_list(forward_batch.seq_lens_cpu, forward_batch.seq_lens)
            prefix, new = [n - 1 for n in lens], [1] * len(lens)
        elif mode.is_extend() and not mode.is_target_verify():
            prefix = _cpu_list(forward_batch.extend_prefix_lens_cpu,
                               forward_batch.extend_prefix_lens)
            new = _cpu_list(forward_batch.extend_seq_lens_cpu, forward_batch.extend_seq_lens)
        else:
            raise RuntimeError(f"VeriCache: no staged plan for a {mode} forward")
        req_to_token = self.req_to_token_pool.req_to_token
        rows = [req_to_token[slot, :n] for slot, n in zip(slots, prefix, strict=True)]
        self._fetch = self.staging.start(self.staging.plan(rows, new))

    def _verify_plan(self, forward_batch) -> None:
        return None  # a verify forward reads the staging units, planned per unit

    def finish(self) -> None:
        """Release whatever a forward left staged (after an error, or a prefetch never run)."""
        if self._fetch is not None:
            self.staging.drain(self._fetch)
            self._fetch = None

    # -- forwards -------------------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        _check_layer(layer)
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k_ = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim)
        v_ = v.reshape(-1, layer.tp_k_head_num, layer.v_head_dim)
        o_ = q.new_empty((q_.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        if forward_batch.forward_mode.is_target_verify():
            width = forward_batch.spec_info.draft_token_num
            self._chain[layer.layer_id] = (k_, v_)
            for unit, local, (a, b) in self._units(layer, k_, v_, lambda _: width):
                rows = slice(a * width, b * width)
                reads = self._unit_reads(unit, local, width)
                if isinstance(reads, TritonReads):
                    reads.attend(q_[rows], k_[rows], v_[rows], o_[rows], unit, layer)
                else:
                    o_[rows] = reads.attend(q_[rows], unit.k, unit.v, layer)
        else:
            if save_kv_cache:
                self._write(layer, forward_batch.out_cache_loc, k, v)
            new = _cpu_list(forward_batch.extend_seq_lens_cpu, forward_batch.extend_seq_lens)
            starts = [0, *torch.tensor(new).cumsum(0).tolist()]
            for unit, local, (a, b) in self._units(layer, k_, v_, lambda i: new[i], starts):
                self._run_sdpa_forward_extend(
                    q_[starts[a]:starts[b]], o_[starts[a]:starts[b]], unit.k, unit.v, local,
                    torch.arange(len(local)), torch.tensor(unit.total),
                    torch.tensor(unit.prefix), torch.tensor(new[a:b]), None,
                    scaling=layer.scaling, enable_gqa=_gqa(layer), causal=True)
            if self.observer is not None:
                self.observer(q, layer, forward_batch)
        return o_.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        _check_layer(layer)
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k_ = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim)
        v_ = v.reshape(-1, layer.tp_k_head_num, layer.v_head_dim)
        o_ = q.new_empty((q_.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        if save_kv_cache:
            self._write(layer, forward_batch.out_cache_loc, k, v)
        for unit, local, (a, b) in self._units(layer, k_, v_, lambda _: 1):
            self._run_sdpa_forward_decode(
                q_[a:b], o_[a:b], unit.k, unit.v, local, torch.arange(len(local)),
                torch.tensor(unit.total), None, scaling=layer.scaling, enable_gqa=_gqa(layer),
                causal=False)
        return o_.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    # -- after verification ---------------------------------------------------------------------
    def commit_chain(self, locs: torch.Tensor, accept_lens: torch.Tensor) -> None:
        """Write the accepted part of the verified chains to the host tier: the first
        `accept_lens[i]` of request i's chain [t0, d1..dk] at `locs` [bs, k + 1]."""
        keep = torch.arange(locs.shape[1], device=locs.device)[None] < accept_lens[:, None]
        rows = locs[keep]
        flat = keep.flatten()
        for layer_id, (k, v) in self._chain.items():
            pool_k = self.token_to_kv_pool.get_key_buffer(layer_id)
            pool_v = self.token_to_kv_pool.get_value_buffer(layer_id)
            pool_k[rows.to(pool_k.device)] = k[flat].to(pool_k.device, pool_k.dtype)
            pool_v[rows.to(pool_v.device)] = v[flat].to(pool_v.device, pool_v.dtype)
        self._chain.clear()

    def round_buffer_bytes(self) -> int:
        """Device bytes of the verify chain's K/V kept until acceptance."""
        return storage_bytes([t for pair in self._chain.values() for t in pair])

    # -- internals ------------------------------------------------------------------------------
    def _unit_reads(self, unit: Unit, local: torch.Tensor,
                    width: int) -> VerifyPlan | TritonReads:
        """What a verify unit's attention reads: built at the forward's first layer, since
        every layer groups the requests alike."""
        group = tuple(unit.requests)
        if group not in self._reads:
            self._reads[group] = (
                TritonReads.of(unit, width) if self.triton_verify else
                VerifyPlan.of(local, torch.arange(len(local), device=local.device),
                              torch.tensor(unit.prefix), max(unit.prefix), width))
        return self._reads[group]

    def _units(self, layer, k: torch.Tensor, v: torch.Tensor, new_of: Callable[[int], int],
               starts: list[int] | None = None) -> Iterator[tuple[Unit, torch.Tensor,
                                                                   tuple[int, int]]]:
        """This layer's staged units, each with the forward's new K/V written in behind every
        request's prefix; yields (unit, local row map [n, max rows], batch rows [a, b))."""
        if self._fetch is None:
            raise RuntimeError("VeriCache: a staged forward ran without a plan")
        fetch = self._fetch
        for unit in fetch.by_layer[layer.layer_id]:
            self.staging.wait(unit)
            try:
                a, b = unit.requests[0], unit.requests[-1] + 1
                for j, i in enumerate(unit.requests):
                    n = new_of(i)
                    src = slice(starts[i], starts[i] + n) if starts else slice(i * n, (i + 1) * n)
                    at = unit.starts[j] + unit.prefix[j]
                    unit.k[at:at + n] = k[src]
                    unit.v[at:at + n] = v[src]
                width = max(unit.total)
                local = (torch.tensor(unit.starts)[:, None] + torch.arange(width)[None]).to(
                    unit.k.device)
                yield unit, local, (a, b)
            finally:
                self.staging.release(unit)
        if layer.layer_id == self.staging.layers - 1:
            self._fetch = None

    def _write(self, layer, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """New K/V to the host tier at their SGLang slots."""
        self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(loc, self.swa_out_cache_loc),
                                            k, v)


@dataclass(frozen=True)
class TritonReads:
    """A verify unit's reads for SGLang's Triton extend kernel: each request's `width` chain
    queries over its staged prefix, by index into the unit, and causally its chain. The
    arguments Triton's TARGET_VERIFY passes with `custom_mask=None`, with the unit's buffers in
    place of the pool's."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    width: int

    @classmethod
    def of(cls, unit: Unit, width: int) -> TritonReads:
        device = unit.k.device
        prefix = torch.tensor(unit.prefix, dtype=torch.int32)
        kv_indptr = torch.zeros(len(unit.prefix) + 1, dtype=torch.int32)
        kv_indptr[1:] = prefix.cumsum(0)
        kv_indices = torch.cat([torch.arange(start, start + n) for start, n in
                                zip(unit.starts, unit.prefix, strict=True)])
        qo_indptr = torch.arange(len(unit.prefix) + 1, dtype=torch.int32) * width
        return cls(qo_indptr.to(device), kv_indptr.to(device), kv_indices.to(device), width)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
               unit: Unit, layer) -> None:
        """Writes `o` for the unit's chains (`q`, `k`, `v`: theirs, request after request)."""
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

        extend_attention_fwd(q, k, v, o, unit.k, unit.v, self.qo_indptr, self.kv_indptr,
                             self.kv_indices, None, True, None, self.width, 1.0, 1.0,
                             sm_scale=layer.scaling)


def _cpu_list(cpu: torch.Tensor | list | None, fallback: torch.Tensor) -> list[int]:
    values = fallback if cpu is None else cpu
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def _gqa(layer) -> bool:
    return layer.tp_q_head_num != layer.tp_k_head_num


def _check_layer(layer) -> None:
    """The startup check (`features.refusal`) keeps these layers off the host tier."""
    if layer.is_cross_attention or sliding_window(layer) is not None or logit_cap(layer) > 0:
        raise NotImplementedError("VeriCache's host full tier serves causal full attention "
                                  "only (no sliding-window, softcapped or cross-attention "
                                  "layers)")
