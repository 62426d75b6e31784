"""VeriCache's Prometheus metrics, served on SGLang's `/metrics` beside `sglang:*`.

SGLang's own `sglang:spec_accept_rate` divides by the widest verify (the maximum draft length),
which understates acceptance when the draft length adapts; these counters are exact, so rates
come from `rate()` over them: acceptance = accepted_drafts / drafted_tokens, tokens per round
(E) = emitted_tokens / verify_rounds. Created in the scheduler process only with
`--enable-metrics` (SGLang's multiprocess registry then exports them).

The store's counts are running totals kept by the store's own objects (`stores.state`), which
`/server_info` shows too; each step adds what they grew by to the counters here. Not a custom
prometheus_client collector reading them at scrape time: SGLang serves `/metrics` from its HTTP
process through `MultiProcessCollector`, which exports only what Counter and Gauge values wrote
to the multiprocess directory; a collector registered in the scheduler process is never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RoundCounts:
    """What one scheduler step of the worker did, summed over its batch."""

    verify_rounds: int = 0
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    emitted_tokens: int = 0
    plain_decode_steps: int = 0
    draft_forwards: int = 0
    drafter_proposed: int = 0
    drafter_kept: int = 0

    def add(self, other: RoundCounts) -> None:
        """Accumulate another step's counts into these."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class VeriCacheMetrics:
    """Counters of drafting and verification, and the compressed tier's size."""

    def __init__(self, model_name: str) -> None:
        # prometheus_client must be imported after SGLang set PROMETHEUS_MULTIPROC_DIR.
        from prometheus_client import Counter, Gauge

        labels = {"model_name": model_name}
        self._labels = labels

        def counter(name: str, doc: str) -> Any:
            return Counter(f"vericache:{name}", doc, labelnames=labels.keys()).labels(**labels)

        self.verify_rounds = counter(
            "verify_rounds", "Verification rounds (one per request and round).")
        self.drafted_tokens = counter(
            "drafted_tokens", "Tokens drafted on the compressed tier.")
        self.accepted_drafts = counter(
            "accepted_drafts", "Drafted tokens the full-KV verification accepted.")
        self.emitted_tokens = counter(
            "emitted_tokens", "Tokens verification rounds accepted: accepted drafts plus one "
            "token of the full model per round, up to where a stop string, stop token or "
            "grammar ended the request.")
        self.plain_decode_steps = counter(
            "plain_decode_steps", "Per-request decode steps served without drafting "
            "(requests with returned logprobs, penalties, logit bias, ...).")
        self.draft_forwards = counter(
            "draft_forwards", "Level-1 drafting forwards (the target over the compressed "
            "tier), counted once per request in each.")
        self.drafter_proposed = counter(
            "drafter_proposed", "Tokens the level-2 drafter (--vericache-drafter) proposed.")
        self.drafter_kept = counter(
            "drafter_kept", "Level-2 proposals the level-1 check kept as drafts.")
        self.compressed_pages = counter(
            "compressed_pages", "Pages of the compressed pool quantized (one per key group of "
            "every layer): a prefix shared along the radix tree counts once.")
        self.compressed_pool_pages = Gauge(
            "vericache:compressed_pool_pages", "Pages of the compressed pool in use.",
            labelnames=labels.keys(), multiprocess_mode="mostrecent").labels(**labels)
        self.compressed_tier_bytes = Gauge(
            "vericache:compressed_tier_bytes", "Device bytes the compressed KV holds, measured "
            "from tensor storages: the compressed pool's pages in use (including those of "
            "prefixes the radix cache keeps), request-owned blocks and drafting buffers.",
            labelnames=labels.keys(), multiprocess_mode="mostrecent").labels(**labels)

        def seconds(name: str, doc: str) -> Any:
            return Counter(f"vericache:{name}", doc,
                           labelnames=[*labels.keys(), "phase"])

        self.full_tier_read_bytes = Counter(
            "vericache:full_tier_read_bytes", "Bytes read from the host full tier (phase: "
            "prefill, or decode: verification, drafting windows, pages being compressed); "
            "per emitted token: rate() over emitted_tokens.",
            labelnames=[*labels.keys(), "phase"])
        self.fetch_seconds = seconds(
            "fetch_seconds", "Time spent copying the full tier to the device.")
        self.fetch_wait_seconds = seconds(
            "fetch_wait_seconds", "Time forwards waited for full-tier copies (not hidden "
            "behind drafting or earlier layers).")

        self.disk_faults = Counter(
            "vericache:disk_faults", "Stored pages that could not be used (kind: missing, "
            "short, corrupt (removed from the store), foreign (another configuration's page, "
            "left in place), timeout (a codec process or the exact KV past "
            "--vericache-store-timeout), read_error, write_error, unavailable); each made its "
            "prefix recompute from that page on.", labelnames=[*labels.keys(), "kind"])
        self.store_bytes = Counter(
            "vericache:store_bytes", "Bytes written to and read from the KV store (direction: "
            "written, read; form: coded CacheGen streams, raw pages, or kv: the host pool's "
            "bytes of those pages).", labelnames=[*labels.keys(), "direction", "form"])
        self.store_pages = Counter(
            "vericache:store_pages", "Pages written to and read from the KV store.",
            labelnames=[*labels.keys(), "direction", "form"])
        self.store_codec_seconds = Counter(
            "vericache:store_codec_seconds", "Time spent coding pages for the KV store "
            "(direction: written = encode, read = decode and checks).",
            labelnames=[*labels.keys(), "direction"])
        self.store_reads_declined = counter(
            "store_reads_declined", "Stored pages not read because recomputing them was "
            "measured to be faster (--vericache-store-reads auto).")
        self.reloaded_pages_installed = counter(
            "reloaded_pages_installed", "Compressed pool pages of reloaded prefixes taken from "
            "their stored streams' pool level instead of quantized from the full KV.")
        self.reloaded_pages_skipped = counter(
            "reloaded_pages_skipped", "Stored pages read whose codes were not the compressed "
            "pool's pages (another compressor's stream, or another geometry): quantized from "
            "their full KV instead.")
        self.early_drafts = counter(
            "early_drafts", "Tokens drafted over the compressed KV of a stored prefix before "
            "its exact KV had arrived (--vericache-early-drafting).")
        self.early_stash_accepted = counter(
            "early_stash_accepted", "Of those, drafts later rounds verified and accepted.")
        self.store_link_mbit = Gauge(
            "vericache:store_link_mbit", "The KV store link's rate, measured on the objects "
            "an early-drafting read received (the bytes of the last 32 over the time any of "
            "them was in flight); it picks each page's drafting level.",
            labelnames=labels.keys(), multiprocess_mode="mostrecent").labels(**labels)
        self.store_reconnect_attempts = counter(
            "store_reconnect_attempts", "Attempts to reach a KV store that could not be "
            "reached when the server started (one every VERICACHE_STORE_RETRY_SECONDS).")
        self.store_read_probes = counter(
            "store_read_probes", "Stored prefixes read although reading was measured slower, "
            "to measure the link again (--vericache-store-reads auto).")
        self.early_exact_failed = counter(
            "early_exact_failed", "Stored pages answered on their drafting level whose exact "
            "part did not come (a store fault, or an earlier page's in the same read).")
        self.early_exact_timed_out = counter(
            "early_exact_timed_out", "Of the pages a prefill waited for, those whose exact "
            "part missed --vericache-store-timeout (counted as failed and recomputed).")
        self.early_pages_recomputed = counter(
            "early_pages_recomputed", "Pages whose exact part failed, recomputed by the "
            "prefill that read them (never served from their drafting level).")
        self.early_prefills_parked = counter(
            "early_prefills_parked", "Prefills over a stored prefix still arriving that "
            "waited beside the running requests, drafting between their steps, instead of "
            "holding them.")
        self.store_reconnect_failures = counter(
            "store_reconnect_failures", "Of those, attempts that failed (each logged at "
            "WARNING; the store serves misses meanwhile).")
        self._store_seen: dict[Any, float] = {}

    def _grown(self, key: Any, total: float) -> float:
        """How much the running total `key` grew since the last step (0 if it did not)."""
        step = total - self._store_seen.get(key, 0)
        if step > 0:
            self._store_seen[key] = total
        return max(step, 0)

    def record_store(self, faults: dict[str, int], io: dict[tuple[str, str, str], float],
                     totals: dict[str, int], link_mbit: float = 0.0) -> None:
        """Bring the store counters up to the store's running totals (`faults` by kind, `io`
        by (direction, form, unit): `stores.pages.StoreStats.totals`) and `totals`, running
        counts by the name of their counter (`store_reads_declined`, ...: see
        `speculative.statistics`), and set the link's measured rate."""
        if link_mbit:
            self.store_link_mbit.set(link_mbit)
        for name, total in totals.items():
            if step := self._grown(name, total):
                getattr(self, name).inc(step)
        for kind, total in faults.items():
            if step := self._grown(("fault", kind), total):
                self.disk_faults.labels(**self._labels, kind=kind).inc(step)
        for (direction, form, unit), total in io.items():
            if not (step := self._grown((direction, form, unit), total)):
                continue
            if unit == "seconds":
                self.store_codec_seconds.labels(**self._labels, direction=direction).inc(step)
            else:
                counter = self.store_pages if unit == "pages" else self.store_bytes
                counter.labels(**self._labels, direction=direction, form=form).inc(step)

    def record_fetch(self, stats, *, prefill: bool) -> None:
        """Add one forward's full-tier reads (`tiers.staging.FetchStats`)."""
        labels = {**self._labels, "phase": "prefill" if prefill else "decode"}
        self.full_tier_read_bytes.labels(**labels).inc(stats.bytes)
        self.fetch_seconds.labels(**labels).inc(stats.copy_s)
        self.fetch_wait_seconds.labels(**labels).inc(stats.wait_s)

    def record(self, counts: RoundCounts, pages_compressed: int) -> None:
        """Add one scheduler step's counts and pages compressed."""
        self.verify_rounds.inc(counts.verify_rounds)
        self.drafted_tokens.inc(counts.drafted_tokens)
        self.accepted_drafts.inc(counts.accepted_drafts)
        self.emitted_tokens.inc(counts.emitted_tokens)
        self.plain_decode_steps.inc(counts.plain_decode_steps)
        self.draft_forwards.inc(counts.draft_forwards)
        self.drafter_proposed.inc(counts.drafter_proposed)
        self.drafter_kept.inc(counts.drafter_kept)
        self.compressed_pages.inc(pages_compressed)

    def set_sizes(self, held_bytes: int, pages_used: int) -> None:
        """Set the compressed KV's current size and the pool pages in use."""
        self.compressed_pool_pages.set(pages_used)
        self.compressed_tier_bytes.set(held_bytes)
