"""The drafting step's graph runner (`vericache_kernels.graphs`) off CUDA: buckets, and the eager
fallback that runs the same step on the same inputs (the capture itself runs in the device
check, `bench/device_check.py`, section graphs)."""

from __future__ import annotations

import pytest
import torch

from vericache_kernels.graphs import BucketGraphs, bucket_for


def test_a_batch_takes_the_smallest_bucket_that_holds_it():
    buckets = [1, 2, 4, 8, 16]
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError, match="exceeds the largest graph bucket 16"):
        bucket_for(17, buckets)


def test_off_cuda_the_step_runs_eagerly_on_its_inputs():
    calls = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return x * 2 + y

    graphs = BucketGraphs(step, [1, 4], torch.device("cpu"))
    x, y = torch.arange(3.0), torch.ones(3)
    assert not graphs.use_graphs
    assert torch.equal(graphs(x, y), x * 2 + 1)
    assert calls == [3] and graphs.captures == graphs.replays == 0
