"""The sampled-output test (`tests/support/homogeneity.py`) can fail: it refuses draws too few
to make a cell, rejects a skewed sampler at the draws `draws_needed` sizes for it, and passes
samples of one distribution. Seeded draws: every outcome here is the same on every run."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.homogeneity import MIN_CELL, TooFewDraws, draws_needed, power, two_sample_pvalue

ALPHA = 1e-3 / 4
"""The Mooncake sampled-request test's level per position (1e-3 over its 4 positions)."""

SAMPLES = 47
"""The draws per server that test needs (`test_the_sampled_request_draws_are_sized_for_a_greedy_
sampler`)."""


def _position(head: list[float], rare: int) -> dict[int, float]:
    """Token probabilities: `head`, then the rest of the mass spread over `rare` tokens."""
    rest = (1.0 - sum(head)) / rare
    return {**dict(enumerate(head)), **{len(head) + i: rest for i in range(rare)}}


POSITIONS = [_position([0.5456, 0.434, 0.0071, 0.0065], 7),
             _position([0.54, 0.164, 0.13, 0.082], 13),
             _position([0.251, 0.148, 0.138, 0.088], 63),
             _position([0.224, 0.212, 0.137, 0.127], 60)]
"""The Mooncake test's sampled request (its prompt: the csv module's source, then 30 tokens of
the question) on the demo model at temperature 0.5, per output position: the largest four
probabilities as measured (HF, float32; position 0 exactly, the others over 1,000 draws), the
rest spread evenly over as many tokens as those draws saw."""


def _draws(p: dict[int, float], n: int, seed: int) -> list[int]:
    """`n` tokens drawn from `p`."""
    tokens = list(p)
    weights = np.array([p[t] for t in tokens])
    rng = np.random.default_rng(seed)
    return [tokens[i] for i in rng.choice(len(tokens), size=n, p=weights / weights.sum())]


def _greedy(p: dict[int, float]) -> dict[int, float]:
    """A sampler skewed as far as it goes: always the most likely token."""
    return {max(p, key=p.get): 1.0}


def test_draws_too_few_to_make_a_cell_are_refused_saying_how_many_are_needed():
    spread = _position([], 40)  # 40 equally likely tokens
    with pytest.raises(TooFewDraws, match=r"^20 and 20 draws: no token was drawn 10 times .*"
                       r"the most frequent 4 times.* at least 50 draws per sample"):
        two_sample_pvalue(_draws(spread, 20, 1), _draws(spread, 20, 2))
    n = 40 * MIN_CELL // 2  # every token expected MIN_CELL times in both samples together
    pvalue, cells = two_sample_pvalue(_draws(spread, n, 1), _draws(spread, n, 2))
    assert cells >= 2 and pvalue > ALPHA


def test_one_and_the_same_token_throughout_is_one_cell_and_passes():
    assert two_sample_pvalue([7] * 30, [7] * 30) == (1.0, 1)


def test_the_sampled_request_draws_are_sized_for_a_greedy_sampler():
    """At every position `SAMPLES` draws tell a greedy sampler from the real one with
    probability 0.9 or more, and make two cells or more (a token expected `MIN_CELL` times)."""
    assert max(draws_needed(p, _greedy(p), ALPHA) for p in POSITIONS) == SAMPLES
    assert all(power(p, _greedy(p), SAMPLES, ALPHA) >= 0.9 for p in POSITIONS)


@pytest.mark.parametrize("position", range(len(POSITIONS)))
def test_at_the_recommended_draws_a_skewed_sampler_fails_and_the_same_one_passes(position):
    p = POSITIONS[position]
    real = _draws(p, SAMPLES, 10 + position)
    skewed, cells = two_sample_pvalue(real, _draws(_greedy(p), SAMPLES, 20 + position))
    assert skewed < ALPHA and cells >= 2
    same, cells = two_sample_pvalue(real, _draws(p, SAMPLES, 30 + position))
    assert same > ALPHA and cells >= 2


def test_over_many_seeds_the_test_rejects_as_sized():
    """Position 0, 200 seeds: the greedy sampler is rejected at least as often as `power`
    says less a margin, samples of one distribution about `ALPHA` of the time (none here)."""
    p = POSITIONS[0]
    runs = range(200)
    skewed = [two_sample_pvalue(_draws(p, SAMPLES, 2 * s), [0] * SAMPLES)[0] for s in runs]
    same = [two_sample_pvalue(_draws(p, SAMPLES, 2 * s), _draws(p, SAMPLES, 2 * s + 1))[0]
            for s in runs]
    rejected = sum(v < ALPHA for v in skewed) / len(runs)
    assert rejected >= power(p, _greedy(p), SAMPLES, ALPHA) - 0.05, rejected
    assert sum(v < ALPHA for v in same) == 0


def test_sizing_for_a_difference_too_small_to_find_says_so():
    p = POSITIONS[0]
    with pytest.raises(ValueError, match="more than 1024 draws per sample"):
        draws_needed(p, {**p, 0: p[0] - 1e-3, 1: p[1] + 1e-3}, ALPHA, limit=1024)
