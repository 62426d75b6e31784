"""The distilled draft model (vericache_sglang/drafter_weights) builds into a plain Hugging Face
LlamaForCausalLM that agrees with the demo model's greedy token on held-out stdlib code."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vericache_sglang import distill, models, prompts

MIN_AGREEMENT = 0.40
"""Teacher-forced top-1 agreement on the first 1,500 tokens of argparse.py (never trained on);
the shipped weights measure 0.4173 (recipe.json); the margin covers float32 sums taken
in another order on another machine."""


def test_built_draft_model_agrees_with_the_target(tmp_path, demo_models):
    torch.set_num_threads(2)
    dest = distill.build_draft_model(demo_models.target, tmp_path / "draft")
    assert (dest / models.COMPLETE_MARKER).is_file()
    config = json.loads((dest / "config.json").read_text())
    recipe = distill.load_recipe()
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == recipe.copied_layers + recipe.trained_layers < 30
    draft = AutoModelForCausalLM.from_pretrained(str(dest), dtype=torch.float32).eval()
    target = distill.load_target(demo_models.target)
    tokenizer = AutoTokenizer.from_pretrained(str(dest))
    ids = prompts.file_ids(tokenizer, "argparse.py", distill.EVAL_TOKENS)
    assert ids == prompts.file_ids(AutoTokenizer.from_pretrained(str(demo_models.target)),
                                   "argparse.py", distill.EVAL_TOKENS)
    assert distill.agreement(draft, target, ids) >= MIN_AGREEMENT
