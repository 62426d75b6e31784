"""A stored prefix behind an emulated link: time to the first, the n-th and the last token, and
bytes over the link per request, for plain SGLang recomputing, plain SGLang's HiCache fetching
the full KV, and VeriCache fetching its coded pages (not a test).

The link is emulation (`vericache_tools.shaped_link`): a network namespace whose loopback caps
the Mooncake store's data ports at a set rate; the store, the servers and this script's client
all run inside it (a child process, `--inside`, that hands its results back as a JSON file).
One server runs at a time (each is ~5 GB on CPU). For each configuration that reads the store,
server A answers every prefix the timed requests will use with one token and
stops once their pages are stored; server B, started afterwards on the same store, answers the
timed requests, streamed, at each rate of `--rates-mbit` in turn (the shaped class's rate is
changed in place, `tc class change`) and each batch size of `--batch`: batch n sends n requests
at once, each a different stored prefix plus the same 60-token question, so none finds another's
pages in B's host cache, and every (rate, batch) cell has prefixes of its own, since B keeps
what it read. The times are per request, from sending it; the bytes are what crossed the shaped
class while the batch ran (`tc -s class show`), divided by n. Plain SGLang without a store
answers the same requests: every output is compared with its output, token for token, and
with plain SGLang's HiCache's (in bfloat16 the reference with the same arguments: a prefix read
from a cache is not computed bit for bit as a recomputed one).

Every server B first answers a long prompt nobody stored and, at each rate before that rate's
requests, a short one A stored, as a server that has been serving would have:
`vericache-auto` (`--vericache-store-reads auto`) has then measured its read and prefill rates
on this link, and recomputes the stored prefix when reading it is the slower. Timed requests
start once B's own backups have been stored, so their time and link bytes are their own. What
`vericache` reads a page's whole stream before answering SGLang's prefetch, as SGLang's
own prefetch waits for the full KV; `vericache-early` (`--vericache-early-drafting`) answers
once a page's drafting level is in, drafts on the compressed pages while the exact KV still
arrives, and counts the drafts made before it (`early drafts`) and those later accepted; its
pages draft on the pool's level where the measured link fits it in the drafting deadline (1 s),
else on the coarse level; `vericache-early-coarse` always takes the coarse level first.
With `--bystander` another request is already decoding on server B (streamed) when each timed
batch is sent: its largest gap between tokens while the batch's prefixes load (until every
request of the batch has its first token) and until the batch is done.

`python -m bench` runs it as its remote_prefix suite (at each size's prefix, rates and batches;
`measure` gives the record `--json` writes: the settings as `args`, the measurement as
`results`), and plots the time to the n-th token against the link's rate.

    python -m bench.remote_prefix --prefix-tokens 3200 --rates-mbit 200 --new-tokens 64

Issue 27's matrix (6,000-token prefix, 1 Gbit/s and 200 Mbit/s, 128 and 256 tokens from the
same runs, batch 1 and 4), once per dtype:

    python -m bench.remote_prefix --prefix-tokens 6000 --rates-mbit 1000 200 --batch 1 4 \\
        --new-tokens 256 --mark-token 128 --configs recompute hicache vericache \\
        --dtype float32 --json remote_prefix_float32.json
    (and the same with --dtype bfloat16 --json remote_prefix_bfloat16.json)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import psutil
from transformers import AutoTokenizer

from bench import cli, serving, tables
from vericache_tools.mooncake_service import MooncakeService, mooncake_unavailable_reason
from vericache_tools.prompts import PromptTooShortError, stdlib_ids
from vericache_tools.server_args import HICACHE_STORE_ARGS, server_args
from vericache_tools.server_args import VERICACHE as KIVI4
from vericache_tools.server_process import ServerProcess
from vericache_tools.shaped_link import ShapedLink, set_rate, shaping_unavailable_reason
from vericache_tools.streaming import StreamingRequest, stream

PAGE_SIZE = 64
DEVICE_TOKENS = 8192
QUESTION_TOKENS = 60
UNSTORED_TOKENS = 2000
STORED_TOKENS = 640
BYSTANDER_PROMPT_TOKENS = 200
BYSTANDER_TOKENS = 2048
"""The bystander (`--bystander`) decodes until the timed batch is done, then is dropped; the
device pool has room for all of it beside the batch (`pool_tokens`)."""
STORE_ARGS = HICACHE_STORE_ARGS
"""HiCache on the store, for every configuration that reads it (the device pool,
`pool_tokens`, holds a whole batch, so every request of a batch may prefetch at once)."""
SGLANG_STORAGE_BATCH_PAGES = 128
"""Pages SGLang's prefetch reads from a store in one call (`STORAGE_BATCH_SIZE` in SGLang's
hicache_storage.py); plain SGLang's Mooncake backend makes it one `batch_get_into`."""
LEASE_FLOOR_MS = 10_000
"""Mooncake's default read lease (`--default_kv_lease_ttl`)."""
VERICACHE = [*KIVI4, "--vericache-full-tier", "device"]
"""VeriCache with its full KV where HiCache's is, in the device pool, loaded back from SGLang's
host pool (with a store, `auto` would pick the host tier, whose pools did not fit beside a
6,000-token matrix's store on a 24 GiB machine)."""
CONFIGS = {
    "recompute": None,
    "hicache": [],
    "vericache": VERICACHE,
    "vericache-auto": [*VERICACHE, "--vericache-store-reads", "auto"],
    "vericache-early": [*VERICACHE, "--vericache-early-drafting"],
    "vericache-early-coarse": [*VERICACHE, "--vericache-early-drafting",
                               "--vericache-drafting-deadline", "0"],
}
"""Each configuration's flags beside HiCache on the store (None: plain, no store)."""
WRITER = {"hicache": "hicache", "vericache": "vericache", "vericache-auto": "vericache",
          "vericache-early": "vericache", "vericache-early-coarse": "vericache"}
"""Whose objects each configuration's server B reads: configurations whose server A would
write the same objects (they differ only in how B reads) share one server A and its pages. A
later B then also finds what an earlier one wrote: the page that ends the prefix and begins the
question, when the prefix is not a whole number of pages (one page more of storage hit)."""

PREFIX_MODULES = ("inspect", "typing", "_pydecimal", "tkinter", "turtle", "pydoc", "tarfile",
                  "email._header_value_parser", "doctest", "unittest.mock", "zipfile", "argparse")
"""Where the stored prefixes come from: large stdlib modules, cut into windows of the prefix's
length from token 100 on (difflib, heapq and bisect give the warm-ups and the question)."""

DTYPES = ("float32", "bfloat16")
SERVER_BYTES = 8 << 30
"""About what one CPU server takes at the issue's sizes (~5 GB, plus its device and host KV
pools of `pool_tokens`)."""
SETTINGS_FILE, RESULTS_FILE = "settings.json", "results.json"
"""What the parent hands the child inside the link (`--inside FOLDER`), and what it hands back."""
ROOT = Path(__file__).resolve().parents[1]
"""The repository root, where the child runs `python -m bench.remote_prefix`."""
SEGMENT_FILL = 0.8
"""The share of the store's segment the estimate may fill: past 90% Mooncake evicts."""


@dataclass(frozen=True)
class Settings:
    """What one run measures: the command line's flags, or a size of `python -m bench`; saved
    beside the results (`args` in the record) and handed to the child inside the link."""

    model: str
    prefix_tokens: int = 3200
    new_tokens: int = 64
    mark_token: int = 64
    """Also time the output reaching this many tokens (at most `new_tokens`)."""
    rates_mbit: tuple[float, ...] = (200.0,)
    batch: tuple[int, ...] = (1,)
    dtype: str = "float32"
    configs: tuple[str, ...] = tuple(CONFIGS)
    segment_mib: int | None = None
    """The store's memory; None: the estimate of what the run's pages need."""
    bystander: bool = False

    @classmethod
    def from_json(cls, data: dict) -> Settings:
        """Settings saved as JSON (lists back to tuples)."""
        return cls(**{f.name: tuple(data[f.name]) if isinstance(data[f.name], list)
                      else data[f.name] for f in fields(cls)})


def base_args(dtype: str) -> list[str]:
    """The benchmarks' server arguments at `dtype`, with pages of PAGE_SIZE."""
    return server_args(dtype, page_size=PAGE_SIZE)


def prefixes_needed(settings: Settings) -> int:
    """Stored prefixes the timed requests use: a fresh set per (rate, batch) cell."""
    return len(settings.rates_mbit) * sum(settings.batch)


def store_bytes_needed(settings: Settings, kv_bytes: int) -> int:
    """What the store ends up holding: every configuration's pages of every prompt it sees
    (A's prefixes and warm-ups, B's long warm-up, the timed requests' questions and answers),
    at the full KV's size (VeriCache's coded pages are smaller; this is an upper bound)."""
    tokens = (prefixes_needed(settings)
              * (settings.prefix_tokens + QUESTION_TOKENS + settings.new_tokens)
              + UNSTORED_TOKENS + len(settings.rates_mbit) * STORED_TOKENS)
    stores = len({WRITER[name] for name in settings.configs if CONFIGS[name] is not None})
    return stores * (tokens + PAGE_SIZE * prefixes_needed(settings)) * kv_bytes


def segment_mib_needed(settings: Settings, kv_bytes: int) -> int:
    """The least store segment, in MiB, whose estimate stays under SEGMENT_FILL."""
    return math.ceil(store_bytes_needed(settings, kv_bytes) / SEGMENT_FILL / (1 << 20))


def lease_ttl_ms(settings: Settings, kv_bytes: int) -> int:
    """A read lease that outlasts plain SGLang's slowest read: Mooncake leases the objects of a
    batched get when it looks them up and fails the whole get, every page of it, once the lease
    has run out before the data crossed (`LEASE_EXPIRED`; SGLang then keeps none of the pages
    and prefills the prefix, after waiting for the read). At the default 10 s a 6,000-token
    float32 prefix (93 pages, 274 MB in one get) behind 200 Mbit/s always failed. Here: the
    largest get at the slowest rate, with the batch's requests sharing the link and the
    writes beside them, twice over."""
    pages = min(SGLANG_STORAGE_BATCH_PAGES, math.ceil(settings.prefix_tokens / PAGE_SIZE))
    seconds = pages * PAGE_SIZE * kv_bytes * 8 / (min(settings.rates_mbit) * 1e6)
    return max(LEASE_FLOOR_MS, math.ceil(2 * 2 * max(settings.batch) * seconds * 1000))


def pool_tokens(settings: Settings) -> int:
    """Each server's device KV budget in tokens (`--max-total-tokens`; the host pool is twice
    it): the largest batch at once, so no request waits for another's pages to leave, with
    half as much again beside it. Every server gets the same bytes; VeriCache spends part of
    them on its compressed pool (0.31 of a bf16 token's KV, 0.15 of a float32 one), so its
    full KV holds fewer tokens, and a batch that fills the budget exactly would be cut short
    (SGLang aborts a request that runs out of KV)."""
    prompt = settings.prefix_tokens + QUESTION_TOKENS + settings.new_tokens
    pages = math.ceil(prompt / PAGE_SIZE) + 1
    need = max(settings.batch) * pages * PAGE_SIZE
    if settings.bystander:
        need += BYSTANDER_PROMPT_TOKENS + BYSTANDER_TOKENS
    return max(DEVICE_TOKENS, need + need // 2)


def prefix_windows(tokenizer, tokens: int) -> Iterator[list[int]]:
    """Distinct `tokens`-long prefixes: PREFIX_MODULES' sources cut into windows."""
    for module in PREFIX_MODULES:
        start = 100
        while True:
            try:
                yield stdlib_ids(tokenizer, module, tokens, start=start)
            except PromptTooShortError:
                break
            start += tokens


def link_bytes() -> int:
    """Bytes the shaped class has sent (this process runs inside the link's namespace)."""
    shown = subprocess.run(["tc", "-s", "class", "show", "dev", "lo", "classid", "1:10"],
                           capture_output=True, text=True, check=True).stdout
    return int(re.search(r"Sent (\d+) bytes", shown).group(1))


def timed_stream(server: ServerProcess, ids: list[int], new_tokens: int, mark: int) -> dict:
    """Stream one greedy request: seconds to the first emitted token, to the `mark`-th (None
    if fewer came) and to the last, and the output."""
    began = time.monotonic()
    at: dict[int, float] = {}
    last: dict = {}
    for last in stream(server.url, serving.request(ids, new_tokens)):
        at.setdefault(len(last["output_ids"]), time.monotonic() - began)
    reached = [seconds for count, seconds in at.items() if count >= mark]
    return {"output_ids": last["output_ids"], "first_s": min(at.values()),
            "mark_s": min(reached) if reached else None, "last_s": max(at.values()),
            "storage_hit": (last["meta_info"].get("cached_tokens_details") or {})
            .get("storage", 0)}


STORE_READ_KEYS = ("read_coded_pages", "read_coded_bytes", "read_codec_seconds",
                   "declined_pages", "read_drafting_pages", "read_drafting_bytes",
                   "read_coarse_pages", "read_coarse_bytes", "read_refine_pages",
                   "read_refine_bytes", "read_exact_pages", "read_exact_bytes", "early_drafts",
                   "stash_accepted", "barrier_wait_seconds", "store_link_mbit")
"""VeriCache's store counters of a timed batch: pages read, their bytes, the seconds the
store's reads took (transfer and decode, in SGLang's prefetch thread), and stored pages
recomputed instead of read (`--vericache-store-reads auto`)."""
GAUGES = ("store_link_mbit",)
"""Of those, values read as they are after the batch, not as a difference."""


def store_io(server: ServerProcess) -> dict:
    """VeriCache's store counters (`/server_info`); empty for plain SGLang."""
    states = server.server_info().get("internal_states") or [{}]
    state = states[0].get("vericache_state", {})
    return {**state.get("store_io", {}), **state.get("early_drafting", {}),
            "declined_pages": state.get("store_reads", {}).get("declined_pages", 0)}


def _mean(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values) / len(values)


def largest_gap(times: list[float], start: float, end: float) -> float:
    """The longest time without a token in [start, end], its ends counted as tokens."""
    inside = [start, *(t for t in times if start < t < end), end]
    return max(b - a for a, b in itertools.pairwise(inside))


def timed_batch(server: ServerProcess, prompts: list[list[int]],
                settings: Settings, bystander: list[int] | None = None
                ) -> tuple[dict, list[list[int]]]:
    """The prompts sent at once: each request's times, their means, the link bytes per request
    (the batch's, divided by its size) and VeriCache's store reads; and the outputs. With
    `bystander`, a request decoding that prompt is running when the batch is sent: its largest
    gap between streamed tokens until every request of the batch has its first token (while
    their prefixes load), and until the batch is done."""
    running = None if bystander is None else StreamingRequest(
        server.url, serving.request(bystander, BYSTANDER_TOKENS))
    sent, io = link_bytes(), store_io(server)
    began = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda ids: timed_stream(server, ids, settings.new_tokens,
                                                         settings.mark_token), prompts))
    done = time.monotonic()
    moved = link_bytes() - sent
    after = store_io(server)
    outputs = [answer.pop("output_ids") for answer in answers]
    row = {key: _mean([a[key] for a in answers]) for key in ("first_s", "mark_s", "last_s",
                                                              "storage_hit")}
    if running is not None:
        running.stop()
        times = running.times
        loaded = began + max(a["first_s"] for a in answers)
        row |= {"bystander_gap_loading_s": largest_gap(times, began, loaded),
                "bystander_gap_s": largest_gap(times, began, done)}
    row |= {"requests": answers, "link_bytes": moved,
            "link_bytes_per_request": moved / len(prompts),
            "store_read": {key: after.get(key, 0) - (0 if key in GAUGES else io.get(key, 0))
                           for key in STORE_READ_KEYS}}
    return row, outputs


def run_inside(settings: Settings) -> dict:
    """The measurement, in the link's namespace."""
    target = Path(settings.model)
    tokenizer = AutoTokenizer.from_pretrained(target)
    question = stdlib_ids(tokenizer, "bisect", QUESTION_TOKENS, start=300)
    windows = prefix_windows(tokenizer, settings.prefix_tokens)
    cells = [(rate, batch) for rate in settings.rates_mbit for batch in settings.batch]
    prefixes: dict[tuple[float, int], list[list[int]]] = {}
    for cell in cells:
        try:
            prefixes[cell] = [next(windows) for _ in range(cell[1])]
        except StopIteration:
            raise SystemExit(f"the stdlib modules give fewer than {prefixes_needed(settings)} "
                             f"distinct {settings.prefix_tokens}-token prefixes") from None
    # Before its timed requests every server B answers a long prompt nobody stored, and at
    # each rate one A stored: a server that has been serving on this link, whose rates
    # (`--vericache-store-reads auto`) are measured.
    unstored = stdlib_ids(tokenizer, "difflib", UNSTORED_TOKENS, start=0)
    bystander = stdlib_ids(tokenizer, "textwrap", BYSTANDER_PROMPT_TOKENS, start=0)
    stored = {rate: stdlib_ids(tokenizer, "heapq", STORED_TOKENS, start=i * STORED_TOKENS)
              for i, rate in enumerate(settings.rates_mbit)}
    server_base = base_args(settings.dtype)
    tokens = pool_tokens(settings)
    rows: list[dict] = []
    outputs: dict[tuple[str, float, int], list[list[int]]] = {}
    lease_ms = lease_ttl_ms(settings, serving.kv_bytes_per_token(target, settings.dtype))
    written: set[str] = set()
    with MooncakeService(segment_size=settings.segment_mib << 20,
                         master_args=[f"--default_kv_lease_ttl={lease_ms}"]) as store:
        for name in settings.configs:
            flags = CONFIGS[name]
            reads_store = flags is not None
            server_args, env = server_base, None
            if reads_store:
                server_args = [*server_base, *STORE_ARGS, *flags,
                               *store.server_args(extra_backend_tag=WRITER[name])]
                env = store.env()
            if reads_store and WRITER[name] not in written:
                written.add(WRITER[name])
                # A's backups cross the link too: at the fastest rate, since they are not timed
                set_rate(max(settings.rates_mbit))
                cli.log(f"[{name}] server A stores {prefixes_needed(settings)} prefixes")
                with ServerProcess(target, server_args, max_total_tokens=tokens,
                                   env=env) as a:
                    for group in [*prefixes.values(), list(stored.values())]:
                        keys = store.wait_keys(0)
                        for ids in group:
                            a.generate(serving.request(ids, 1))
                        store.wait_keys(keys + len(group), timeout=900, settle=5.0)
            cli.log(f"[{name}] server B")
            with ServerProcess(target, server_args, max_total_tokens=tokens, env=env) as b:
                b.generate(serving.request(unstored, 1))
                for rate in settings.rates_mbit:
                    set_rate(rate)
                    b.generate(serving.request(stored[rate], 1))
                    for batch in settings.batch:
                        if reads_store:
                            # B writes its pages behind its answers: wait for them, so the
                            # timed requests' times and bytes are their own
                            store.wait_keys(0, timeout=900, settle=5.0)
                        prompts = [prefix + question for prefix in prefixes[(rate, batch)]]
                        row, outputs[(name, rate, batch)] = timed_batch(
                            b, prompts, settings, bystander if settings.bystander else None)
                        rows.append({"rate_mbit": rate, "batch": batch, "config": name, **row})
                        cli.log(f"[{name}] {rate:g} Mbit/s, batch {batch}: "
                                f"last token {row['last_s']:.1f} s, "
                                f"{row['link_bytes_per_request'] / 1e6:.1f} MB/request")
    identical: dict[str, list[int]] = {}
    identical_to_hicache: dict[str, list[int]] = {}
    for row in rows:
        got = outputs[(row["config"], row["rate_mbit"], row["batch"])]
        row["compared"] = len(got)
        for key, totals, against in (("identical", identical, "recompute"),
                                     ("identical_to_hicache", identical_to_hicache, "hicache")):
            reference = outputs.get((against, row["rate_mbit"], row["batch"]))
            row[key] = (None if reference is None
                        else sum(a == b for a, b in zip(got, reference, strict=True)))
            if row[key] is not None:
                counts = totals.setdefault(row["config"], [0, 0, []])
                counts[0] += row[key]
                counts[1] += len(got)
                counts[2] += [serving.first_difference(a, b)
                              for a, b in zip(got, reference, strict=True) if a != b]
    return {"rows": rows, "identical": identical,
            "identical_to_hicache": identical_to_hicache, "kv_bytes_per_token":
            serving.kv_bytes_per_token(target, settings.dtype), "pool_tokens": tokens,
            "lease_ttl_ms": lease_ms}


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(record: dict) -> str:
    """A run's record (`measure`) as the table the script prints and the report shows."""
    args, results = record["args"], record["results"]
    bystander = args.get("bystander", False)
    rows = results["rows"]
    cell = {(r["rate_mbit"], r["batch"], r["config"]): r for r in rows}
    mark = ordinal(args["mark_token"])
    rates = " and ".join(f"{rate:g}" for rate in args["rates_mbit"])
    lines = [f"Emulated link (tc htb on the store's data ports inside a network namespace, not "
             f"a real network): {rates} Mbit/s. Per request a different stored "
             f"{args['prefix_tokens']}-token prefix + {QUESTION_TOKENS}-token question, "
             f"{args['new_tokens']} greedy tokens; {args['dtype']} demo model; device pool "
             f"{results['pool_tokens']} tokens, host pool twice that; Mooncake read lease "
             f"{results['lease_ttl_ms'] / 1000:g} s; one run. Times are "
             f"means over the batch's requests, from sending them; link MB = the bytes over "
             f"the link while the batch ran / batch size; storage hit per request; store "
             f"reads for the whole batch.", ""]
    header = ["link Mbit/s", "batch", "server", "first token s", f"{mark} token s",
              "last token s", f"{mark} / HiCache", f"{mark} / recompute", "link MB / request",
              "link / HiCache", "storage hit", "store reads s (pages)", "identical",
              *(["bystander's largest gap s: loading / all"] if bystander else [])]
    cells = []
    for r in rows:
        hicache = cell.get((r["rate_mbit"], r["batch"], "hicache"))
        recompute = cell.get((r["rate_mbit"], r["batch"], "recompute"))
        read = r.get("store_read") or {}
        reads = (f"{read['read_codec_seconds']:.1f} ({read['read_coded_pages']})"
                 if read.get("read_coded_pages") else "-")
        if read.get("read_drafting_pages") or read.get("read_coarse_pages"):
            reads = (f"{read['read_codec_seconds']:.1f} ({read.get('read_drafting_pages', 0)} "
                     f"pool-level, {read.get('read_coarse_pages', 0)} coarse, "
                     f"{read['read_exact_pages']} exact; link "
                     f"{read.get('store_link_mbit', 0):.0f} Mbit/s measured); "
                     f"{read['early_drafts']} early drafts, {read['stash_accepted']} accepted")
        if read.get("declined_pages"):
            reads += f", {read['declined_pages']} declined"
        per_request = r["link_bytes_per_request"]
        cells.append([
            f"{r['rate_mbit']:g}", r["batch"], r["config"], _seconds(r["first_s"]),
            _seconds(r["mark_s"]), _seconds(r["last_s"]),
            _ratio(r["mark_s"], hicache and hicache["mark_s"]),
            _ratio(r["mark_s"], recompute and recompute["mark_s"]), f"{per_request / 1e6:.1f}",
            _ratio(per_request, hicache and hicache["link_bytes_per_request"]),
            f"{r['storage_hit']:.0f}", reads,
            "-" if r["identical"] is None else f"{r['identical']}/{r['compared']}",
            *([f"{_seconds(r.get('bystander_gap_loading_s'))} / "
               f"{_seconds(r.get('bystander_gap_s'))}"] if bystander else [])])
    lines.append(tables.table(header, cells))
    for key, against in (("identical", "recompute"), ("identical_to_hicache", "HiCache")):
        if results.get(key):
            lines += ["", f"Identical to {against}, all cells (where not, the first token "
                      "that differs): " + ", ".join(
                          f"{name} {k}/{n}" + (f" ({', '.join(map(str, where))})" if where
                                               else "")
                          for name, (k, n, where) in results[key].items()) + "."]
    return "\n".join(lines)


def identical(record: dict) -> bool | None:
    """Whether every output equalled plain SGLang's recomputing (None: recompute not run). In
    float32 it must; in bfloat16 a prefix read from a cache is not bit for bit a recomputed
    one."""
    counts = record["results"]["identical"]
    return all(same == compared for same, compared, *_ in counts.values()) if counts else None


def unavailable_reason() -> str | None:
    """None where a shaped link and a Mooncake store can be made here, else why not."""
    return shaping_unavailable_reason() or mooncake_unavailable_reason()


def measure(settings: Settings) -> dict:
    """One run behind a shaped link: the record `--json` writes and the bench suite returns,
    the settings (`args`, with the store's segment) and what was measured (`results`). The
    measurement runs in a child process inside the link's namespace; it reads the settings
    from a JSON file and writes its results beside them."""
    kv_bytes = serving.kv_bytes_per_token(Path(settings.model), settings.dtype)
    if settings.segment_mib is None:
        need = segment_mib_needed(settings, kv_bytes)
        settings = replace(settings, segment_mib=max(1024, math.ceil(need / 256) * 256))
    cli.log(f"store segment {settings.segment_mib} MiB; one server at a time")
    available = psutil.virtual_memory().available
    if (settings.segment_mib << 20) + SERVER_BYTES > available:
        cli.log(f"warning: the segment and one server (~{SERVER_BYTES >> 30} GiB) may need more "
                f"than the {available >> 20} MiB of memory available now")
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, ShapedLink(max(settings.rates_mbit)) as link:
        folder = Path(tmp)
        (folder / SETTINGS_FILE).write_text(json.dumps(asdict(settings)))
        subprocess.run(link.command([sys.executable, "-m", "bench.remote_prefix", "--inside",
                                     str(folder)]), cwd=ROOT, check=True)
        results = json.loads((folder / RESULTS_FILE).read_text())
    results["wall_s"] = time.monotonic() - began
    return {"args": asdict(settings), "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.remote_prefix", __doc__)
    cli.add_model(parser)
    parser.add_argument("--prefix-tokens", type=int, default=3200)
    parser.add_argument("--new-tokens", type=int, default=64, help="max tokens per request")
    parser.add_argument("--mark-token", type=int, default=128,
                        help="also time the output reaching this many tokens (capped at "
                             "--new-tokens)")
    parser.add_argument("--rates-mbit", type=float, nargs="+", default=None,
                        help="the link's rates, each in turn on the same servers "
                             "(default: 200)")
    parser.add_argument("--rate-mbit", type=float, default=None,
                        help="one rate (the same as --rates-mbit RATE)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1],
                        help="requests sent at once, each size in turn")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="every server's dtype (float32: where VeriCache's output must "
                             "equal plain SGLang's)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="what to run (recompute is the reference the others must equal)")
    parser.add_argument("--segment-mib", type=int, default=None,
                        help="the store's memory: every configuration's pages live there "
                             "(default: the estimate of what they need, / 0.8)")
    parser.add_argument("--bystander", action="store_true",
                        help="a request already decoding on server B when each timed batch "
                             "arrives: report its largest gap between streamed tokens while "
                             "the batch's prefixes load")
    parser.add_argument("--json", type=Path, help="write the record (settings and results) here")
    parser.add_argument("--inside", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:  # the child inside the link: settings in, results out, as JSON files
        settings = Settings.from_json(json.loads((args.inside / SETTINGS_FILE).read_text()))
        (args.inside / RESULTS_FILE).write_text(json.dumps(run_inside(settings)))
        return 0
    if args.rate_mbit is not None and args.rates_mbit is not None:
        parser.error("give --rates-mbit or --rate-mbit, not both")
    rates = args.rates_mbit or [args.rate_mbit or 200.0]
    if min(rates) <= 0 or min(args.batch) < 1:
        parser.error("rates must be positive and batch sizes at least 1")
    reason = unavailable_reason()
    if reason:
        print(f"bench.remote_prefix cannot run here: {reason}", file=sys.stderr)
        return 2
    settings = Settings(
        model=str(cli.model_dir(args.model)), prefix_tokens=args.prefix_tokens,
        new_tokens=args.new_tokens, mark_token=min(args.mark_token, args.new_tokens),
        rates_mbit=tuple(rates), batch=tuple(args.batch), dtype=args.dtype,
        configs=tuple(args.configs), segment_mib=args.segment_mib, bystander=args.bystander)
    kv_bytes = serving.kv_bytes_per_token(Path(settings.model), settings.dtype)
    need_mib = segment_mib_needed(settings, kv_bytes)
    if args.segment_mib is not None and args.segment_mib < need_mib:
        parser.error(f"--segment-mib {args.segment_mib} is too small: the store holds about "
                     f"{store_bytes_needed(settings, kv_bytes) >> 20} MiB of pages here "
                     f"({kv_bytes} bytes of {args.dtype} KV per token); Mooncake evicts past "
                     f"90%, so give at least {need_mib} (that / {SEGMENT_FILL})")
    record = measure(settings)
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))
    print(markdown(record))
    print(f"\nwall time {record['results']['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
