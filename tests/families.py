"""Tiny seeded random-weight models of the families SGLang users serve, built offline.

Each is a transformers config of its family (hidden 256, 4 layers, 4 query and 2 KV heads, the
demo tokenizer's 49,152-token vocabulary), with the attention features that family carries set
so that a 600-token prompt crosses them: sliding windows of 128 tokens, Gemma 2's attention
softcapping, Mixtral's experts. Weights are seeded and drawn wide enough (`init_std`) that
greedy outputs vary from token to token and depend on distant context, or a comparison would
prove nothing. Built once per family and recipe into the models cache, float32.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vericache_sglang.models import COMPLETE_MARKER, cache_root

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "max_position_embeddings": 4096, "tie_word_embeddings": False}
WINDOW = 128
"""Sliding window of the windowed families: a 600-token prompt crosses it several times."""


@dataclass(frozen=True)
class Family:
    """One model family: its transformers config class, the fields that set its features, and
    the initialiser's spread."""

    name: str
    config_class: str
    fields: dict[str, Any] = field(default_factory=dict)
    init_std: float = 0.15
    features: tuple[str, ...] = ()
    """The attention features it carries (documentation, and the test ids)."""


FAMILIES = {family.name: family for family in (
    Family("llama", "LlamaConfig"),
    Family("qwen2", "Qwen2Config"),
    Family("qwen3", "Qwen3Config"),
    Family("mistral-window", "MistralConfig", {"sliding_window": WINDOW},
           features=("sliding window",)),
    Family("phi3", "Phi3Config", {"sliding_window": None, "pad_token_id": 0}),
    Family("gemma2", "Gemma2Config",
           {"sliding_window": WINDOW, "attn_logit_softcapping": 20.0,
            "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 64,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh"},
           init_std=0.02, features=("sliding window", "softcapping")),
    Family("gemma3", "Gemma3TextConfig",
           {"sliding_window": WINDOW, "query_pre_attn_scalar": 64,
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                            "full_attention"],
            "hidden_activation": "gelu_pytorch_tanh"},
           init_std=0.02, features=("sliding window",)),
    Family("mixtral", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2},
           features=("mixture of experts",)),
)}


def recipe(family: Family) -> dict[str, Any]:
    return {"config_class": family.config_class, **SHAPE, **family.fields,
            "init_std": family.init_std, "seed": 0}


def build(name: str, tokenizer_dir: Path, root: Path | None = None) -> Path:
    """The family's model directory (built on first use): config, float32 safetensors, the
    demo tokenizer beside them."""
    import torch
    import transformers

    family = FAMILIES[name]
    spec = recipe(family)
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    dest = (root or cache_root()) / "families" / f"{name}-{digest}"
    if (dest / COMPLETE_MARKER).exists():
        return dest
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    fields = {k: v for k, v in spec.items() if k not in ("config_class", "init_std", "seed")}
    config = getattr(transformers, family.config_class)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, initializer_range=family.init_std,
        torch_dtype="float32", **fields)
    torch.manual_seed(spec["seed"])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent.mkdir(parents=True, exist_ok=True) or dest.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if family.fields.get("hidden_act"):
        # SGLang's Gemma 2 reads `hidden_act`, which transformers does not write for it.
        config_path = tmp / "config.json"
        saved = json.loads(config_path.read_text())
        saved["hidden_act"] = family.fields["hidden_act"]
        config_path.write_text(json.dumps(saved, indent=2))
    (tmp / COMPLETE_MARKER).touch()
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest
