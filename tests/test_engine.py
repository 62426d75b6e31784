"""The VeriCache settings work from `sglang.Engine(...)` as they do from the launcher."""

from __future__ import annotations

import pytest

from vericache_sglang.config import VeriCacheConfigError

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("no_idle_servers")]


def test_engine_accepts_vericache_keyword_arguments(demo_model, hf_reference):
    import sglang

    engine = sglang.Engine(
        model_path=str(demo_model), dtype="float32", max_total_tokens=8192, sleep_on_idle=True,
        enable_vericache=True, vericache_draft_length=12, vericache_compressor="kivi:bits=8",
        vericache_full_tier="device",
    )
    try:
        info = engine.get_server_info()["vericache"]
        assert info["enable_vericache"] is True
        assert info["vericache_draft_length"] == 12
        assert "bits=8" in info["vericache_compressor"]
        # The full KV stays in SGLang's device pool, beside the compressed pool.
        assert info["vericache_full_tier"] == "device"
        assert info["memory"]["full_tier"] == "device"
        # torch_native, the CPU's backend, has no verify path: VeriCache's extension verifies
        assert info["memory"]["verify_backend"] == "VerifyAttnBackend"
        ids = hf_reference.tokenizer("class Stack:\n    def __init__(self):")["input_ids"]
        out = engine.generate(input_ids=ids, sampling_params={
            "temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
        assert out["output_ids"] == hf_reference(ids, 24)
    finally:
        engine.shutdown()
        # The Engine published its server arguments in this (the test) process; later tests
        # ask what this process serves (SGLang's own teardown).
        from sglang.srt.runtime_context import reset_context

        reset_context()


def test_engine_refuses_bad_vericache_values(demo_model):
    import sglang

    with pytest.raises(VeriCacheConfigError, match="--vericache-draft-length must be a positive"):
        sglang.Engine(model_path=str(demo_model), enable_vericache=True, vericache_draft_length=0)
