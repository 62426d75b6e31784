"""The CPU engine's fixes that let plain SGLang serve a family as the model defines it, and the
attention contract's refusals (no server: SGLang's own layers, pools and backend).

- Softcapping in torch_native (`cpu/softcap.py`): a capped layer's extend and decode forwards
  equal capped attention within the layer's window; SGLang's own code ignores the cap.
- Qwen2-MoE's shared-expert gate (`cpu/moe_gate.py`): the torch stand-in equals SGLang's
  Triton kernel, run by the Triton interpreter.
- `attention.features`: each layer feature VeriCache does not serve is refused in one line.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from tests.support.compressor_oracles import attention
from tests.support.interpreter import interpreter_only, rerun_under_interpreter
from vericache_sglang.attention import features
from vericache_sglang.cpu import moe_gate, softcap

Q_HEADS, KV_HEADS, DIM = 4, 2, 32
SCALE = DIM**-0.5
WINDOW, CAP = 24, 3.0
PREFIXES, EXTENDS = [0, 40], [50, 9]
"""Two requests in one extend: a fresh 50-token prompt, and 9 tokens over a 40-token prefix."""


class Case:
    """Two requests' K/V at scattered slots of real SGLang pools, and their queries."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        self.pool = MHATokenToKVPool(size=256, page_size=1, dtype=torch.float32,
                                     head_num=KV_HEADS, head_dim=DIM, layer_num=1, device="cpu",
                                     enable_memory_saver=False)
        self.req_to_token = ReqToTokenPool(size=4, max_context_len=256, device="cpu",
                                           enable_memory_saver=False)
        lengths = [p + e for p, e in zip(PREFIXES, EXTENDS, strict=True)]
        rows = (torch.randperm(255, generator=gen)[: sum(lengths)] + 1).split(lengths)
        self.rows, self.slots = rows, [1, 2]
        self.keys = [torch.randn(n, KV_HEADS, DIM, generator=gen) * 2 for n in lengths]
        self.values = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in lengths]
        self.queries = [torch.randn(n, Q_HEADS, DIM, generator=gen) * 2 for n in lengths]
        for slot, r, k, v, p in zip(self.slots, rows, self.keys, self.values, PREFIXES,
                                    strict=True):
            self.req_to_token.req_to_token[slot, : len(r)] = r.to(torch.int32)
            self.pool.k_buffer[0][r[:p]], self.pool.v_buffer[0][r[:p]] = k[:p], v[:p]
        self.backend = TorchNativeAttnBackend(SimpleNamespace(
            device="cpu", req_to_token_pool=self.req_to_token, token_to_kv_pool=self.pool))

    def extend(self, layer: RadixAttention) -> torch.Tensor:
        """Each request's new tokens through the hooked extend."""
        new = [slice(p, p + e) for p, e in zip(PREFIXES, EXTENDS, strict=True)]
        lens = torch.tensor([p + e for p, e in zip(PREFIXES, EXTENDS, strict=True)])
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=2,
            input_ids=torch.zeros(sum(EXTENDS), dtype=torch.int64),
            req_pool_indices=torch.tensor(self.slots), seq_lens=lens, seq_lens_sum=int(lens.sum()),
            out_cache_loc=torch.cat([r[s] for r, s in zip(self.rows, new, strict=True)]),
            extend_prefix_lens=torch.tensor(PREFIXES), extend_seq_lens=torch.tensor(EXTENDS))
        self.backend.init_forward_metadata(fb)
        return softcap._extend(
            TorchNativeAttnBackend.forward_extend, self.backend,
            torch.cat([q[s] for q, s in zip(self.queries, new, strict=True)]).flatten(1),
            torch.cat([k[s] for k, s in zip(self.keys, new, strict=True)]),
            torch.cat([v[s] for v, s in zip(self.values, new, strict=True)]), layer, fb)

    def expected(self, window: int | None, cap: float) -> torch.Tensor:
        outs = []
        for q, k, v, p, e in zip(self.queries, self.keys, self.values, PREFIXES, EXTENDS,
                                 strict=True):
            for t in range(p, p + e):
                first = 0 if window is None else max(t - window, 0)
                outs.append(attention(q[t], k[first : t + 1], v[first : t + 1], SCALE, cap))
        return torch.stack(outs)


@pytest.mark.parametrize("window", [None, WINDOW])
def test_torch_native_extend_applies_the_cap(window):
    case = Case()
    layer = RadixAttention(Q_HEADS, DIM, SCALE, KV_HEADS, layer_id=0, logit_cap=CAP,
                           sliding_window_size=-1 if window is None else window)
    out = case.extend(layer).view(-1, Q_HEADS, DIM)
    torch.testing.assert_close(out, case.expected(window, CAP), rtol=1e-4, atol=1e-5)
    # The K/V were saved where SGLang saves them.
    for r, k, p in zip(case.rows, case.keys, PREFIXES, strict=True):
        assert torch.equal(case.pool.k_buffer[0][r[p:]], k[p:])
    # The cap changes the result: uncapped attention is not what came out.
    assert not torch.allclose(out, case.expected(window, 0.0), atol=1e-3)


def test_torch_native_leaves_uncapped_layers_to_sglang():
    case = Case()
    layer = RadixAttention(Q_HEADS, DIM, SCALE, KV_HEADS, layer_id=0,
                           sliding_window_size=WINDOW)
    out = case.extend(layer).view(-1, Q_HEADS, DIM)
    torch.testing.assert_close(out, case.expected(WINDOW, 0.0), rtol=1e-4, atol=1e-5)


def test_torch_native_decode_applies_the_cap():
    case = Case()
    layer = RadixAttention(Q_HEADS, DIM, SCALE, KV_HEADS, layer_id=0, logit_cap=CAP,
                           sliding_window_size=WINDOW)
    # Both requests' prefixes and all but their last token are in the pool; decode the last.
    for r, k, v in zip(case.rows, case.keys, case.values, strict=True):
        case.pool.k_buffer[0][r[:-1]], case.pool.v_buffer[0][r[:-1]] = k[:-1], v[:-1]
    lens = torch.tensor([len(r) for r in case.rows])
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=2,
                      input_ids=torch.zeros(2, dtype=torch.int64),
                      req_pool_indices=torch.tensor(case.slots), seq_lens=lens,
                      seq_lens_sum=int(lens.sum()),
                      out_cache_loc=torch.stack([r[-1] for r in case.rows]))
    case.backend.init_forward_metadata(fb)
    out = softcap._decode(
        TorchNativeAttnBackend.forward_decode, case.backend,
        torch.stack([q[-1] for q in case.queries]).flatten(1),
        torch.stack([k[-1] for k in case.keys]), torch.stack([v[-1] for v in case.values]),
        layer, fb).view(2, Q_HEADS, DIM)
    for b, (q, k, v) in enumerate(zip(case.queries, case.keys, case.values, strict=True)):
        t = len(k) - 1
        torch.testing.assert_close(out[b], attention(q[t], k[t - WINDOW :], v[t - WINDOW :],
                                                     SCALE, CAP), rtol=1e-4, atol=1e-5)


def test_moe_gate_under_the_interpreter():
    rerun_under_interpreter(__file__)


@interpreter_only
@pytest.mark.parametrize("do_add", [False, True])
def test_moe_gate_equals_sglangs_kernel(do_add):
    from sglang.kernels.ops.elementwise import elementwise

    gen = torch.Generator().manual_seed(5)
    hidden, weight, shared, base = (torch.randn(*shape, generator=gen) for shape in
                                    ((7, 96), (96,), (7, 96), (7, 96)))
    theirs, ours = base.clone(), base.clone()
    elementwise._launch_fused_gate_sigmoid_mul(hidden, weight, shared, theirs, do_add=do_add)
    moe_gate.gate_sigmoid_mul(hidden, weight, shared, ours, do_add=do_add)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def _layer(layer_id: int = 0, **given) -> RadixAttention:
    return RadixAttention(Q_HEADS, DIM, SCALE, KV_HEADS, layer_id=layer_id, **given)


@pytest.mark.parametrize(("given", "words"), [
    ({"is_cross_attention": True}, "cross-attention layers"),
    ({"attn_type": AttentionType.ENCODER_ONLY}, "encoder_only attention layers"),
    ({"attn_type": AttentionType.DECODER_BIDIRECTIONAL}, "decoder_bidirectional attention"),
    ({"v_head_dim": DIM // 2}, "different key and value head sizes"),
    ({"use_irope": True}, "chunked local attention"),
    ({"pos_encoding_mode": "ROPE_LLAMA"}, "position encoding inside attention (ROPE_LLAMA)"),
    ({"logit_cap": CAP, "logit_capping_method": "clamp"}, "logit capping by 'clamp'"),
])
def test_a_layer_feature_vericache_does_not_serve_is_named(given, words):
    assert words in features._layer_refusal(_layer(**given))


@pytest.mark.parametrize("given", [{}, {"sliding_window_size": WINDOW}, {"logit_cap": CAP}])
def test_served_layer_features_are_not_refused(given):
    assert features._layer_refusal(_layer(**given)) is None


def test_a_windowed_or_capped_model_is_refused_off_the_device():
    """The host tier's streamed forwards serve full causal attention only."""
    model = torch.nn.ModuleList([_layer(0), _layer(1, sliding_window_size=WINDOW)])
    pool = _pool(layers=2)
    runner = SimpleNamespace(model=model, token_to_kv_pool=pool, model_config=SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["Gemma3ForCausalLM"]), attention_arch=None))
    assert features.refusal(runner, "device") is None
    assert features.refusal(runner, "host") == (
        "Gemma3ForCausalLM has sliding-window or softcapped attention with the full KV in host "
        "memory (use --vericache-full-tier device): VeriCache cannot serve it exactly")
    assert features.describe(model).windowed == (1,)


def test_a_position_dependent_temperature_is_refused():
    layer = _layer()
    layer.xai_temperature_len = 1024  # what SGLang's Grok sets after building the layer
    assert "position-dependent attention temperature" in features._layer_refusal(layer)


def _pool(layers: int = 1) -> MHATokenToKVPool:
    return MHATokenToKVPool(size=8, page_size=1, dtype=torch.float32, head_num=KV_HEADS,
                            head_dim=DIM, layer_num=layers, device="cpu",
                            enable_memory_saver=False)


def test_model_level_features_vericache_does_not_serve_are_named():
    from sglang.srt.configs.model_config import AttentionArch

    plain = torch.nn.ModuleList([_layer()])
    mha = SimpleNamespace(attention_arch=AttentionArch.MHA)
    assert features._model_refusal(plain, mha, _pool()) is None
    assert "multi-head latent attention" in features._model_refusal(
        plain, SimpleNamespace(attention_arch=AttentionArch.MLA), _pool())
    with_sinks = torch.nn.ModuleList([_layer()])
    with_sinks[0].sinks = torch.nn.Parameter(torch.zeros(Q_HEADS), requires_grad=False)
    assert features._model_refusal(with_sinks, mha, _pool()) == "attention sinks (gpt-oss)"

    class OtherPool(MHATokenToKVPool):
        """Any pool but SGLang's plain MHA pool (hybrid SWA, Mamba, ...)."""

    other = OtherPool(size=8, page_size=1, dtype=torch.float32, head_num=KV_HEADS, head_dim=DIM,
                      layer_num=1, device="cpu", enable_memory_saver=False)
    assert "the OtherPool KV pool" in features._model_refusal(plain, mha, other)
