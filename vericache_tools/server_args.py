"""The one place the demo's, the tests' and the benchmarks' servers get their common arguments.

Every server they compare runs float32 (where VeriCache's output must equal plain SGLang's,
DESIGN.md "What identical means"), seeded, with long prompts prefilled in chunks; the options
below are what differs between them, named for what they are for.
"""

from __future__ import annotations

VERICACHE = ["--enable-vericache", "--vericache-compressor", "kivi:bits=4"]
"""A VeriCache server drafting on a 4-bit KIVI tier."""

HICACHE_STORE_ARGS = ["--enable-hierarchical-cache", "--hicache-ratio", "2",
                      "--hicache-write-policy", "write_through",
                      "--hicache-storage-prefetch-policy", "wait_complete"]
"""SGLang's HiCache in front of a KV store (`--hicache-storage-backend` comes with the store):
every page written through to the store, a prefetch waited for until complete. The host pool
is twice the device pool: SGLang keeps its prefetches within half the host pool."""


def server_args(dtype: str = "float32", *, chunked_prefill_size: int | None = 2048,
                max_running_requests: int | None = None, page_size: int | None = None,
                metrics: bool = False, custom_logit_processor: bool = False,
                overlap: bool = True, warmup: bool = True, seed: int = 0) -> list[str]:
    """`sglang.launch_server` arguments (model, port and pool size come from
    `ServerProcess`). `overlap=False` runs plain SGLang as VeriCache runs it (without the
    overlap scheduler); `warmup=False` skips SGLang's warm-up request (3 s of every start on
    CPU); `metrics` serves /metrics; `custom_logit_processor` lets requests bring one."""
    args = ["--dtype", dtype, "--random-seed", str(seed)]
    if chunked_prefill_size is not None:
        args += ["--chunked-prefill-size", str(chunked_prefill_size)]
    if max_running_requests is not None:
        args += ["--max-running-requests", str(max_running_requests)]
    if page_size is not None:
        args += ["--page-size", str(page_size)]
    if metrics:
        args.append("--enable-metrics")
    if custom_logit_processor:
        args.append("--enable-custom-logit-processor")
    if not overlap:
        args.append("--disable-overlap-schedule")
    if not warmup:
        args.append("--skip-server-warmup")
    return args
