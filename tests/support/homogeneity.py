"""A two-sample test of whether two servers' sampled tokens follow one distribution, and the
draws it needs to tell two given distributions apart.

Too few draws make a test that cannot fail: every token is pooled into one cell and p = 1
whatever the samples. So the test refuses such samples (`TooFewDraws`), and `draws_needed`
sizes a sample in advance from the distributions it should tell apart."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

from scipy.stats import chi2, chi2_contingency, ncx2

MIN_CELL = 10
"""Tokens seen fewer times in both samples together are pooled into one cell, so that every
cell expects about 5 or more per sample."""


class TooFewDraws(ValueError):
    """Samples whose tokens all pool into one cell: no difference between them could show."""


def two_sample_pvalue(a: Sequence[int], b: Sequence[int]) -> tuple[float, int]:
    """Chi-square test of homogeneity of two token samples; (p-value, cells). Two samples of
    one and the same token are one cell, p = 1; samples in which no token reaches `MIN_CELL`
    draws raise `TooFewDraws`, saying how many draws at least would give one a cell."""
    ca, cb = Counter(a), Counter(b)
    common = sorted(t for t in ca.keys() | cb.keys() if ca[t] + cb[t] >= MIN_CELL)
    if not common:
        most = max((ca + cb).values(), default=0)
        needed = math.ceil(max(len(a), len(b), 1) * MIN_CELL / max(most, 1))
        raise TooFewDraws(
            f"{len(a)} and {len(b)} draws: no token was drawn {MIN_CELL} times in both samples "
            f"together (the most frequent {most} times), so all pool into one cell and the "
            f"test cannot fail; at least {needed} draws per sample are needed (at the most "
            f"frequent token's share; more if it was lucky: `draws_needed` sizes a sample "
            f"for a given difference)")
    rows = [[c[t] for t in common] + [sum(v for t, v in c.items() if t not in common)]
            for c in (ca, cb)]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    if len(rows[0]) < 2:
        return 1.0, 1  # both samples are one token throughout
    return float(chi2_contingency(rows, correction=False).pvalue), len(rows[0])


def power(p: Mapping[int, float], q: Mapping[int, float], draws: int, alpha: float) -> float:
    """The probability that `two_sample_pvalue` of `draws` draws from `p` and as many from `q`
    (token probabilities) is below `alpha`: the noncentral chi-square approximation over the
    cells it expects to make (a token whose expected count in both samples together reaches
    `MIN_CELL`, and the rest pooled), noncentrality draws * sum((p - q)^2 / (p + q))."""
    tokens = p.keys() | q.keys()
    own = [t for t in tokens if draws * (p.get(t, 0.0) + q.get(t, 0.0)) >= MIN_CELL]
    cells = [(p.get(t, 0.0), q.get(t, 0.0)) for t in own]
    rest = (1.0 - sum(pi for pi, _ in cells), 1.0 - sum(qi for _, qi in cells))
    if sum(rest) > 1e-12:
        cells.append(rest)
    if len(cells) < 2:
        return 0.0
    shift = draws * sum((pi - qi) ** 2 / (pi + qi) for pi, qi in cells)
    df = len(cells) - 1
    return float(ncx2.sf(chi2.isf(alpha, df), df, shift))


def draws_needed(p: Mapping[int, float], q: Mapping[int, float], alpha: float,
                 target: float = 0.9, limit: int = 1 << 20) -> int:
    """The draws per sample at which the test tells `q` from `p` at level `alpha` with
    probability `target` (`power`): the fewest above half the first power of two that does.
    A computation, not a simulation: a test's sample size is the same on every run."""
    high = 1
    while power(p, q, high, alpha) < target:
        high *= 2
        if high > limit:
            raise ValueError(f"more than {limit} draws per sample would be needed")
    return next(n for n in range(high // 2 + 1, high + 1) if power(p, q, n, alpha) >= target)
