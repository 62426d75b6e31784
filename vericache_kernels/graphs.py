"""Replaying a drafting step as a CUDA graph, one graph per shape bucket, as SGLang's EAGLE
graph runners do: a step of small batch launches dozens of kernels per layer, and on a GPU their
launch cost, not the compressed KV they read, would bound it.

A step is a function of tensors whose first dimension is the batch (requests or draft rows).
The batch is padded up to the smallest bucket that holds it; each bucket is captured once on
static input buffers (after a warm-up run on a side stream, as `torch.cuda.graphs` requires) and
replayed with the new inputs copied in. Padding rows keep whatever the buffers held, so a step
must treat rows independently (attention does: a row reads only its own request's KV). Where
CUDA graphs are unavailable (a CPU), the step runs eagerly on the unpadded inputs: the same code
and results, without the replay.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket of at least `n` rows (buckets ascending)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"batch of {n} rows exceeds the largest graph bucket {buckets[-1]}")
    return buckets[i]


class BucketGraphs:
    """A step replayed from CUDA graphs captured per batch bucket (eager off CUDA).

    `step(*inputs)` must be shape-static given its inputs' shapes (no host reads, no
    data-dependent shapes) and allocate its outputs inside. Inputs other than the batch
    dimension must keep the shapes of the first call of their bucket; a different shape is a
    different key (`key` extends the bucket for such dimensions, e.g. the draft length).
    """

    def __init__(self, step: Callable[..., Outputs], buckets: Sequence[int],
                 device: torch.device, use_graphs: bool | None = None) -> None:
        self.step = step
        self.buckets = sorted(buckets)
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Outputs]] = {}
        self.captures = 0
        self.replays = 0

    def __call__(self, *inputs: torch.Tensor, key: tuple = ()) -> Outputs:
        if not self.use_graphs:
            return self.step(*inputs)
        n = inputs[0].shape[0]
        size = bucket_for(n, self.buckets)
        full_key = (size, *key, *(tuple(t.shape[1:]) for t in inputs))
        if full_key not in self._graphs:
            self._graphs[full_key] = self._capture(size, inputs)
        graph, static, outputs = self._graphs[full_key]
        for buffer, given in zip(static, inputs, strict=True):
            buffer[:n].copy_(given)
        graph.replay()
        self.replays += 1
        if isinstance(outputs, torch.Tensor):
            return outputs[:n]
        return tuple(out[:n] for out in outputs)

    def _capture(self, size: int, inputs: Sequence[torch.Tensor]):
        """Static buffers of `size` rows (the first rows of the inputs repeated into the
        padding, so padding rows are valid inputs), a warm-up run, then the capture."""
        n = inputs[0].shape[0]
        pad = torch.arange(size, device=inputs[0].device) % n
        static = [t.index_select(0, pad).contiguous() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(*static)  # compiles Triton kernels and settles the allocator
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.step(*static)
        self.captures += 1
        return graph, static, outputs
