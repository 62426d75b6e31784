"""Count a round's tokens as the scheduler keeps them, not as the worker proposed them.

A verified round hands the scheduler a run of accepted drafts plus the full model's bonus
token. SGLang counts the whole run (`spec_num_correct_drafts` in `meta_info`, the accept rate,
accept length and generation throughput of its decode stats and `/metrics`) before a stop
string, stop token or grammar ends the request inside it; the client never sees the tokens
past the end, and plain SGLang never generates them. This hook runs for each request right
after SGLang settled its finish state (and before its output is streamed), takes back what was
counted past the end, and tells the worker what the round really emitted for VeriCache's own
counters.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

PROCESSOR = ("sglang.srt.managers.scheduler_components.batch_result_processor"
             ".SchedulerBatchResultProcessor")
SETTLE_TARGET = f"{PROCESSOR}._handle_finish_state_updated_req"
REPORT_TARGET = ("sglang.srt.managers.scheduler_components.metrics_reporter"
                 ".SchedulerMetricsReporter.report_decode_stats")
_UNSETTLED = "_vericache_tokens_past_the_end"
"""Tokens of this step's runs cut off by a finish, kept on the metrics reporter until its
decode stats (the realtime token counter) are reported."""


def kept_by_finish(req: Any, appended: int) -> int:
    """How many of the `appended` tokens just added to `req.output_ids` the request keeps: all
    of them, unless the finish state it just settled cut the output short."""
    if req.finished_len is None:
        return appended
    return max(0, appended - (len(req.output_ids) - req.finished_len))


def _settle(original, processor, req, batch, result, i: int, logits_output) -> Any:
    worker = processor.model_worker
    if hasattr(worker, "settle_round") and result.accept_lens is not None:
        run = int(result.accept_lens[i])
        retained = getattr(result, "grammar_retained_tokens", None)
        appended = len(retained[i]) if retained and retained[i] is not None else run
        kept = kept_by_finish(req, appended)
        correct = result.num_correct_drafts_per_req_cpu[i]
        kept_drafts = min(correct, kept)
        over_drafts, over_tokens = correct - kept_drafts, run - kept
        if over_tokens:
            req.spec_num_correct_drafts -= over_drafts
            histogram = req.spec_correct_drafts_histogram
            histogram[correct] -= 1
            req.update_spec_correct_drafts_histogram(kept_drafts)
            reporter = processor.metrics_reporter
            reporter.spec_num_correct_drafts -= over_drafts
            reporter.spec_num_accept_tokens -= over_tokens
            reporter.num_generated_tokens -= over_tokens
            setattr(reporter, _UNSETTLED, getattr(reporter, _UNSETTLED, 0) + over_tokens)
        worker.settle_round(emitted=kept, accepted=kept_drafts)
    return original(processor, req, batch, result, i, logits_output)


def _report(original, reporter, can_run_cuda_graph, running_batch=None,
            num_generated_tokens: int = 0) -> Any:
    num_generated_tokens -= getattr(reporter, _UNSETTLED, 0)
    setattr(reporter, _UNSETTLED, 0)
    return original(reporter, can_run_cuda_graph, running_batch=running_batch,
                    num_generated_tokens=num_generated_tokens)


def register() -> None:
    HookRegistry.register(SETTLE_TARGET, _settle, HookType.AROUND)
    HookRegistry.register(REPORT_TARGET, _report, HookType.AROUND)
