"""Penalties and logit bias at a round's chain positions equal SGLang's own penalizers fed the
same tokens one decode step at a time, in the same process (bit for bit: plain greedy output
under penalties depends on every rounding, and on the order the penalizers run in)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang.srt.sampling import penaltylib
from sglang.srt.sampling.sampling_params import SamplingParams

from vericache_sglang.speculative.penalties import PenaltyStates, RoundPenalties

VOCAB = 64
EOS = 1


class _Batch:
    """What SGLang's penalizer orchestrator reads of a schedule batch."""

    def __init__(self, reqs: list) -> None:
        self.reqs = reqs
        self.device = "cpu"


def _req(rid: str, output: list[int], **params) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, output_ids=list(output), sampling_params=SamplingParams(
        max_new_tokens=64, **params), eos_token_ids={2},
        tokenizer=SimpleNamespace(eos_token_id=EOS, additional_stop_token_ids=None))


def _sglang_logits(reqs: list, logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each request's next logits as plain SGLang decodes them now without the overlap
    scheduler: its penalizers built at prefill from the set SamplingBatchInfo uses, fed every
    output token one step at a time, applied by the orchestrator, then the bias."""
    batch = _Batch([SimpleNamespace(**{**vars(req), "output_ids": []}) for req in reqs])
    orchestrator = penaltylib.BatchedPenalizerOrchestrator(VOCAB, batch, {
        penaltylib.BatchedFrequencyPenalizer, penaltylib.BatchedMinNewTokensPenalizer,
        penaltylib.BatchedPresencePenalizer, penaltylib.BatchedRepetitionPenalizer})
    for step in range(max(len(req.output_ids) for req in reqs)):
        orchestrator.cumulate_output_tokens(torch.tensor(
            [req.output_ids[min(step, len(req.output_ids) - 1)] for req in reqs]))
    out = logits.clone()
    orchestrator.apply(out)
    return out + bias


def test_every_chain_position_gets_plain_decodings_penalties():
    torch.manual_seed(0)
    output, drafts = [3, 7, 3, 9], [7, EOS, 3, 3, 11, 2]
    penalized = dict(frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.3,
                     min_new_tokens=7, stop_token_ids=[5])
    reqs = [_req("penalized", output, **penalized), _req("plain", [4, 4])]
    bias = torch.zeros(2, VOCAB)
    bias[0, 7], bias[0, 11] = 2.5, -1.0
    width = len(drafts) + 1
    logits = torch.randn(2 * width, VOCAB) * 8
    batch = SimpleNamespace(reqs=reqs, sampling_info=SimpleNamespace(logit_bias=bias))
    round_ = RoundPenalties.for_batch(PenaltyStates(VOCAB, "cpu"), batch)
    requests = [i for i in range(2) for _ in range(width)]
    got = logits.clone()
    round_.penalize(got, requests, list(range(width)) * 2, [drafts, [0] * len(drafts)])
    round_.bias(got, requests)
    for j in range(width):
        # The penalized request after d1..dj; the other request never changes.
        at_j = [_req("penalized", output + drafts[:j], **penalized), reqs[1]]
        want = _sglang_logits(at_j, logits[[j, width + j]], bias)
        assert torch.equal(got[j], want[0]), j
        assert torch.equal(got[width + j], logits[width + j]), j
    # min_new_tokens held EOS, 2 and 5 back at the first positions only.
    assert got[0, EOS] == got[0, 5] == float("-inf")
    assert torch.isfinite(got[width - 1]).all()


def test_states_follow_the_output_across_rounds():
    """A request's committed state is advanced over the tokens each round emitted, not
    rebuilt: the same tensors as building it from the whole output."""
    states = PenaltyStates(VOCAB, "cpu")
    req = _req("r", [3, 7], frequency_penalty=0.1)
    states.committed(req)
    req.output_ids += [3, 3, 8]
    incremental = states.committed(req)
    states.forget("r")
    rebuilt = states.committed(req)
    assert incremental.counted == rebuilt.counted == 5
    assert torch.equal(incremental.frequency, rebuilt.frequency)
    assert incremental.frequency[3] > incremental.frequency[7] > 0 == incremental.frequency[4]


def test_a_rounds_calls_advance_one_running_state(monkeypatch):
    """One-token drafting asks for steps 0, 1, 2, ... over drafts that only grow: each call
    counts one more draft (k advances a round, not k^2/2). A call behind the running state
    or over drafts changed under it (a rejected proposal, verification) still gets exactly
    plain decoding's penalties."""
    torch.manual_seed(1)
    output, drafts = [3, 7], [7, 3, 3, 11, 9, 7]
    penalized = dict(frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.1)
    req = _req("r", output, **penalized)
    zero_bias = torch.zeros(1, VOCAB)
    round_ = RoundPenalties.for_batch(
        PenaltyStates(VOCAB, "cpu"),
        SimpleNamespace(reqs=[req], sampling_info=SimpleNamespace(logit_bias=None)))
    advances = 0
    original = type(round_._base[0]).advance

    def counting(self, token, params):
        nonlocal advances
        advances += 1
        original(self, token, params)

    monkeypatch.setattr(type(round_._base[0]), "advance", counting)

    def check(steps: list[int], chain: list[int]) -> None:
        logits = torch.randn(len(steps), VOCAB) * 8
        got = logits.clone()
        round_.penalize(got, [0] * len(steps), steps, [chain])
        for row, step in enumerate(steps):
            want = _sglang_logits([_req("r", output + chain[:step], **penalized)],
                                  logits[row : row + 1], zero_bias)
            assert torch.equal(got[row], want[0]), (steps, step)

    for step in range(len(drafts)):  # one-token drafting
        check([step], drafts[:step])
    assert advances == len(drafts) - 1
    check([3, 4, 5], drafts[:3] + [11, 2])  # level 1 over proposals at step 3
    check([4], drafts[:3] + [11])  # the second proposal rejected
    check(list(range(len(drafts) + 1)), drafts)  # verification
