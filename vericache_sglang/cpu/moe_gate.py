"""Qwen2-MoE's shared-expert gate on SGLang's CPU engine.

SGLang's Qwen2-MoE (and Qwen3-Next-style models with a gated shared expert) adds the shared
expert's output through a Triton kernel, `_fused_gate_sigmoid_mul_add_kernel`, on every
device but Intel AMX and NPU; on a CPU without a Triton driver it fails ("0 active drivers"),
so plain SGLang cannot serve the family here. This AROUND hook on the kernel's launcher
computes the same thing in torch for CPU tensors: per token, sigmoid(hidden . gate_weight) times
the shared output, added to the output when asked, in float32 as the kernel does. CUDA tensors
take SGLang's kernel. The seam that would replace it: a CPU path in SGLang's launcher.
"""

from __future__ import annotations

import torch
from sglang.srt.plugins.hook_registry import HookType

from vericache_sglang.integration.hooks import hook

TARGET = "sglang.kernels.ops.elementwise.elementwise._launch_fused_gate_sigmoid_mul"


def gate_sigmoid_mul(hidden_states: torch.Tensor, gate_weight: torch.Tensor,
                     shared_output: torch.Tensor, output: torch.Tensor, *,
                     do_add: bool) -> None:
    """The kernel's result, written into `output`."""
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())[:, None]
    result = gate * shared_output.float()
    if do_add:
        result += output.float()
    output.copy_(result)


def _launch(original, hidden_states, gate_weight, shared_output, output, *, do_add: bool):
    if hidden_states.device.type != "cpu":
        return original(hidden_states, gate_weight, shared_output, output, do_add=do_add)
    return gate_sigmoid_mul(hidden_states, gate_weight, shared_output, output, do_add=do_add)


def register() -> None:
    """Register the hook (the plugin calls this only when SGLang's CPU engine is selected)."""
    hook(TARGET, _launch, HookType.AROUND)
