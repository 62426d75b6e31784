"""Count a round's tokens as the scheduler keeps them, not as the worker proposed them.

A verified round hands the scheduler a run of accepted drafts plus the full model's bonus
token. SGLang counts the whole run (`spec_num_correct_drafts` in `meta_info`, the accept rate,
accept length and generation throughput of its decode stats and `/metrics`) before a stop
string, stop token or grammar ends the request inside it; the client never sees the tokens
past the end, and plain SGLang never generates them. This hook runs for each request right
after SGLang settled its finish state (and before its output is streamed), takes back what was
counted past the end, and tells the worker what the round really emitted for VeriCache's own
counters.

SGLang also takes the drafts a round proposed to be `--speculative-num-draft-tokens` - 1, which
VeriCache sets to its longest draft; its rounds adapt their length and report what they really
drafted as each request's cap tokens. The accept rate in `meta_info` (with
`spec_num_proposed_drafts`) and `sglang:spec_accept_rate` are recomputed from those.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from vericache_sglang.config import get_config
from vericache_sglang.integration.hooks import hook
from vericache_sglang.integration.internals import internal

PROCESSOR = ("sglang.srt.managers.scheduler_components.batch_result_processor"
             ".SchedulerBatchResultProcessor")
SETTLE_TARGET = f"{PROCESSOR}._handle_finish_state_updated_req"
REPORT_TARGET = ("sglang.srt.managers.scheduler_components.metrics_reporter"
                 ".SchedulerMetricsReporter.report_decode_stats")
META_INFO_TARGET = ("sglang.srt.managers.tokenizer_manager.TokenizerManager"
                    "._calculate_spec_decoding_metrics")
LOG_GAUGE = internal("sglang.srt.observability.metrics_collector.SchedulerMetricsCollector",
                     "_log_gauge", "private call", __name__)
"""How SGLang sets its accept-rate gauge (the same call its reporter makes)."""
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
        worker.settle_round(row=i, emitted=kept, accepted=kept_drafts)
    return original(processor, req, batch, result, i, logits_output)


def _report(original, reporter, can_run_cuda_graph, running_batch=None,
            num_generated_tokens: int = 0) -> Any:
    num_generated_tokens -= getattr(reporter, _UNSETTLED, 0)
    setattr(reporter, _UNSETTLED, 0)
    correct, drafted = reporter.spec_num_correct_drafts, reporter.spec_num_cap_tokens
    result = original(reporter, can_run_cuda_graph, running_batch=running_batch,
                      num_generated_tokens=num_generated_tokens)
    # The interval's counts were reported (and reset) by this call: its accept rate over the
    # drafts really proposed.
    if (hasattr(reporter.scheduler.draft_worker, "settle_round") and drafted
            and reporter.spec_num_cap_tokens == 0):
        reporter.stats.spec_accept_rate = correct / drafted
        if reporter.enable_metrics:
            collector = reporter.metrics_collector
            LOG_GAUGE.call(collector, collector.spec_accept_rate,
                           reporter.stats.spec_accept_rate)
    return result


def _spec_meta_info(original, manager, meta_info: dict[str, Any], recv_obj: Any, i: int) -> Any:
    result = original(manager, meta_info, recv_obj, i)
    if (get_config(manager.server_args).enable_vericache
            and "spec_num_proposed_drafts" in meta_info):
        drafted = recv_obj.spec_num_cap_tokens[i]
        meta_info["spec_num_proposed_drafts"] = drafted
        meta_info["spec_accept_rate"] = (meta_info["spec_num_correct_drafts"] / drafted
                                         if drafted else 0.0)
    return result


def register() -> None:
    hook(SETTLE_TARGET, _settle, HookType.AROUND)
    hook(REPORT_TARGET, _report, HookType.AROUND)
    hook(META_INFO_TARGET, _spec_meta_info, HookType.AROUND)
