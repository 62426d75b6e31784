"""The attention contract: what an SGLang attention layer carries, and which of it VeriCache
honours.

SGLang's `RadixAttention` holds, beside `scaling`, per-layer features its backends apply:
a sliding window, logit softcapping, cross or encoder-only attention, and more. VeriCache's own
attention (drafting over the compressed KV, verification and the host tier's streamed forwards)
must apply each of them exactly as SGLang's backends do, or the server must not start: a
feature ignored silently changes the model's output. `refusal` walks a loaded model's layers
and names the first feature VeriCache does not serve; docs/attention-contract.md has the table
of every field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def sliding_window(layer: Any) -> int | None:
    """The layer's window as SGLang applies it: a query at position p sees keys at positions
    p - window .. p (`TorchNativeAttnBackend._make_sliding_window_mask`; SGLang's models pass
    the config's window - 1). None for full attention."""
    window = getattr(layer, "sliding_window_size", -1)
    return None if window is None or window < 0 else int(window)


def logit_cap(layer: Any) -> float:
    """The layer's attention logit softcap (0: none)."""
    return float(getattr(layer, "logit_cap", 0.0) or 0.0)


def window_visible(query_pos: torch.Tensor, key_pos: torch.Tensor,
                   window: int | None) -> torch.Tensor:
    """Causal visibility of keys at `key_pos` from queries at `query_pos` (broadcast), within
    the window if there is one."""
    visible = key_pos <= query_pos
    return visible if window is None else visible & (key_pos >= query_pos - window)


@dataclass(frozen=True)
class ModelAttention:
    """What a loaded model's attention layers carry, as VeriCache reads it."""

    layers: int
    windowed: tuple[int, ...]
    """Layer ids with a sliding window."""
    capped: tuple[int, ...]
    """Layer ids with logit softcapping."""

    def summary(self) -> str:
        parts = [f"{self.layers} attention layers"]
        if self.windowed:
            parts.append(f"{len(self.windowed)} with a sliding window (read exactly, within it)")
        if self.capped:
            parts.append(f"{len(self.capped)} with logit softcapping")
        return ", ".join(parts)


def radix_layers(model: torch.nn.Module) -> list[Any]:
    """The model's SGLang attention layers."""
    from sglang.srt.layers.radix_attention import RadixAttention

    return [m for m in model.modules() if isinstance(m, RadixAttention)]


def describe(model: torch.nn.Module) -> ModelAttention:
    layers = radix_layers(model)
    return ModelAttention(
        layers=len(layers),
        windowed=tuple(layer.layer_id for layer in layers if sliding_window(layer) is not None),
        capped=tuple(layer.layer_id for layer in layers if logit_cap(layer) > 0))


def _layer_refusal(layer: Any) -> str | None:
    """Why VeriCache cannot serve this layer exactly, or None."""
    from sglang.srt.layers.radix_attention import AttentionType

    if layer.is_cross_attention:
        return "cross-attention layers (encoder-decoder models)"
    if layer.attn_type != AttentionType.DECODER:
        return f"{layer.attn_type.value} attention layers (not causal decoding)"
    if layer.qk_head_dim != layer.v_head_dim:
        return (f"attention with different key and value head sizes ({layer.qk_head_dim} and "
                f"{layer.v_head_dim})")
    if layer.use_irope:
        return "chunked local attention (iRoPE, Llama 4)"
    if layer.pos_encoding_mode != "NONE":
        return f"position encoding inside attention ({layer.pos_encoding_mode})"
    if getattr(layer, "xai_temperature_len", -1) > 0:
        return "position-dependent attention temperature (Grok)"
    if logit_cap(layer) > 0 and layer.logit_capping_method != "tanh":
        return f"logit capping by {layer.logit_capping_method!r} (only tanh is served)"
    if layer.quant_method is not None or layer.k_scale is not None:
        return "quantized attention (per-layer K/V scales)"
    return None


def _model_refusal(model: torch.nn.Module, model_config: Any, kv_pool: Any) -> str | None:
    """Model-level features VeriCache does not serve: MLA, attention sinks, other KV pools."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if getattr(model_config, "attention_arch", None) == AttentionArch.MLA:
        return ("multi-head latent attention (MLA: DeepSeek V2/V3, Kimi K2); its compressed "
                "latent KV is not built yet")
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        return "attention sinks (gpt-oss)"
    if type(kv_pool) is not MHATokenToKVPool:
        return (f"the {type(kv_pool).__name__} KV pool (hybrid sliding-window, linear-attention "
                "or other pools; a sliding-window model serves with --disable-hybrid-swa-memory)")
    return None


def refusal(model_runner: Any, placement: str) -> str | None:
    """One line naming the model feature VeriCache cannot serve exactly on this server, or
    None. Checked in the scheduler once the model and its KV pool exist."""
    name = model_runner.model_config.hf_config.architectures[0]
    model = model_runner.model
    found = _model_refusal(model, model_runner.model_config, model_runner.token_to_kv_pool)
    layers = radix_layers(model)
    if found is None:
        found = next(filter(None, map(_layer_refusal, layers)), None)
    if found is None and placement != "device":
        described = describe(model)
        if described.windowed or described.capped:
            found = (f"sliding-window or softcapped attention with the full KV in {placement} "
                     "memory (use --vericache-full-tier device)")
    if found is None and not layers:
        found = "a model without SGLang attention layers"
    return None if found is None else f"{name} has {found}: VeriCache cannot serve it exactly"
