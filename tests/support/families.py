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
import zlib
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
    """The attention features SGLang's layers carry for it."""
    projection_std: float | None = None
    """Redraw the query, key and MLP input projections this wide: Gemma's tied, scaled
    embeddings need a narrow init (0.02), under which every position predicts the same token;
    peakier attention and MLPs make the output follow the input."""
    qk_norm_mean: float | None = None
    """Redraw the query and key norms' weights around this mean (Gemma 3 normalises q and k,
    scaling by 1 + weight, so a wide projection alone leaves attention flat)."""
    sglang_fields: dict[str, Any] = field(default_factory=dict)
    """Written into config.json beside what transformers saves: fields SGLang's model class
    reads that transformers does not write for this family."""


FAMILIES = {family.name: family for family in (
    Family("llama", "LlamaConfig"),
    Family("qwen2", "Qwen2Config"),
    Family("qwen3", "Qwen3Config"),
    # SGLang's Mistral (its Llama class) gives its layers no window: plain SGLang serves
    # full attention, and so must VeriCache.
    Family("mistral-window", "MistralConfig", {"sliding_window": WINDOW}),
    Family("phi3", "Phi3Config", {"sliding_window": None, "pad_token_id": 0}),
    Family("gemma2", "Gemma2Config",
           {"sliding_window": WINDOW, "attn_logit_softcapping": 20.0,
            "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 64,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
           init_std=0.02, projection_std=0.1, features=("sliding window", "softcapping"),
           sglang_fields={"hidden_act": "gelu_pytorch_tanh"}),
    Family("gemma3", "Gemma3TextConfig",
           {"sliding_window": WINDOW, "query_pre_attn_scalar": 64,
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                            "full_attention"],
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
           init_std=0.02, projection_std=0.1, qk_norm_mean=2.0, features=("sliding window",)),
    Family("mixtral", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2},
           features=("mixture of experts",)),
    Family("qwen2-moe", "Qwen2MoeConfig",
           {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
            "shared_expert_intermediate_size": 256},
           features=("mixture of experts", "shared expert")),
    Family("deepseek-v2", "DeepseekV2Config",
           {"kv_lora_rank": 64, "q_lora_rank": None, "qk_rope_head_dim": 32,
            "qk_nope_head_dim": 32, "v_head_dim": 32, "first_k_dense_replace": 4,
            "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "head_dim": 32, "num_key_value_heads": 4,
            # SGLang's CPU rotary embedding for DeepSeek serves YaRN only (factor 1: none).
            "rope_scaling": {"rope_type": "yarn", "factor": 1.0, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096}},
           features=("multi-head latent attention",),
           sglang_fields={"moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1,
                          "topk_group": 1, "routed_scaling_factor": 1.0,
                          "scoring_func": "softmax", "norm_topk_prob": False}),
)}


PROJECTIONS = ("q_proj.weight", "k_proj.weight", "gate_proj.weight", "up_proj.weight")
QK_NORMS = ("q_norm.weight", "k_norm.weight")

RECIPE_ONLY = ("config_class", "init_std", "seed", "projection_std", "qk_norm_mean",
               "sglang_fields")
"""Recipe keys that are not transformers config fields."""


def recipe(family: Family) -> dict[str, Any]:
    """What a family's model is made from (its digest names the built directory); each family
    its own seed, so that families of one architecture do not share weights."""
    return {"config_class": family.config_class, **SHAPE, **family.fields,
            "init_std": family.init_std, "seed": zlib.crc32(family.name.encode()),
            "projection_std": family.projection_std, "qk_norm_mean": family.qk_norm_mean,
            "sglang_fields": family.sglang_fields}


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
    fields = {k: v for k, v in spec.items() if k not in RECIPE_ONLY}
    config = getattr(transformers, family.config_class)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, initializer_range=family.init_std,
        torch_dtype="float32", **fields)
    torch.manual_seed(spec["seed"])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if family.projection_std is not None and name.endswith(PROJECTIONS):
                weight.normal_(0.0, family.projection_std)
            if family.qk_norm_mean is not None and name.endswith(QK_NORMS):
                weight.normal_(family.qk_norm_mean, 1.0)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent.mkdir(parents=True, exist_ok=True) or dest.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if family.sglang_fields:
        config_path = tmp / "config.json"
        saved = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**saved, **family.sglang_fields}, indent=2))
    (tmp / COMPLETE_MARKER).touch()
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest
