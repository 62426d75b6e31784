"""Counting host reads: the tensor calls that, on a GPU, wait for the device and copy a value
to the host (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, Python's `bool`/`int`/`float` of a
tensor, a copy to the CPU). A CUDA graph cannot hold one, so a step that makes none can be
captured; on CPU the same calls are counted where they are made."""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__,
}


def _to_host(func, args, kwargs) -> bool:
    """`tensor.to("cpu")` and its spellings (device given by position or keyword)."""
    if func is not torch.Tensor.to:
        return False
    device = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(device, str | torch.device):
        return torch.device(device).type == "cpu"
    return False


class HostReads(TorchFunctionMode):
    """Counts host reads made while active, each with where it was made (the innermost frame
    of this project's code)."""

    def __init__(self) -> None:
        super().__init__()
        self.where: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS or _to_host(func, args, kwargs):
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "vericache" in f.filename and "tests/support" not in f.filename]
            place = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "elsewhere"
            self.where[f"{func.__name__} at {place}"] += 1
        return func(*args, **kwargs)

    @property
    def count(self) -> int:
        return sum(self.where.values())
