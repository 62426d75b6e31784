"""Sampled requests served by VeriCache follow plain SGLang's output distribution.

Real servers, the demo model in float32 with the shared test arguments (`--random-seed 0`):
the session's plain SGLang server; VeriCache with 2-bit KIVI (32 full-precision recent tokens)
and a fixed draft length of 4, lossy enough that many drafts are rejected; and the same with an
untrained draft model proposing under level 1 (each started and stopped here). All answer the
same batch: `SAMPLES` samples (`n`) of `NEW_TOKENS` tokens after a real prompt for each
sampling configuration, and one greedy request (which must equal plain greedy output, token
for token, while sharing rounds with sampled requests).

For each VeriCache configuration, sampling configuration and output position, a two-sample
chi-square test compares the token counts with plain SGLang's (`tests/support/homogeneity.py`: rare
tokens pooled into one cell, so every cell expects about 5 or more per server). Position 0
comes from prefill on both servers (a control); positions 1.. come from VeriCache's draft and
verify rounds. A draw fails when one of its M tests has p <
`DRAW_ALPHA` / M (Bonferroni: under exact sampling, probability below `DRAW_ALPHA`). A failed
draw is drawn again, fresh samples from both servers, and the test fails only if that draw
fails too: a real deviation reproduces, and under exact sampling both fail with probability
below `DRAW_ALPHA`**2 = `FAMILY_ALPHA` = 1e-3. (One draw at 1e-3 failed here once for a whole
test order: sampling is seeded, so one unlucky draw is unlucky on every run of that order; 600
fresh samples per configuration then gave p >= 0.08 at every position.)
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.homogeneity import two_sample_pvalue
from tests.support.servers import SERVER_ARGS, ServerSpec
from vericache_sglang.speculative.meta_info import DRAFTER_PROPOSED_KEY
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]

SAMPLES = 100
NEW_TOKENS = 4
PROMPT_TOKENS = 128
FAMILY_ALPHA = 1e-3
DRAW_ALPHA = math.sqrt(FAMILY_ALPHA)
CONFIGS = {
    "temperature_1": {"temperature": 1.0},
    "top_k_top_p": {"temperature": 0.9, "top_k": 40, "top_p": 0.9},
}
# A round of a few hundred requests can outlast SGLang's 300 s watchdog on a busy 2-core box.
VERICACHE_ARGS = [*SERVER_ARGS, "--watchdog-timeout", "3600", "--enable-vericache",
                  "--vericache-compressor", "kivi:bits=2,group=32,residual=32",
                  "--vericache-draft-length", "4",
                  "--vericache-min-draft-length", "4", "--vericache-max-draft-length", "4"]
VARIANTS = ("one level", "draft model")
"""The VeriCache configurations compared with plain SGLang (`runs`)."""


def _answers(server: ServerProcess, ids: list[int]) -> dict[str, list[dict]]:
    """The batch: every configuration's samples and the greedy request, sent together."""
    payloads = {name: {"input_ids": ids, "sampling_params": {
        **params, "n": SAMPLES, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
        for name, params in CONFIGS.items()}
    payloads["greedy"] = {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": 3 * NEW_TOKENS, "ignore_eos": True}}
    with ThreadPoolExecutor(len(payloads)) as pool:
        futures = {name: pool.submit(server.generate, p) for name, p in payloads.items()}
        out = {name: f.result() for name, f in futures.items()}
    out["greedy"] = [out["greedy"]]
    return out


@pytest.fixture(scope="module")
def runs(demo_models, plain_server: ServerProcess, server_pool
         ) -> dict[str, dict[str, list[dict]]]:
    """Plain SGLang's answers to the batch, and each VeriCache configuration's: one level, and
    the untrained 4-layer draft model proposing under it (level 1 checks its point-mass
    proposals by speculative sampling, nearly always drawing from q without the proposal).
    Where a configuration's draw fails, `runs["again"][variant]` is a fresh draw of both."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_models.target)
    # The json module's docstring, cut inside an example: several likely tokens per position.
    ids = stdlib_ids(tokenizer, "json", PROMPT_TOKENS)
    result = {"plain": _answers(plain_server, ids), "again": {}}
    variants = {"one level": [*VERICACHE_ARGS, "--vericache-drafter", "none"],
                "draft model": [*VERICACHE_ARGS, "--vericache-draft-model",
                                str(demo_models.draft), "--vericache-drafter-max-length", "2"]}
    # Started side by side, asked one after the other.
    with server_pool.hold(*(ServerSpec.of(demo_models.target, args)
                            for args in variants.values())) as servers:
        for name, server in zip(variants, servers, strict=True):
            began = time.monotonic()
            result[name] = _answers(server, ids)
            print(f"\n[{name}] batch answered in {time.monotonic() - began:.0f} s")
            if _compare(result["plain"], result[name])[1]:
                result["again"][name] = (_answers(plain_server, ids), _answers(server, ids))
    return result


def _compare(plain: dict[str, list[dict]], ours: dict[str, list[dict]]
             ) -> tuple[list[str], list[str], int]:
    """One draw's tests: (report lines, failing lines, positions spread over 3+ tokens)."""
    tests = len(VARIANTS) * len(CONFIGS) * NEW_TOKENS
    report, failures, informative = [], [], 0
    for name in CONFIGS:
        a = [o["output_ids"] for o in plain[name]]
        b = [o["output_ids"] for o in ours[name]]
        assert len(a) == len(b) == SAMPLES
        assert all(len(ids) == NEW_TOKENS for ids in a + b)
        for pos in range(NEW_TOKENS):
            pvalue, cells = two_sample_pvalue([o[pos] for o in a], [o[pos] for o in b])
            report.append(f"{name} position {pos}: p={pvalue:.3g} ({cells} cells)")
            informative += cells >= 3
            if pvalue < DRAW_ALPHA / tests:
                failures.append(report[-1])
    return report, failures, informative


@pytest.mark.parametrize("variant", VARIANTS)
def test_sampled_tokens_follow_plain_sglangs_distribution(runs, variant):
    report, failures, informative = _compare(runs["plain"], runs[variant])
    print("\n  " + "\n  ".join(report))
    # The prompt keeps the test informative: most positions spread over several tokens.
    assert informative >= len(CONFIGS) * NEW_TOKENS // 2, report
    if failures:
        report, again, _ = _compare(*runs["again"][variant])
        print(f"  first draw failed at {failures}; again:\n  " + "\n  ".join(report))
        assert not again, (failures, again)


@pytest.mark.parametrize("variant", VARIANTS)
def test_sampled_requests_drafted_and_some_drafts_were_rejected(runs, variant):
    """Sampled requests went through draft and verify rounds (not plain decode steps), the
    statistics add up per request, and the 2-bit tier made some drafts fail; with the draft
    model, level 1 checked its proposals."""
    for name in CONFIGS:
        rounds = drafted = accepted = proposed = 0
        for out in runs[variant][name]:
            meta = out["meta_info"]
            r, a = meta["spec_verify_ct"], meta["spec_num_correct_drafts"]
            # A round emits its accepted drafts plus one token (the first token comes from
            # prefill), and counts only what fits in max_new_tokens.
            assert len(out["output_ids"]) == 1 + a + r
            rounds, accepted = rounds + r, accepted + a
            drafted += round(meta["spec_cap_length"] * r)
            proposed += meta.get(DRAFTER_PROPOSED_KEY, [0])[0]
        print(f"\n[{variant}, {name}] {rounds} rounds, {accepted}/{drafted} drafts accepted, "
              f"{proposed} proposed")
        assert rounds > 0 and 0 < accepted < drafted
        assert (proposed > 0) == (variant == "draft model")


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_request_in_the_sampled_batch_equals_plain(runs, variant):
    plain, ours = runs["plain"]["greedy"][0], runs[variant]["greedy"][0]
    assert ours["output_ids"] == plain["output_ids"]
    meta = ours["meta_info"]
    assert meta["spec_cap_length"] > 0 and meta["spec_num_correct_drafts"] > 0  # it drafted
