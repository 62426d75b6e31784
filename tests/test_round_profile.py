"""bench.round_profile's attribution of py-spy samples (its server run is a benchmark)."""

from __future__ import annotations

from bench.round_profile import classify

WORKER = "forward_batch_generation (/x/vericache_sglang/speculative/worker.py:210)"
LOOP = "event_loop_normal (/x/sglang/srt/managers/scheduler.py:1000)"
MODEL = "forward (/x/sglang/srt/models/llama.py:400)"
BACKEND = "forward_decode (/x/vericache_sglang/attention/draft.py:230)"
CHECK = "check_proposals (/x/vericache_sglang/speculative/sampling.py:200)"


def test_samples_are_attributed_to_forwards_host_work_or_the_scheduler():
    raw = "\n".join([
        f"Thread 1 (active);{LOOP};{WORKER};{MODEL};{BACKEND} 30",  # attention in a forward
        f"Thread 1 (active);{LOOP};{WORKER};{MODEL} 50",
        f"Thread 1 (active);{LOOP};{WORKER};{CHECK} 15",  # between forwards
        f"Thread 1 (active);{LOOP} 5",
        "Thread 2 (prefetch);io_loop (/x/sglang/srt/managers/cache_controller.py:1) 99",
    ])
    samples = classify(raw)
    assert samples == {"forward": 80, "round host work": 15, "scheduler": 5}
