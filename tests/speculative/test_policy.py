"""The adaptive draft length policy (no server)."""

from __future__ import annotations

import pytest

from vericache_sglang.speculative.policy import DraftLengthPolicy


def test_draft_length_policy_adapts():
    policy = DraftLengthPolicy(initial=8, minimum=4, maximum=64)
    assert policy.update("r", drafted=8, accepted=8) == 12
    assert policy.update("r", drafted=12, accepted=12) == 18
    assert policy.update("r", drafted=18, accepted=2) == 11
    assert policy.update("r", drafted=11, accepted=0) == 6
    assert policy.update("r", drafted=6, accepted=0) == 4  # floor
    assert policy.batch_length(["r", "new"]) == 8  # a new request starts at the initial length
    for _ in range(20):
        policy.update("r", drafted=policy.length("r"), accepted=policy.length("r"))
    assert policy.length("r") == 64  # ceiling
    policy.forget("r")
    assert policy.length("r") == 8
    fixed = DraftLengthPolicy(initial=8, minimum=8, maximum=8, adaptive=False)
    assert fixed.update("r", drafted=8, accepted=0) == 8


def test_policy_rejects_inconsistent_bounds():
    with pytest.raises(ValueError):
        DraftLengthPolicy(initial=2, minimum=4, maximum=64)
