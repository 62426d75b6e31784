"""A timer inside a VeriCache server's scheduler, for `bench.round_host_time` (not imported by
the package): it wraps `VeriCacheWorker.forward_batch_generation` (one call per decode round)
and `ModelRunner.forward` (every forward of the model, drafting and verifying alike), and
writes after each decode round the running totals to `$VERICACHE_ROUND_TIMER_OUT` as JSON.

Round time minus the forwards inside it is the round's host work: planning, page lookups,
checking drafts, acceptance, bookkeeping. On a CPU a forward returns when its compute is done,
so its wall time is its compute; on a GPU the forwards would need a synchronize to be timed
this way. It is loaded as an SGLang plugin (the `sglang.srt.plugins` entry point the benchmark
declares), so it runs against any checkout whose worker has these two methods.
"""

from __future__ import annotations

import json
import os
import time

TOTALS = {"rounds": 0, "round_seconds": 0.0, "forward_seconds_in_rounds": 0.0,
          "forwards_in_rounds": 0, "host_seconds_by_round": []}
_forward = {"seconds": 0.0, "count": 0}


def register() -> None:
    """Wrap the two methods in this process (a no-op where no output file is named)."""
    out = os.environ.get("VERICACHE_ROUND_TIMER_OUT")
    if not out:
        return
    from sglang.srt.model_executor.model_runner import ModelRunner

    from vericache_sglang.speculative.worker import VeriCacheWorker

    model_forward = ModelRunner.forward

    def timed_forward(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return model_forward(self, *args, **kwargs)
        finally:
            _forward["seconds"] += time.perf_counter() - began
            _forward["count"] += 1

    round_ = VeriCacheWorker.forward_batch_generation

    def timed_round(self, batch, *args, **kwargs):
        if not batch.forward_mode.is_decode():
            return round_(self, batch, *args, **kwargs)
        before = dict(_forward)
        began = time.perf_counter()
        result = round_(self, batch, *args, **kwargs)
        seconds = time.perf_counter() - began
        forwards = _forward["seconds"] - before["seconds"]
        TOTALS["round_seconds"] += seconds
        TOTALS["forward_seconds_in_rounds"] += forwards
        TOTALS["host_seconds_by_round"].append(seconds - forwards)
        TOTALS["forwards_in_rounds"] += _forward["count"] - before["count"]
        TOTALS["rounds"] += 1
        with open(out, "w") as f:
            json.dump(TOTALS, f)
        return result

    ModelRunner.forward = timed_forward
    VeriCacheWorker.forward_batch_generation = timed_round
