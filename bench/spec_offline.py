"""VeriCache rounds simulated with HF transformers (float32), no SGLang: the reference acceptance.

For each prompt the model prefills the whole prompt (its K/V is the committed full KV, its last
logits give the first token t0), the compressor compresses the prompt K/V per layer, then every
round:

  draft   k greedy one-token forwards from t0 attending to the compressed committed prefix (its
          `dense()` read, GQA as the model does it) plus the round's own drafts' exact K/V;
  verify  one forward of [t0, d1..dk] over the full committed KV; accept the longest prefix of
          drafts equal to the full model's argmax, plus its next token (the new t0);
  commit  the accepted tokens' full K/V (from the verify forward) are kept and appended to the
          compressed blocks through the compressor, as the server's tier does.

It prints per prompt and config the rounds, drafted/accepted drafts and E, so that the server's
figures (bench/spec_decode.py) can be checked against an independent implementation of the
same scheme. Not a test.

`--codec-levels 4,2` also drafts a KIVI config's prompt on that coarser level of its CacheGen
stream (`vericache_sglang.codec`: 4 bits for the first quarter of the layers, 2 for the rest):
what a server drafting on a stored prefix's coarse level reads for the prompt (tokens decoded
since stay at the pool level).

    .venv/bin/python -m bench.spec_offline --prompts textwrap.py:2048 --configs kivi:bits=4@16
"""

from __future__ import annotations

import sys
import time

import torch
from transformers.cache_utils import DynamicCache

from bench import cli
from bench.cli import log
from vericache_sglang.codec import CodecSpec, coarser
from vericache_sglang.compress import parse_compressor_spec
from vericache_tools.hf_eval import load_model, prefill
from vericache_tools.prompts import file_prompt


@torch.inference_mode()
def simulate(model, ids: list[int], spec: str, k: int, new_tokens: int,
             level: tuple[int, ...] | None = None, recent: int = 0) -> dict:
    """Greedy VeriCache decoding of `new_tokens` tokens (the first from prefill); with `level`
    (bits per layer), the prompt's quantized groups are drafted on at that codec level, but
    for the groups of its last `recent` tokens (recency bits: those stay at the pool level)."""
    compressor = parse_compressor_spec(spec)
    window = compressor.score_window() or 1 if compressor.needs_scores else 1
    layers = prefill(model, ids, window=window,
                     total_scores=compressor.needs_scores and compressor.score_window() is None)
    full = DynamicCache()
    for i, layer in enumerate(layers):
        full.update(layer.keys.transpose(0, 1)[None], layer.values.transpose(0, 1)[None], i)
    blocks = [layer.compress(compressor, i) for i, layer in enumerate(layers)]
    del layers
    # The prompt's groups never change (prefix-stable KIVI): their coarse rows are fixed.
    coarse = None if level is None else [coarser(block.old, bits).dequantize(block.dtype)
                                         for block, bits in zip(blocks, level, strict=True)]
    if coarse is not None and recent:
        # The coarse rows end where the prompt's newest `recent` tokens begin (whole groups).
        group = compressor.plan(0).group
        keep = max(len(coarse[0][0]) - recent // group * group, 0)
        coarse = [(ck[:keep], cv[:keep]) for ck, cv in coarse]
    # The first token: the prompt's last logits (re-run the last token over the rest).
    committed = len(ids)
    probe = DynamicCache()
    for i, layer in enumerate(full.layers):
        probe.update(layer.keys[:, :, : committed - 1], layer.values[:, :, : committed - 1], i)
    logits = model(torch.tensor([[ids[-1]]]), past_key_values=probe,
                   position_ids=torch.tensor([[committed - 1]])).logits
    del probe
    t0 = int(logits[0, -1].argmax())
    output = [t0]
    rounds = drafted = accepted = 0
    histogram = [0] * (k + 1)
    while len(output) < new_tokens:
        width = min(k, new_tokens - len(output) - 1)
        # Draft on the compressed prefix; drafts' own K/V are exact (appended to this cache).
        draft_cache = DynamicCache()
        for i, block in enumerate(blocks):
            keys, values = block.dense()
            if coarse is not None:
                ck, cv = coarse[i]
                keys, values = torch.cat([ck, keys[len(ck):]]), torch.cat([cv, values[len(cv):]])
            draft_cache.update(keys.transpose(0, 1)[None].float(),
                               values.transpose(0, 1)[None].float(), i)
        chain = [t0]
        for step in range(width):
            logits = model(torch.tensor([[chain[-1]]]), past_key_values=draft_cache,
                           position_ids=torch.tensor([[committed + step]])).logits
            chain.append(int(logits[0, -1].argmax()))
        del draft_cache
        # Verify over the full KV.
        logits = model(torch.tensor([chain]), past_key_values=full,
                       position_ids=committed + torch.arange(width + 1)[None]).logits
        target = logits[0].argmax(-1).tolist()
        a = 0
        while a < width and chain[a + 1] == target[a]:
            a += 1
        rounds += 1
        drafted += width
        accepted += a
        if width == k:
            histogram[a] += 1
        if a < width:
            full.crop(a - width)  # drop the rejected drafts' K/V (negative: from the end)
        for i, block in enumerate(blocks):
            layer = full.layers[i]
            compressor.append(block, layer.keys[0, :, committed:].transpose(0, 1).contiguous(),
                              layer.values[0, :, committed:].transpose(0, 1).contiguous(),
                              torch.arange(committed, committed + a + 1))
        output += target[: a + 1]
        committed += a + 1
        t0 = target[a]
    output = output[:new_tokens]
    return {"rounds": rounds, "drafted": drafted, "accepted": accepted,
            "E": (len(output) - 1) / max(rounds, 1), "histogram": histogram, "output": output}


@torch.inference_mode()
def greedy_reference(model, ids: list[int], new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("bench.spec_offline", __doc__)
    cli.add_model(parser)
    parser.add_argument("--prompts", nargs="+", default=["textwrap.py:2048"],
                        metavar="FILE:TOKENS",
                        help="file under the stdlib directory or /usr/share/common-licenses "
                        "(or an absolute path) and prompt tokens, one prompt each "
                        "(default: %(default)s)")
    parser.add_argument("--configs", nargs="+", default=["kivi:bits=4@16"], metavar="SPEC@K")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--check-greedy", action="store_true",
                        help="also decode plainly and check the output is identical")
    parser.add_argument("--codec-levels", nargs="*", default=[], metavar="EARLY,LATE",
                        help="also draft each KIVI config's prompt on a coarser level of its "
                        "CacheGen stream: EARLY bits for the first quarter of the layers, "
                        "LATE for the rest (e.g. 4,2 2,2)")
    parser.add_argument("--recent-tokens", type=int, nargs="*", default=[0], metavar="N",
                        help="with --codec-levels: the prompt's newest N tokens stay at the "
                        "pool level (recency bits); one run per N (default: 0)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(cli.model_dir(args.model))
    for entry in args.prompts:
        label, ids = file_prompt(tokenizer, entry)
        reference = greedy_reference(model, ids, args.max_new_tokens) if args.check_greedy \
            else None
        for config in args.configs:
            spec, _, k = config.rpartition("@")
            levels = [None]
            for pair in args.codec_levels:
                early, late = (int(b) for b in pair.split(","))
                levels += CodecSpec.for_compressor(parse_compressor_spec(spec),
                                                   model.config.num_hidden_layers,
                                                   coarse=(early, late)).coarse
            runs = [(level, recent) for level in levels
                    for recent in ([0] if level is None else args.recent_tokens)]
            for level, recent in runs:
                began = time.monotonic()
                r = simulate(model, ids, spec, int(k), args.max_new_tokens, level, recent)
                same = "" if reference is None else (
                    ", identical to greedy" if r["output"] == reference
                    else ", DIFFERS FROM GREEDY")
                name = config if level is None else (
                    f"{config} drafting the prompt at codec level {sorted(set(level))} bits"
                    + (f", its newest {recent} tokens at the pool level" if recent else ""))
                log(f"{name}: rounds {r['rounds']}, drafted "
                    f"{r['drafted']}, accepted {r['accepted']} "
                    f"({r['accepted'] / max(r['drafted'], 1):.1%}), E {r['E']:.2f}, "
                    f"full-k rounds by accepted {r['histogram']}{same} "
                    f"({time.monotonic() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
