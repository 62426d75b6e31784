"""Evaluate compressors on a real HF transformers model: the tests' real KV and the benchmarks.

The model runs in float32 with an attention function that wraps SDPA, so that a prefill can
record post-RoPE keys, values, queries and attention scores per layer, and greedy decoding can
read each layer's past only from compressed blocks (lossy drafting, as VeriCache drafts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from vericache_sglang.compress import CompressedKV, Compressor
from vericache_sglang.compress.attention_probs import causal_attention_probs

ATTENTION = "vericache_eval"
# (module, query [B, Hq, q, D], key [B, H, k, D], value, scaling) -> output [B, q, Hq, D] or None
Hook = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, float],
                torch.Tensor | None]
_hooks: list[Hook] = []


def _attention(module, query, key, value, attention_mask, **kwargs):
    if _hooks:
        out = _hooks[-1](module, query, key, value, kwargs.get("scaling", module.scaling))
        if out is not None:
            return out, None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@contextmanager
def _hooked(hook: Hook) -> Iterator[None]:
    _hooks.append(hook)
    try:
        yield
    finally:
        _hooks.pop()


def load_model(path: str | Path) -> tuple[PreTrainedModel, AutoTokenizer]:
    """The model in float32 (the reference precision) with the recording attention."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=ATTENTION)
    return model.eval(), tokenizer


@dataclass
class LayerKV:
    """One layer's prompt K/V and attention statistics, float32."""

    keys: torch.Tensor
    """[T, H, D] post-RoPE."""
    values: torch.Tensor
    """[T, H, D]."""
    window_scores: torch.Tensor
    """[Hq, W, T] attention of the last W prompt queries (SnapKV)."""
    total_scores: torch.Tensor | None
    """[Hq, 1, T] attention summed over every prompt query (H2O), when asked for."""
    queries: torch.Tensor | None
    """[T, Hq, D] post-RoPE queries, when asked for."""

    def scores_for(self, compressor: Compressor) -> torch.Tensor | None:
        """The scores `compressor.compress` wants, per its `score_window`."""
        if not compressor.needs_scores:
            return None
        window = compressor.score_window()
        if window is None:
            if self.total_scores is None:
                raise ValueError(f"{compressor.spec()} needs prefill(..., total_scores=True)")
            return self.total_scores
        recorded = self.window_scores.shape[1]
        if window > recorded and recorded < self.keys.shape[0]:
            raise ValueError(f"{compressor.spec()} needs a {window}-query window; prefill "
                             f"recorded {self.window_scores.shape[1]}")
        return self.window_scores[:, -window:]

    def compress(self, compressor: Compressor, layer: int) -> CompressedKV:
        positions = torch.arange(self.keys.shape[0])
        return compressor.compress(self.keys, self.values, positions, self.scores_for(compressor),
                                   layer=layer)


@torch.inference_mode()
def prefill(
    model: PreTrainedModel,
    input_ids: Sequence[int],
    window: int = 32,
    total_scores: bool = True,
    keep_queries: bool = False,
) -> list[LayerKV]:
    """Run the prompt once with `use_cache=True`: every layer's K/V is the model's own
    `past_key_values`; queries and attention scores are recorded on the way (the summed scores
    cost a second pass over all query-key pairs, in chunks of queries)."""
    stats: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}

    def record(module, query, key, value, scaling):
        q, k = query[0].transpose(0, 1), key[0].transpose(0, 1)  # [T, Hq, D], [T, H, D]
        n = k.shape[0]
        w = min(window, n)
        total = causal_attention_probs(q, k, 0, scaling, summed=True) if total_scores else None
        stats[module.layer_idx] = (
            causal_attention_probs(q[n - w:], k, n - w, scaling),
            total,
            q.clone() if keep_queries else None,
        )
        return None

    with _hooked(record):
        cache = model(torch.tensor([list(input_ids)]), use_cache=True).past_key_values
    return [
        LayerKV(layer.keys[0].transpose(0, 1).contiguous(),
                layer.values[0].transpose(0, 1).contiguous(), *stats[i])
        for i, layer in enumerate(cache.layers)
    ]


@dataclass
class StepRecord:
    """One layer's decode step under full KV: the query and the new token's K/V."""

    query: torch.Tensor
    """[Hq, D] post-RoPE."""
    key: torch.Tensor
    """[H, D]."""
    value: torch.Tensor
    """[H, D]."""


@torch.inference_mode()
def greedy_full(
    model: PreTrainedModel, layers: list[LayerKV], first_token: int, steps: int,
    record_steps: int = 0,
) -> tuple[list[int], list[list[StepRecord]]]:
    """Greedy decoding on the full prompt KV, feeding `first_token` (the prompt's last token)
    first; also returns [step][layer] records for the first `record_steps` steps."""
    cache = DynamicCache()
    for i, layer in enumerate(layers):
        cache.update(layer.keys.transpose(0, 1)[None], layer.values.transpose(0, 1)[None], i)
    records: list[list[StepRecord]] = []

    def record(module, query, key, value, scaling):
        if module.layer_idx == 0:
            records.append([])
        records[-1].append(StepRecord(query[0, :, -1], key[0, :, -1], value[0, :, -1]))
        return None

    tokens, token = [], first_token
    for step in range(steps):
        with _hooked(record) if step < record_steps else nullcontext():
            logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
        token = int(logits[0, -1].argmax())
        tokens.append(token)
    return tokens, records


class _CompressedLayer(DynamicLayer):
    """One model layer's past for a batch of compressors, read only from their blocks; the new
    token is attended exactly, then appended through the compressor."""

    def __init__(self, compressors: Sequence[Compressor], blocks: list[CompressedKV], seen: int):
        super().__init__()
        self.compressors, self.blocks, self.seen = compressors, blocks, seen
        self.is_initialized = True
        self.lengths: list[int] = []

    def update(self, key_states, value_states, *args, **kwargs):
        batch, heads, _, dim = key_states.shape
        self.lengths = [len(block) + 1 for block in self.blocks]
        shape = (batch, heads, max(self.lengths), dim)
        keys, values = key_states.new_zeros(shape), value_states.new_zeros(shape)
        for i, block in enumerate(self.blocks):
            past_k, past_v = block.dense()
            n = past_k.shape[0]
            keys[i, :, :n], values[i, :, :n] = past_k.transpose(0, 1), past_v.transpose(0, 1)
            keys[i, :, n], values[i, :, n] = key_states[i, :, -1], value_states[i, :, -1]
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def select(self, rows: list[int]) -> None:
        """Keep only these batch rows (the others have finished)."""
        self.compressors = [self.compressors[i] for i in rows]
        self.blocks = [self.blocks[i] for i in rows]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(len(block) for block in self.blocks) + query_length, 0

    def attend(self, query, keys, values, scaling) -> torch.Tensor:
        lengths = torch.tensor(self.lengths)
        mask = torch.arange(keys.shape[2])[None] < lengths[:, None]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask[:, None, None],
                                             scale=scaling, enable_gqa=True)
        position = torch.tensor([self.seen])
        for i, (compressor, block) in enumerate(zip(self.compressors, self.blocks, strict=True)):
            n = self.lengths[i]
            scores = None
            if compressor.needs_scores:
                scores = causal_attention_probs(query[i].transpose(0, 1),
                                                keys[i, :, :n].transpose(0, 1), n - 1, scaling)
            compressor.append(block, keys[i, :, n - 1][None], values[i, :, n - 1][None],
                              position, scores)
        self.seen += 1
        return out.transpose(1, 2)


@torch.inference_mode()
def greedy_compressed(
    model: PreTrainedModel,
    layers: list[LayerKV],
    compressors: Sequence[Compressor],
    first_token: int,
    steps: int,
    reference: Sequence[int] | None = None,
) -> list[list[int]]:
    """Greedy decoding of one sequence per compressor, in one batch, each reading its prompt KV
    only from that compressor's blocks. With `reference`, a row stops at its first divergence
    (its last token is the divergent one) and leaves the batch."""
    cache = Cache(layers=[
        _CompressedLayer(compressors, [layer.compress(c, i) for c in compressors],
                         layer.keys.shape[0])
        for i, layer in enumerate(layers)
    ])

    def attend(module, query, key, value, scaling):
        return cache.layers[module.layer_idx].attend(query, key, value, scaling)

    rows: list[list[int]] = [[] for _ in compressors]
    active = list(range(len(compressors)))
    tokens = torch.full((len(compressors), 1), first_token)
    with _hooked(attend):
        for step in range(steps):
            logits = model(tokens, past_key_values=cache, use_cache=True).logits
            tokens = logits[:, -1].argmax(-1, keepdim=True)
            for row, token in zip(active, tokens[:, 0].tolist(), strict=True):
                rows[row].append(token)
            if reference is not None:
                going = [i for i, row in enumerate(active) if rows[row][-1] == reference[step]]
                if len(going) < len(active):
                    active = [active[i] for i in going]
                    tokens = tokens[going]
                    for layer in cache.layers:
                        layer.select(going)
                if not active:
                    break
    return rows
