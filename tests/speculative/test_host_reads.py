"""A drafting step makes no host read: building its forward batch, the compressed-KV attention of
every layer and choosing its draft tokens run on the device from what the round planned on the
host, so on a GPU the step can be captured as a CUDA graph (`HostReads` counts `.item()`,
`.tolist()`, `.cpu()` and their kin). Real SGLang pools, allocator and radix tree; no model
(its layers are SGLang's own, which SGLang already captures)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.support.compressed_pool import DIM, KV_HEADS, Q_HEADS, Setup
from tests.support.host_reads import HostReads
from vericache_sglang.speculative.forwards import draft_forward_batch
from vericache_sglang.speculative.round import Round
from vericache_sglang.speculative.sampling import SamplingRows, draft_tokens

VOCAB = 50
STEPS = 4


def _round(committed: list[int], slots: list[int], seeds: bool) -> Round:
    bs = len(committed)
    lens = torch.tensor(committed)
    n = torch.ones(bs)
    rows = SamplingRows(temperatures=n * 0.7, top_ks=torch.tensor([1] + [20] * (bs - 1)),
                        top_ps=n, min_ps=n * 0, need_filter=True,
                        seeds=torch.arange(bs) + 5 if seeds else None)
    return Round(k=STEPS, room=[100] * bs, committed=lens, committed_cpu=lens.clone(),
                 slots=slots, positions=lens[:, None] + torch.arange(STEPS + 1),
                 locs=torch.zeros(bs, STEPS + 1, dtype=torch.int64),
                 tokens=[torch.zeros(bs, dtype=torch.int64)], grammar=None, penalties=None,
                 rows=rows, drafts=[True] * bs)


@pytest.mark.parametrize("spec", ["kivi:bits=4,group=32,residual=32",
                                  "kivi:bits=2,group=32,residual=64"])
@pytest.mark.parametrize("seeds", [False, True], ids=["sampled", "seeded"])
@pytest.mark.parametrize("paged", [True, False], ids=["page pool", "per request"])
def test_a_drafting_step_reads_nothing_back_to_the_host(spec, seeds, paged):
    setup = Setup(spec, slots=2048, layers=2, requests=3)
    committed = [300, 517, 96]
    slots = [0, 1, 2]
    for slot, length in zip(slots, committed, strict=True):
        setup.request(slot, list(range(slot * 1000, slot * 1000 + length + STEPS)))
    backend = setup.backend if paged else setup.dense_backend
    round_ = _round(committed, slots, seeds)
    batch = SimpleNamespace(req_pool_indices=torch.tensor(slots))
    gen = torch.Generator().manual_seed(0)
    backend.begin_round(slots, committed, STEPS)  # host planning, between steps: not counted
    bs = len(committed)
    for step in range(STEPS):
        q, k, v = (torch.randn(bs, heads * DIM, generator=gen)
                   for heads in (Q_HEADS, KV_HEADS, KV_HEADS))
        logits = torch.randn(bs, VOCAB, generator=gen)
        with HostReads() as reads:
            backend.set_step(step)
            fb = draft_forward_batch(batch, round_, list(range(bs)), [step] * bs,
                                     round_.tokens[-1])
            outs = [backend.forward_decode(q, k, v, layer, fb) for layer in setup.layers]
            token, _ = draft_tokens(logits, round_.rows, round_.positions[:, step])
        assert reads.count == 0, dict(reads.where)
        assert all(out.shape == (bs, Q_HEADS * DIM) for out in outs)
        round_.tokens.append(token)
    backend.end_round()


def test_host_reads_counts_each_kind_of_read():
    t = torch.arange(4)
    with HostReads() as reads:
        t.sum().item()
        t.tolist()
        t.cpu()
        int(t[0])
        bool(t[1])
        t.to("cpu")
        _ = t + 1  # device work reads nothing
    assert reads.count == 6, dict(reads.where)
