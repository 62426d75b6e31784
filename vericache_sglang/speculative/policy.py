"""Draft lengths: how many tokens a round drafts on the compressed tier before verifying, and
how many tokens a level-2 drafter proposes per level-1 check.

A round of k drafts costs k drafting forwards and one verification forward over k + 1 tokens,
and emits (accepted + 1) tokens per request; a plain decode step costs one forward and emits
one. Whether drafting pays depends on the acceptance and on what the forwards cost at this
batch size and context, on this device. `RoundLengthPolicy` chooses each round's k from those,
measured; zero drafts (a plain step) is one of its choices. `DraftLengthPolicy` keeps the
level-2 drafter's per-request proposal lengths by a grow-and-shrink rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftLengthPolicy:
    """Per-request adaptive length within [minimum, maximum]:

    * every proposal accepted: the length grows by half (at least +1), up to the maximum;
    * otherwise it moves halfway towards (accepted + 1), the length that would have lost
      nothing, never below the minimum."""

    initial: int
    minimum: int
    maximum: int
    adaptive: bool = True
    _lengths: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_lengths(self.minimum, self.initial, self.maximum)

    def length(self, rid: str) -> int:
        """Length for the request's next proposal."""
        return self._lengths.get(rid, self.initial)

    def update(self, rid: str, drafted: int, accepted: int) -> int:
        """Record an outcome (`accepted` of `drafted`); return the next length."""
        _check_outcome(drafted, accepted)
        current = self.length(rid)
        if not self.adaptive:
            return current
        if accepted >= drafted:
            nxt = min(self.maximum, max(current, drafted) + max(1, drafted // 2))
        else:
            nxt = max(self.minimum, (current + accepted + 2) // 2)
        self._lengths[rid] = nxt
        return nxt

    def forget(self, rid: str) -> None:
        """Drop a finished request's state."""
        self._lengths.pop(rid, None)


ACCEPTANCE_DECAY = 0.7
"""Weight of a request's earlier rounds in its acceptance estimate, per round: the acceptance
of code and chat changes within a request (a copied block, then new text)."""
ACCEPTANCE_PRIOR_WEIGHT = 2.0
"""A new request starts from the server's recent acceptance, worth this many drafts."""
COST_DECAY = 0.7
"""Weight of the earlier measurements of a (batch size, k) round's seconds: costs grow with the
context, so recent rounds count most."""
PLAIN_REFRESH_ROUNDS = 32
"""A plain step is timed again after this many rounds of its batch size without one."""
COST_TTL_ROUNDS = 64
"""A draft length's measured time is forgotten after this many rounds of its batch size
without it."""
FIRST_PROBE_AFTER = 8
LAST_PROBE_AFTER = 256
"""While plain steps win, drafting is tried again after 8 of them, then after twice as many
each time it still loses, up to 256."""


@dataclass
class _Acceptance:
    """Decayed counts of a request's accepted drafts and first rejections: a geometric model
    in which each next draft is accepted with probability `rate`."""

    accepted: float = 0.0
    rejected: float = 0.0

    def rate(self, prior: float) -> float:
        weight = ACCEPTANCE_PRIOR_WEIGHT
        return (self.accepted + prior * weight) / (self.accepted + self.rejected + weight)


@dataclass
class _Costs:
    """Seconds of a round by its draft length, for one batch-size bucket, with the round at
    which each was last measured."""

    seconds: dict[int, float] = field(default_factory=dict)
    measured: dict[int, int] = field(default_factory=dict)
    rounds: int = 0
    rounds_since_plain: int = 0

    def record(self, k: int, seconds: float) -> None:
        self.rounds += 1
        old = self.seconds.get(k)
        self.seconds[k] = seconds if old is None else COST_DECAY * old + (1 - COST_DECAY) * seconds
        self.measured[k] = self.rounds
        self.rounds_since_plain = 0 if k == 0 else self.rounds_since_plain + 1
        for stale in [n for n, at in self.measured.items() if self.rounds - at > COST_TTL_ROUNDS]:
            del self.seconds[stale], self.measured[stale]

    def predict(self, k: int) -> float:
        """Measured, or linear between (and beyond) the nearest measured lengths: a round's
        drafting forwards grow with k, its verification forward a little."""
        if k in self.seconds:
            return self.seconds[k]
        known = sorted(self.seconds)  # at least a plain step and one drafting length
        below = [n for n in known if n < k]
        above = [n for n in known if n > k]
        if below and above:
            a, b = below[-1], above[0]
        elif len(below) >= 2:
            a, b = below[-2], below[-1]
        else:
            a, b = above[0], above[1]
        ta, tb = self.seconds[a], self.seconds[b]
        return max(ta + (tb - ta) * (k - a) / (b - a), 1e-9)


def expected_accepted(rate: float, k: int) -> float:
    """Drafts accepted of k when each next one is accepted with probability `rate`."""
    if rate >= 1.0:
        return float(k)
    return rate * (1 - rate**k) / (1 - rate)


def _bucket(batch_size: int) -> int:
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class RoundLengthPolicy:
    """Each round's draft length k, chosen by measured cost among `lengths()`: 0 (a plain step)
    and powers of two within [minimum, maximum] (with both ends), so that a small set of round
    shapes recurs. For each candidate it weighs the tokens the batch's requests are expected
    to emit (their acceptance so far) against the round's seconds measured at this batch size
    (a plain step's included), and takes the best rate. It measures what it has not: the first
    round of a batch size drafts `initial` (later, when no length's time is current, the
    smallest), the second is a plain step, and a plain step is
    timed again every `PLAIN_REFRESH_ROUNDS`; while plain steps win it tries drafting again
    after 8, 16, ... 256 of them, and after 8 again once a new request has joined (whose
    acceptance is the server's so far until it drafts). A length's time not measured again
    within `COST_TTL_ROUNDS` rounds is forgotten (contexts grow, and a first round's one-off
    costs must not price a length out for good). With minimum == maximum (`adaptive` False)
    every round drafts that length."""

    initial: int
    minimum: int
    maximum: int
    adaptive: bool = True
    _acceptance: dict[str, _Acceptance] = field(default_factory=dict)
    _server_rate: float = 0.5
    _costs: dict[int, _Costs] = field(default_factory=dict)
    _plain_streak: int = 0
    _probe_after: int = FIRST_PROBE_AFTER

    def __post_init__(self) -> None:
        _check_lengths(self.minimum, self.initial, self.maximum)

    def lengths(self) -> list[int]:
        """The draft lengths a round may take."""
        if not self.adaptive:
            return [self.initial]
        powers = {1 << i for i in range(self.maximum.bit_length())
                  if self.minimum < 1 << i < self.maximum}
        return sorted({0, self.minimum, self.initial, self.maximum, *powers})

    def rate(self, rid: str) -> float:
        """The request's estimated chance that its next draft is accepted."""
        return self._acceptance.get(rid, _Acceptance()).rate(self._server_rate)

    def batch_length(self, rids: list[str], batch_size: int) -> int:
        """The next round's k for a batch of `batch_size` requests, `rids` of which draft."""
        if not self.adaptive or not rids:
            return self.initial if rids else 0
        costs = self._costs.setdefault(_bucket(batch_size), _Costs())
        if not any(k > 0 for k in costs.seconds):  # first rounds, or their times expired
            return self.initial if costs.rounds == 0 else min(k for k in self.lengths() if k)
        if 0 not in costs.seconds or costs.rounds_since_plain >= PLAIN_REFRESH_ROUNDS:
            return 0
        if any(rid not in self._acceptance for rid in rids):
            self._probe_after = FIRST_PROBE_AFTER  # a new request is tried soon
        rates = [self.rate(rid) for rid in rids]
        best = max(self.lengths(), key=lambda k: (
            (batch_size + sum(expected_accepted(r, k) for r in rates)) / costs.predict(k)))
        if best > 0:
            self._plain_streak, self._probe_after = 0, FIRST_PROBE_AFTER
            return best
        self._plain_streak += 1
        if self._plain_streak > self._probe_after:
            self._plain_streak = 0
            self._probe_after = min(2 * self._probe_after, LAST_PROBE_AFTER)
            return min(k for k in self.lengths() if k > 0)
        return 0

    def record_round(self, batch_size: int, k: int, seconds: float) -> None:
        """A round's wall time, from planning to acceptance (on a GPU, acceptance reads the
        verdict on the host, so the round's kernels are done)."""
        if self.adaptive:
            self._costs.setdefault(_bucket(batch_size), _Costs()).record(k, seconds)

    def update(self, rid: str, drafted: int, accepted: int) -> None:
        """Record a round's outcome for a request (`accepted` of `drafted` drafts)."""
        _check_outcome(drafted, accepted)
        if drafted == 0:
            return
        state = self._acceptance.setdefault(rid, _Acceptance())
        state.accepted = ACCEPTANCE_DECAY * state.accepted + accepted
        state.rejected = ACCEPTANCE_DECAY * state.rejected + (accepted < drafted)
        observed = accepted / (accepted + (accepted < drafted))
        self._server_rate = (ACCEPTANCE_DECAY * self._server_rate
                             + (1 - ACCEPTANCE_DECAY) * observed)

    def forget(self, rid: str) -> None:
        """Drop a finished request's state."""
        self._acceptance.pop(rid, None)


def _check_lengths(minimum: int, initial: int, maximum: int) -> None:
    if not 1 <= minimum <= initial <= maximum:
        raise ValueError(
            f"need 1 <= minimum <= initial <= maximum, got {minimum}, {initial}, {maximum}")


def _check_outcome(drafted: int, accepted: int) -> None:
    if not 0 <= accepted <= drafted:
        raise ValueError(f"accepted {accepted} outside [0, {drafted}]")
