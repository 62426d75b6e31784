"""A two-sample test of whether two servers' sampled tokens follow one distribution."""

from __future__ import annotations

from collections import Counter

from scipy.stats import chi2_contingency

MIN_CELL = 10
"""Tokens seen fewer times in both samples together are pooled into one cell, so that every
cell expects about 5 or more per sample."""


def two_sample_pvalue(a: list[int], b: list[int]) -> tuple[float, int]:
    """Chi-square test of homogeneity of two token samples; (p-value, cells)."""
    ca, cb = Counter(a), Counter(b)
    common = sorted(t for t in ca.keys() | cb.keys() if ca[t] + cb[t] >= MIN_CELL)
    rows = [[c[t] for t in common] + [sum(v for t, v in c.items() if t not in common)]
            for c in (ca, cb)]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    if len(rows[0]) < 2:
        return 1.0, len(rows[0])  # one cell: both servers always emit the same token
    return float(chi2_contingency(rows, correction=False).pvalue), len(rows[0])
