"""The round's forwards of the target model: their `ForwardBatch`es, built in one place, and
running them through an attention backend of VeriCache's choosing.

SGLang builds a decode step's `ForwardBatch` from the scheduler's batch; a round's draft,
verify and first-position forwards have rows of their own (a request's chain positions), so
they are built here from the round (`round.py`). Host values SGLang's forward needs
(`seq_lens_cpu`, `seq_lens_sum`) come from the round's host copy of the committed lengths,
never from the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from sglang.srt.environ import envs
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from vericache_sglang.cpu.few_rows import few_row_linear
from vericache_sglang.speculative.info import VeriCacheVerifyInput
from vericache_sglang.speculative.round import Round


def _forward_batch(mode: ForwardMode, *, input_ids: torch.Tensor,
                   req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                   seq_lens_cpu: torch.Tensor, out_cache_loc: torch.Tensor,
                   positions: torch.Tensor, seq_lens_sum: int | None = None,
                   **fields: Any) -> ForwardBatch:
    """The fields every round forward sets; `fields` adds the mode's own. `seq_lens_sum`, where
    the caller knows it, spares reading the host lengths back."""
    if seq_lens_sum is None:
        seq_lens_sum = int(seq_lens_cpu.sum())
    return ForwardBatch(
        forward_mode=mode, batch_size=len(req_pool_indices), input_ids=input_ids,
        req_pool_indices=req_pool_indices, seq_lens=seq_lens, out_cache_loc=out_cache_loc,
        seq_lens_sum=seq_lens_sum, seq_lens_cpu=seq_lens_cpu, positions=positions, **fields,
    )


def draft_forward_batch(batch, round_: Round, requests: list[int], steps: list[int],
                        input_ids: torch.Tensor) -> ForwardBatch:
    """A forward over the compressed tier whose rows are the tokens at committed length +
    `steps[r]` of request `requests[r]`. Built from the round's host plan: no value is read
    back from the device (a drafting step can be captured as a CUDA graph)."""
    device = round_.committed.device
    lens = [round_.committed_host[r] + s + 1 for r, s in zip(requests, steps, strict=True)]
    rows = torch.tensor(requests, dtype=torch.int64, device=device)
    steps_dev = torch.tensor(steps, dtype=torch.int64, device=device)
    positions = round_.committed[rows] + steps_dev
    return _forward_batch(
        ForwardMode.DECODE, input_ids=input_ids, req_pool_indices=batch.req_pool_indices[rows],
        seq_lens=positions + 1, seq_lens_cpu=torch.tensor(lens), seq_lens_sum=sum(lens),
        out_cache_loc=round_.locs[rows, steps_dev],
        positions=positions, spec_algorithm=SpeculativeAlgorithm.NONE, spec_info=None,
        capture_hidden_mode=CaptureHiddenMode.NULL, return_hidden_states_before_norm=False,
    )


def chain_forward_batch(batch, tokens: torch.Tensor, committed: torch.Tensor,
                        committed_cpu: torch.Tensor, positions: torch.Tensor,
                        locs: torch.Tensor, width: int) -> ForwardBatch:
    """One TARGET_VERIFY forward of a `width`-token chain per request (`tokens`, `positions`
    and `locs` flattened request by request) over its `committed` KV, the chain's K/V written
    at `locs`."""
    return _forward_batch(
        ForwardMode.TARGET_VERIFY, input_ids=tokens, req_pool_indices=batch.req_pool_indices,
        seq_lens=committed, seq_lens_cpu=committed_cpu, out_cache_loc=locs,
        positions=positions, spec_algorithm=batch.spec_algorithm,
        spec_info=VeriCacheVerifyInput(draft_token_num=width, positions=positions),
        capture_hidden_mode=CaptureHiddenMode.NULL, return_hidden_states_before_norm=False,
    )


def verify_forward_batch(batch, round_: Round) -> ForwardBatch:
    """One TARGET_VERIFY forward of every request's chain [t0, d1..dk]."""
    return chain_forward_batch(batch, round_.chain().reshape(-1), round_.committed,
                               round_.committed_cpu, round_.positions.reshape(-1),
                               round_.locs.reshape(-1), round_.k + 1)


def first_position_forward_batch(batch, round_: Round) -> ForwardBatch:
    """The decode step plain SGLang would run at chain position 0: what its sampler reads
    (sampling parameters, logprob requests) when it samples from the verify logits there."""
    return _forward_batch(
        ForwardMode.DECODE, input_ids=round_.tokens[0], req_pool_indices=batch.req_pool_indices,
        seq_lens=round_.committed + 1, seq_lens_cpu=round_.committed_cpu + 1,
        out_cache_loc=round_.locs[:, 0], positions=round_.committed,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        # The round's grammar masks, penalties and bias are already on these logits.
        sampling_info=dataclasses.replace(
            batch.sampling_info, grammars=None, penalizer_orchestrator=None,
            acc_additive_penalties=None, acc_scaling_penalties=None, logit_bias=None),
        return_logprob=batch.return_logprob, top_logprobs_nums=batch.top_logprobs_nums,
        token_ids_logprobs=batch.token_ids_logprobs,
    )


def prefill_sampling_forward_batch(batch) -> ForwardBatch:
    """What SGLang's sampler reads when it takes a prefill's first token from logits computed
    here (`early.prefill_over_exact`): the batch's own sampling info, whose grammar masks,
    penalties and bias the sampler applies as in SGLang's prefill, and each request's last
    prompt position (where a seeded request draws). SGLang gives the sampling info its
    requests' grammars when it builds a forward from the batch (`ForwardBatch.init_new`);
    this forward is not built from it, so they are given here the same way."""
    seq_lens_cpu = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()
    grammars = [req.grammar for req in batch.reqs] if batch.has_grammar else None
    return _forward_batch(
        ForwardMode.DECODE, input_ids=batch.input_ids, req_pool_indices=batch.req_pool_indices,
        seq_lens=batch.seq_lens, seq_lens_cpu=seq_lens_cpu, out_cache_loc=batch.out_cache_loc,
        positions=batch.seq_lens - 1, spec_algorithm=SpeculativeAlgorithm.NONE,
        sampling_info=dataclasses.replace(batch.sampling_info, grammars=grammars),
        return_logprob=False,
    )


def extend_forward_batch(input_ids: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, prefix_lens: torch.Tensor,
                         out_cache_loc: torch.Tensor, positions: torch.Tensor) -> ForwardBatch:
    """An extend of each request's tokens from `prefix_lens` to `seq_lens` over its cached
    KV before them (recomputing a prefix's KV into its slots, `early.py`)."""
    lens_cpu, prefix_cpu = seq_lens.cpu(), prefix_lens.cpu()
    extend = (seq_lens - prefix_lens).to(torch.int32)
    extend_cpu = (lens_cpu - prefix_cpu).tolist()
    return _forward_batch(
        ForwardMode.EXTEND, input_ids=input_ids, req_pool_indices=req_pool_indices,
        seq_lens=seq_lens, seq_lens_cpu=lens_cpu, out_cache_loc=out_cache_loc,
        positions=positions, extend_num_tokens=sum(extend_cpu), extend_seq_lens=extend,
        extend_prefix_lens=prefix_lens.to(torch.int32),
        extend_start_loc=(torch.cumsum(extend, 0) - extend).to(torch.int32),
        extend_seq_lens_cpu=extend_cpu, extend_prefix_lens_cpu=prefix_cpu.tolist(),
        extend_logprob_start_lens_cpu=extend_cpu,
        spec_algorithm=SpeculativeAlgorithm.NONE, spec_info=None,
        capture_hidden_mode=CaptureHiddenMode.NULL, return_hidden_states_before_norm=False,
    )


class TargetForwards:
    """Runs the target model's forwards through an attention backend chosen per forward."""

    def __init__(self, target_worker) -> None:
        self.target_worker = target_worker
        self.model_runner = target_worker.model_runner

    @contextlib.contextmanager
    def bound(self, backend, forward_batch: ForwardBatch | None = None) -> Iterator[None]:
        """Run the target model's forwards through `backend` (planning and layers alike)."""
        runner = self.model_runner
        saved = runner.attn_backend, runner.decode_cuda_graph_runner
        runner.attn_backend, runner.decode_cuda_graph_runner = backend, None
        try:
            with forward_context(ForwardContext(attn_backend=backend), forward_batch=forward_batch):
                yield
        finally:
            runner.attn_backend, runner.decode_cuda_graph_runner = saved

    def logits(self, backend, forward_batch: ForwardBatch):
        """The logits output of a forward built here, run through `backend`."""
        self.model_runner.kv_index_translator.bind_own_plan(forward_batch)
        with self.bound(backend, forward_batch):
            result = self.target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch, is_verify=True
            )
        return result.logits_output

    def draft_logits(self, backend, forward_batch: ForwardBatch,
                     batch_size: int) -> torch.Tensor:
        """Logits [rows, V] of a drafting forward over the compressed tier."""
        # Drafts are checked again over the full KV, so their forward may take the faster
        # few-row GEMM form (cpu/few_rows.py); verification keeps SGLang's.
        with few_row_linear(forward_batch.input_ids.device):
            if forward_batch.batch_size <= batch_size:
                return self.logits(backend, forward_batch).next_token_logits
            # More rows than the scheduler's batch: SGLang's eager runner would copy them into
            # input buffers sized for its largest decode batch; run them from their own
            # tensors, SGLang's no-copy eager mode.
            with envs.SGLANG_EAGER_INPUT_NO_COPY.override(True):
                return self.logits(backend, forward_batch).next_token_logits

    def full_kv(self, full_backend) -> contextlib.AbstractContextManager:
        """Where a plain forward over the full KV runs: SGLang's own attention, or, with the
        full KV in host memory, the staged backend."""
        if full_backend is not None:
            return self.bound(full_backend)
        return contextlib.nullcontext()
