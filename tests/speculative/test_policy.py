"""The draft length policies (no server): the level-2 drafter's grow-and-shrink rule, and the
round's length chosen by measured cost, a plain step among its choices."""

from __future__ import annotations

import itertools
import random

import pytest

from vericache_sglang.speculative.policy import (
    FIRST_PROBE_AFTER,
    PLAIN_REFRESH_ROUNDS,
    DraftLengthPolicy,
    RoundLengthPolicy,
    expected_accepted,
)


def test_draft_length_policy_adapts():
    policy = DraftLengthPolicy(initial=8, minimum=4, maximum=64)
    assert policy.update("r", drafted=8, accepted=8) == 12
    assert policy.update("r", drafted=12, accepted=12) == 18
    assert policy.update("r", drafted=18, accepted=2) == 11
    assert policy.update("r", drafted=11, accepted=0) == 6
    assert policy.update("r", drafted=6, accepted=0) == 4  # floor
    assert policy.length("new") == 8  # a new request starts at the initial length
    for _ in range(20):
        policy.update("r", drafted=policy.length("r"), accepted=policy.length("r"))
    assert policy.length("r") == 64  # ceiling
    policy.forget("r")
    assert policy.length("r") == 8
    fixed = DraftLengthPolicy(initial=8, minimum=8, maximum=8, adaptive=False)
    assert fixed.update("r", drafted=8, accepted=0) == 8


@pytest.mark.parametrize("policy_class", [DraftLengthPolicy, RoundLengthPolicy])
def test_policies_reject_inconsistent_bounds(policy_class):
    with pytest.raises(ValueError):
        policy_class(initial=2, minimum=4, maximum=64)


def test_round_lengths_are_a_plain_step_and_powers_of_two_within_the_bounds():
    assert RoundLengthPolicy(16, 4, 64).lengths() == [0, 4, 8, 16, 32, 64]
    assert RoundLengthPolicy(6, 3, 20).lengths() == [0, 3, 4, 6, 8, 16, 20]
    fixed = RoundLengthPolicy(4, 4, 4, adaptive=False)
    assert fixed.lengths() == [4]
    fixed.record_round(1, 4, 10.0)
    fixed.update("r", drafted=4, accepted=0)
    assert fixed.batch_length(["r"], 1) == 4  # never a plain step
    assert fixed.batch_length([], 1) == 0  # no request drafts


def _round_seconds(k: int, batch_size: int) -> float:
    """A CPU-like device: a plain step 0.15 s at batch 1, each draft 0.05 s (drafting
    forwards and the wider verification), both growing with the batch."""
    return (0.15 + 0.05 * k) * (1 + 0.3 * (batch_size - 1))


def _serve(policy: RoundLengthPolicy, rate: float, rounds: int = 400, batch_size: int = 1,
           seed: int = 0) -> tuple[float, list[int]]:
    """Tokens per second the policy reaches on `_round_seconds` when each next draft is
    accepted with probability `rate`, and the lengths it chose."""
    rng = random.Random(seed)
    rids = [f"r{i}" for i in range(batch_size)]
    tokens = seconds = 0.0
    chosen = []
    for _ in range(rounds):
        k = policy.batch_length(rids, batch_size)
        chosen.append(k)
        for rid in rids:
            accepted = next((j for j in range(k) if rng.random() >= rate), k)
            policy.update(rid, k, accepted)
            tokens += accepted + 1
        took = _round_seconds(k, batch_size)
        policy.record_round(batch_size, k, took)
        seconds += took
    return tokens / seconds, chosen


@pytest.mark.parametrize("batch_size", [1, 4])
def test_where_drafts_are_rejected_the_policy_takes_plain_steps_and_probes_again(batch_size):
    plain = batch_size / _round_seconds(0, batch_size)
    reached, chosen = _serve(RoundLengthPolicy(16, 4, 64), rate=0.2, batch_size=batch_size)
    # It measures drafting (the initial length) and a plain step first, then mostly steps.
    assert chosen[:2] == [16, 0]
    assert chosen.count(0) > 0.9 * len(chosen)
    # Drafting is tried again, less often while it keeps losing.
    probes = [i for i, k in enumerate(chosen) if i > 2 and k > 0]
    assert len(probes) >= 3 and probes[0] <= 2 + FIRST_PROBE_AFTER + 2
    assert probes[-1] - probes[-2] > probes[1] - probes[0]
    assert reached >= 0.95 * plain


def test_where_drafts_are_accepted_the_policy_drafts_and_times_plain_steps_again():
    plain = 1 / _round_seconds(0, 1)
    best_fixed = max((1 + expected_accepted(0.95, k)) / _round_seconds(k, 1)
                     for k in (4, 8, 16, 32, 64))
    reached, chosen = _serve(RoundLengthPolicy(16, 4, 64), rate=0.95)
    assert reached > 1.5 * plain and reached >= 0.85 * best_fixed
    plains = [i for i, k in enumerate(chosen) if k == 0]
    # After the first, a plain step each PLAIN_REFRESH_ROUNDS rounds keeps its time current.
    assert all(b - a <= PLAIN_REFRESH_ROUNDS + 1 for a, b in itertools.pairwise(plains))
    assert len(plains) < len(chosen) / 20


def test_a_request_that_stops_accepting_gets_plain_steps_and_its_batch_mates_keep_drafting():
    policy = RoundLengthPolicy(16, 4, 64)
    for k in (16, 0, 16):
        policy.record_round(2, k, _round_seconds(k, 2))
    for _ in range(5):
        policy.update("copying", 16, 16)
        policy.update("new text", 16, 0)
    assert policy.rate("copying") > 0.9 > 0.25 > policy.rate("new text")
    assert policy.batch_length(["copying", "new text"], 2) > 0
    assert policy.batch_length(["new text"], 1) == 16  # batch size 1 not measured yet
    policy.forget("copying")
    assert policy.rate("copying") == policy.rate("another new one")


def test_a_new_request_is_tried_soon_while_plain_steps_win():
    policy = RoundLengthPolicy(16, 4, 64)
    _serve(policy, rate=0.1, rounds=300)  # plain steps win; drafting is tried ever less often
    chosen = []
    for _ in range(FIRST_PROBE_AFTER + 2):
        k = policy.batch_length(["newcomer"], 1)
        chosen.append(k)
        policy.record_round(1, k, _round_seconds(k, 1))
        if k:
            break
    assert chosen[-1] == 4, chosen
