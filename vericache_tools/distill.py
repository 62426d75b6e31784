"""Distil a small standalone draft model from the demo model (SmolLM2-135M-Instruct).

Why: truncating the target to its first layers makes a cheap drafter that rarely agrees with it
(4 layers: 0.9% of greedy tokens), because the early residual stream is far from what the LM head
reads. A few trained tensors close that gap. The draft model is the target's first
`copied_layers` decoder layers (copied at build time), then `trained_layers` trained decoder
layers and final norm, then an LM head made at build time as the target's embedding matrix
times a trained 576x576 projection (so the head is untied): a plain LlamaForCausalLM that
shares the target's tokenizer and embeddings and decodes on its own KV cache.

Only the trained tensors ship (drafter_weights/, under 16 MB); `build_draft_model` assembles the
full Hugging Face directory from the target and them. Training data is text installed here that
is not the Python standard library (third-party packages' sources and docs): the project's
tests, benchmarks and demo prompt with stdlib files, which are the held-out evaluation set.

    python -m vericache_tools.distill train      # label data with the target, train, ship
    python -m vericache_tools.distill evaluate   # agreement on held-out stdlib files
    python -m vericache_tools.distill build DEST # write the HF model directory
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vericache_sglang import models
from vericache_sglang.models import (
    PROJECTION_KEY,
    RECIPE_FILE,
    SUFFIXES,
    VOCAB_KEY,
    WEIGHTS_DIR,
    WEIGHTS_FILE,
    Recipe,
    build_draft_model,
)
from vericache_sglang.speculative.drafter import load_draft_model
from vericache_tools import prompts

EVAL_FILES = ("argparse.py", "difflib.py")
EVAL_TOKENS = 1500
# Third-party text only: these names would leak the held-out stdlib files into training.
EXCLUDED_PACKAGES = {"vericache_sglang", "vericache_kernels", "__pycache__"}
EXCLUDED_NAMES = set(EVAL_FILES)
MAX_FILE_BYTES = 200_000


def site_packages() -> Path:
    """The running environment's site-packages (third-party text, never the stdlib)."""
    return Path(sysconfig.get_paths()["purelib"])


def default_work_dir() -> Path:
    """Labelled data and checkpoints: large, rebuildable, so kept beside the model cache."""
    return models.cache_root().parent / "distill"


# ----------------------------------------------------------------------------------------------
# Data: third-party sources and docs, labelled once by the target.


def corpus_files(root: Path, suffixes: tuple[str, ...] = SUFFIXES, seed: int = 0) -> list[Path]:
    """Text files of every installed package, interleaved package by package so that a token
    budget covers many projects rather than the first big one."""
    per_package: list[list[Path]] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    for entry in sorted(root.iterdir()):
        if (not entry.is_dir() or entry.name in EXCLUDED_PACKAGES
                or entry.name.endswith((".dist-info", ".egg-info", ".libs"))
                or entry.resolve().is_relative_to(stdlib)):
            continue
        files = [p for p in sorted(entry.rglob("*"))
                 if p.suffix in suffixes and p.name not in EXCLUDED_NAMES and p.is_file()
                 and 0 < p.stat().st_size <= MAX_FILE_BYTES]
        if files:
            random.Random(f"{seed}:{entry.name}").shuffle(files)
            per_package.append(files)
    order: list[Path] = []
    for i in range(max(map(len, per_package), default=0)):
        order.extend(files[i] for files in per_package if i < len(files))
    return order


def corpus_tokens(tokenizer, num_tokens: int, seq_len: int, max_file_tokens: int,
                  suffixes: tuple[str, ...] = SUFFIXES) -> torch.Tensor:
    """[N, seq_len] token ids: files' opening `max_file_tokens` tokens, EOS-separated, packed."""
    stream: list[int] = []
    for path in corpus_files(site_packages(), suffixes):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        stream += tokenizer(text)["input_ids"][:max_file_tokens] + [tokenizer.eos_token_id]
        if len(stream) >= num_tokens:
            break
    rows = len(stream) // seq_len
    return torch.tensor(stream[: rows * seq_len], dtype=torch.long).view(rows, seq_len)


@dataclass
class Labels:
    """What the student learns from: the target's residual stream after the copied layers (the
    student's exact input, since those layers are copied) and the target's greedy tokens."""

    hidden: torch.Tensor  # [N, L, H] float16, after `copied_layers` layers
    final: torch.Tensor  # [N, L, H] float16, the target's normed last hidden state
    greedy: torch.Tensor  # [N, L] int64, argmax of the target's logits

    def __len__(self) -> int:
        return self.greedy.shape[0]


@torch.no_grad()
def label(target, tokens: torch.Tensor, copied_layers: int, batch: int = 4,
          progress: str = "label") -> Labels:
    """Run the float32 target over `tokens` [N, L], `batch` rows at a time."""
    hidden, final, greedy = [], [], []
    start = time.monotonic()
    for i in range(0, len(tokens), batch):
        out = target(tokens[i : i + batch], output_hidden_states=True)
        hidden.append(out.hidden_states[copied_layers].half())
        final.append(out.hidden_states[-1].half())  # after the final norm: logits = head @ it
        greedy.append(out.logits.argmax(-1))
        done = min(i + batch, len(tokens)) * tokens.shape[1]
        rate = done / (time.monotonic() - start)
        print(f"\r[{progress}] {done:,}/{tokens.numel():,} tokens, {rate:.0f} tok/s",
              end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return Labels(torch.cat(hidden), torch.cat(final), torch.cat(greedy))


def load_target(target_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    return model.eval().requires_grad_(False)


def labelled_corpus(target_dir: Path, work: Path, copied_layers: int, num_tokens: int,
                    seq_len: int, max_file_tokens: int,
                    suffixes: tuple[str, ...] = SUFFIXES) -> Labels:
    """Label the training corpus, or reuse the labels a previous run saved for the same data."""
    from transformers import AutoTokenizer

    kinds = "".join(sorted(suffixes))
    path = work / f"labels-{copied_layers}L-{num_tokens}-{seq_len}-{max_file_tokens}{kinds}.pt"
    if path.is_file():
        return Labels(**torch.load(path))
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    tokens = corpus_tokens(tokenizer, num_tokens, seq_len, max_file_tokens, suffixes)
    labels = label(load_target(target_dir), tokens, copied_layers)
    work.mkdir(parents=True, exist_ok=True)
    torch.save(asdict(labels), path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    return labels


# ----------------------------------------------------------------------------------------------
# The student: a trained layer, final norm and head projection on the copied layers' output.

class Student(torch.nn.Module):
    """The trained part of the draft model: it takes the copied layers' hidden states."""

    def __init__(self, target, recipe: Recipe) -> None:
        import copy

        from transformers import LlamaConfig, LlamaModel

        super().__init__()
        # No embedding: the input is hidden states (a 1-token vocabulary keeps it cheap).
        config = LlamaConfig(**{**target.config.to_dict(),
                                "num_hidden_layers": recipe.trained_layers, "layer_types": None,
                                "vocab_size": 1, "pad_token_id": None, "bos_token_id": None,
                                "eos_token_id": None})
        self.core = LlamaModel(config).float()
        self.core.embed_tokens = None
        for i in range(recipe.trained_layers):
            source = target.model.layers[recipe.init_layer + i]
            self.core.layers[i].load_state_dict(copy.deepcopy(source.state_dict()))
        self.core.norm.load_state_dict(target.model.norm.state_dict())
        self.projection = torch.nn.Parameter(torch.eye(config.hidden_size))
        self.recipe = recipe
        self.register_buffer("token_ids", None)  # set by `choose_vocab`

    def choose_vocab(self, labels: Labels) -> None:
        """Keep the head's rows for the `recipe.draft_vocab` tokens the target chooses most
        often in the training labels (ids ascending)."""
        counts = torch.bincount(labels.greedy.flatten())
        self.token_ids = counts.argsort(descending=True, stable=True)[
            : self.recipe.draft_vocab].sort().values

    def head(self, full: torch.Tensor) -> torch.Tensor:
        """The rows of the target's head `full` this student scores."""
        return full if self.token_ids is None else full[self.token_ids]

    def targets(self, greedy: torch.Tensor) -> torch.Tensor:
        """`greedy` as rows of `head`: -1 for a token outside the draft vocabulary."""
        if self.token_ids is None:
            return greedy
        rows = torch.searchsorted(self.token_ids, greedy).clamp_(max=len(self.token_ids) - 1)
        return torch.where(self.token_ids[rows] == greedy, rows, -1)

    def tokens(self, scores: torch.Tensor) -> torch.Tensor:
        """Token ids of the best rows of `scores` [..., rows of `head`]."""
        best = scores.argmax(-1)
        return best if self.token_ids is None else self.token_ids[best]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the draft feeds its LM head (the target's embeddings), from copied-layer hidden
        states [B, L, H]; the target's counterpart is `Labels.final`."""
        normed = self.core(inputs_embeds=hidden.float(), use_cache=False).last_hidden_state
        return normed @ self.projection.T

    @torch.no_grad()
    def fit_projection(self, labels: Labels, ridge: float = 1e-2, rows: int = 8) -> None:
        """Least-squares P from this student's normed output to the target's normed final
        state: a good start (about 21% agreement instead of 3% at 8 layers)."""
        size = self.projection.shape[0]
        xx = torch.zeros(size, size, dtype=torch.float64)
        yx = torch.zeros(size, size, dtype=torch.float64)
        self.projection.copy_(torch.eye(size))
        for i in range(0, len(labels), rows):
            x = self(labels.hidden[i : i + rows]).flatten(0, 1).double()
            y = labels.final[i : i + rows].flatten(0, 1).double()
            xx += x.T @ x
            yx += y.T @ x
        xx += ridge * xx.diagonal().mean() * torch.eye(size, dtype=xx.dtype)
        self.projection.copy_(torch.linalg.solve(xx, yx, left=False).float())

    def shipped_tensors(self) -> dict[str, torch.Tensor]:
        """The trained tensors under their names in the draft model, in bf16."""
        tensors = {"model.norm.weight": self.core.norm.weight, PROJECTION_KEY: self.projection}
        for i, layer in enumerate(self.core.layers):
            for name, value in layer.state_dict().items():
                tensors[f"model.layers.{self.recipe.copied_layers + i}.{name}"] = value
        shipped = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()}
        if self.token_ids is not None:
            shipped[VOCAB_KEY] = self.token_ids.contiguous()
        return shipped


def ship(student: Student, recipe: Recipe, dest: Path = WEIGHTS_DIR) -> None:
    """Write the trained tensors and their recipe (each file replaced whole)."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    save_file(student.shipped_tensors(), str(dest / f".{WEIGHTS_FILE}.tmp"))
    os.replace(dest / f".{WEIGHTS_FILE}.tmp", dest / WEIGHTS_FILE)
    (dest / WEIGHTS_FILE).chmod(0o644)  # safetensors writes 0600; the package must be readable
    (dest / f".{RECIPE_FILE}.tmp").write_text(json.dumps(asdict(recipe), indent=2) + "\n")
    os.replace(dest / f".{RECIPE_FILE}.tmp", dest / RECIPE_FILE)


@dataclass
class HeldOut:
    """A held-out stdlib file's opening tokens, labelled by the target."""

    name: str
    labels: Labels


def held_out(target, tokenizer, copied_layers: int) -> list[HeldOut]:
    ids = [torch.tensor([prompts.file_ids(tokenizer, f, EVAL_TOKENS)]) for f in EVAL_FILES]
    return [HeldOut(f, label(target, t, copied_layers, progress=f"label {f}"))
            for f, t in zip(EVAL_FILES, ids, strict=True)]


@torch.no_grad()
def student_agreement(student: Student, head: torch.Tensor,
                      sets: list[HeldOut]) -> dict[str, float]:
    """Teacher-forced top-1 agreement of the student with the target on each held-out file."""
    student.eval()
    rows = student.head(head)
    result = {s.name: round((student.tokens(student(s.labels.hidden) @ rows.T)
                             == s.labels.greedy).float().mean().item(), 4) for s in sets}
    student.train()
    return result


def distillation_loss(out: torch.Tensor, final: torch.Tensor, greedy: torch.Tensor,
                      head: torch.Tensor, soft_weight: float, chunk: int = 512) -> float:
    """Backpropagate, per token, the cross-entropy of the draft's distribution over the rows of
    `head` to a mixture: `soft_weight` x the target's distribution over them (recomputed from
    its stored final states through the tied head) plus the rest on its greedy token (a token
    without a row, `greedy` -1, puts the whole weight on the distribution); return that loss
    (KL divergence to the mixture plus its constant entropy). The target's distribution says which
    near-ties the draft may get wrong and which it may not, which its argmax alone does not.
    The gradient with respect to the logits is written out (softmax minus the mixture), in
    chunks of `chunk` tokens: autograd through [tokens, vocab] float32 tensors would spend
    most of a step on their element-wise passes and gigabytes on keeping them."""
    flat = out.flatten(0, 1)
    final, greedy = final.flatten(0, 1), greedy.flatten()
    grad, total = torch.empty_like(flat), 0.0
    with torch.no_grad():
        for i in range(0, len(flat), chunk):
            rows = slice(i, i + chunk)
            logits = (flat[rows].to(head.dtype) @ head.T).float()
            labelled = greedy[rows] >= 0
            weight = torch.where(labelled, soft_weight, 1.0)[:, None]
            if weight.any():
                mixture = (final[rows].to(head.dtype) @ head.T).float().softmax(-1) * weight
            else:
                mixture = torch.zeros_like(logits)
            hard = labelled.nonzero().flatten()
            mixture[hard, greedy[rows][hard]] += 1 - soft_weight
            log_q = logits.log_softmax(-1)
            total -= (mixture * log_q).sum().item()
            grad[rows] = (log_q.exp_().sub_(mixture).to(head.dtype) @ head).float()
    flat.backward(grad / len(flat))
    return total / len(flat)


def train(target_dir: Path, work: Path, recipe: Recipe, num_tokens: int, seq_len: int,
          max_file_tokens: int, batch_rows: int, eval_every: int, resume: bool,
          dest: Path = WEIGHTS_DIR) -> Recipe:
    """Label the corpus, fit the head projection in closed form, then train with
    `distillation_loss`. A checkpoint ships to `dest` every `eval_every` steps, so a run can be
    stopped at any point."""
    from transformers import AutoTokenizer

    labels = labelled_corpus(target_dir, work, recipe.copied_layers, num_tokens, seq_len,
                             max_file_tokens, tuple(recipe.suffixes))
    target = load_target(target_dir)
    sets = held_out(target, AutoTokenizer.from_pretrained(str(target_dir)),
                    recipe.copied_layers)
    student, head = Student(target, recipe), target.lm_head.weight
    if recipe.draft_vocab:
        student.choose_vocab(labels)
        covered = (student.targets(labels.greedy) >= 0).float().mean().item()
        print(f"[train] draft vocabulary: {recipe.draft_vocab:,} tokens, "
              f"{covered:.2%} of the training labels", file=sys.stderr)
    # bf16 for the head matmuls, the bulk of a step: about twice as fast on CPU.
    head_bf16 = student.head(head).to(torch.bfloat16)
    recipe.train_tokens, recipe.batch_tokens = labels.greedy.numel(), batch_rows * seq_len
    optimizer = torch.optim.AdamW(student.parameters(), lr=recipe.lr, betas=(0.9, 0.98),
                                  weight_decay=0.0)
    checkpoint, first, elapsed = work / "checkpoint.pt", 1, 0.0
    if resume and checkpoint.is_file():
        state = torch.load(checkpoint)
        student.load_state_dict(state["student"])
        optimizer.load_state_dict(state["optimizer"])
        first, elapsed = state["step"] + 1, state["seconds"]
    else:
        student.fit_projection(labels)
    print(f"[train] {recipe.train_tokens:,} tokens; at step {first - 1}: "
          f"{student_agreement(student, head, sets)}", file=sys.stderr)
    generator = torch.Generator().manual_seed(first)
    total = recipe.schedule_steps = recipe.steps
    warmup, start = max(1, total // 20), time.monotonic() - elapsed
    for step in range(first, total + 1):
        # Linear warm-up, then cosine decay to zero.
        decay = max(0, step - warmup) / max(1, total - warmup)
        lr = recipe.lr * min(1.0, step / warmup) * 0.5 * (1 + math.cos(math.pi * decay))
        for group in optimizer.param_groups:
            group["lr"] = lr
        rows = torch.randint(len(labels), (batch_rows,), generator=generator)
        optimizer.zero_grad()
        # bf16 matmuls in the trained layers too (float32 weights and sums): 1.5x a step.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = student(labels.hidden[rows])
        loss = distillation_loss(out, labels.final[rows], student.targets(labels.greedy[rows]),
                                 head_bf16, recipe.soft_weight)
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        seconds = time.monotonic() - start
        print(f"\r[train] step {step}/{total} loss {loss:.3f} "
              f"{(step - first + 1) * recipe.batch_tokens / (seconds - elapsed):.0f} tok/s",
              end="", file=sys.stderr, flush=True)
        if step % eval_every == 0 or step == total:
            recipe.steps, recipe.train_seconds = step, round(seconds)
            recipe.agreement = student_agreement(student, head, sets)
            print(f"\n[train] step {step}: agreement {recipe.agreement}", file=sys.stderr)
            torch.save({"student": student.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step, "seconds": seconds}, checkpoint.with_suffix(".tmp"))
            os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
            ship(student, recipe, dest)
    return recipe


@torch.no_grad()
def agreement(draft, target, ids: list[int], token_ids: torch.Tensor | None = None) -> float:
    """Fraction of positions where the draft's greedy token equals the target's, both
    teacher-forced on `ids` (`token_ids`: the target token of each row of the draft's head,
    as `load_draft_model` returns them)."""
    batch = torch.tensor([ids])
    best = draft(batch).logits.argmax(-1)
    if token_ids is not None:
        best = token_ids[best]
    return (best == target(batch).logits.argmax(-1)).float().mean().item()


def evaluate(target_dir: Path, weights: Path = WEIGHTS_DIR) -> dict[str, float]:
    """Build the draft model into a temporary folder and measure it as the drafter loads it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_target(target_dir)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_draft_model(target_dir, Path(tmp) / "draft", weights)
        draft, token_ids = load_draft_model(path, "cpu", torch.float32)
    return {f: round(agreement(draft, target, prompts.file_ids(tokenizer, f, EVAL_TOKENS),
                               token_ids), 4)
            for f in EVAL_FILES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vericache_tools.distill",
        description="Distil a small standalone draft model from the demo model.")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch CPU threads (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="label third-party text with the target, train, and "
                       f"write {WEIGHTS_DIR.name}/")
    t.add_argument("--copied-layers", type=int, default=8,
                   help="target layers the draft model copies (default: %(default)s)")
    t.add_argument("--trained-layers", type=int, default=1,
                   help="decoder layers trained after the copied ones (default: %(default)s)")
    t.add_argument("--init-layer", type=int, default=None,
                   help="target layer the first trained layer starts from (default: the first "
                   "one not copied)")
    t.add_argument("--tokens", type=int, default=142_336,
                   help="training tokens labelled by the target (default: %(default)s)")
    t.add_argument("--seq-len", type=int, default=1024,
                   help="tokens per training sequence (default: %(default)s)")
    t.add_argument("--max-file-tokens", type=int, default=1024,
                   help="tokens taken from the start of each file (default: %(default)s)")
    t.add_argument("--suffixes", nargs="+", default=list(SUFFIXES),
                   help="file types of the training text (default: %(default)s)")
    t.add_argument("--steps", type=int, default=400,
                   help="optimizer steps (default: %(default)s)")
    t.add_argument("--batch-rows", type=int, default=2,
                   help="sequences per step (default: %(default)s)")
    t.add_argument("--lr", type=float, default=6e-4, help="peak learning rate "
                   "(default: %(default)s)")
    t.add_argument("--soft-weight", type=float, default=0.0,
                   help="weight of KL divergence to the target's full distribution; the rest "
                   "is cross-entropy against its greedy token (default: %(default)s)")
    t.add_argument("--draft-vocab", type=int, default=0,
                   help="rows of the draft's head: the target's most frequent greedy tokens "
                   "in the training labels (default: %(default)s, the whole vocabulary)")
    t.add_argument("--eval-every", type=int, default=25,
                   help="steps between checkpoints (default: %(default)s)")
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    t.add_argument("--work-dir", type=Path, default=None,
                   help="labels and checkpoints (default: <cache>/distill)")
    t.add_argument("--out", type=Path, default=WEIGHTS_DIR,
                   help="where the trained tensors ship (default: the package's)")
    e = sub.add_parser("evaluate", help="agreement of the shipped draft model on held-out "
                       "stdlib files")
    e.add_argument("--weights", type=Path, default=WEIGHTS_DIR,
                   help="trained tensors to evaluate (default: the package's)")
    b = sub.add_parser("build", help="write the draft model's Hugging Face directory")
    b.add_argument("dest", type=Path, help="folder to write (replaced if it exists)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    target_dir = models.prepare().target
    if args.command == "train":
        init_layer = args.copied_layers if args.init_layer is None else args.init_layer
        recipe = Recipe(args.copied_layers, args.trained_layers, init_layer, steps=args.steps,
                        lr=args.lr, soft_weight=args.soft_weight,
                        suffixes=tuple(args.suffixes), draft_vocab=args.draft_vocab)
        recipe = train(target_dir, args.work_dir or default_work_dir(), recipe, args.tokens,
                       args.seq_len, args.max_file_tokens, args.batch_rows, args.eval_every,
                       args.resume, args.out)
        print(json.dumps(asdict(recipe), indent=2))
    elif args.command == "evaluate":
        print(json.dumps(evaluate(target_dir, args.weights), indent=2))
    else:
        print(build_draft_model(target_dir, args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
