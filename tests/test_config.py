"""VeriCache's settings: defaults, conversion from CLI strings and Python values, and one clear
message per invalid value."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.support.servers import vericache_server_args
from vericache_sglang.config import VeriCacheConfig, VeriCacheConfigError, parse_size
from vericache_sglang.speculative import algorithm
from vericache_sglang.speculative.drafter import DRAFT_VOCAB_FILE, check_draft_model


@pytest.mark.parametrize(("text", "expected"), [
    ("1000000", 1_000_000),
    ("512MB", 512 * 1000**2),
    ("512M", 512 * 1000**2),
    ("8GiB", 8 * 1024**3),
    ("8gi", 8 * 1024**3),
    ("1.5G", 1_500_000_000),
    ("64 KiB", 64 * 1024),
    ("2T", 2 * 1000**4),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "8 parsecs", "-1G", "G", "1.2.3M"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_defaults_without_flags():
    config = VeriCacheConfig.build({})
    assert config.enable_vericache is False
    assert config.vericache_full_tier == "auto"
    assert config.vericache_draft_length == 16
    assert config.vericache_max_draft_length == 64
    assert config.vericache_store_timeout == 30.0


def test_cli_strings_are_converted():
    config = VeriCacheConfig.build({
        "enable_vericache": True,
        "vericache_draft_length": "32",
        "vericache_full_tier": "device",
    })
    assert config.vericache_draft_length == 32
    assert config.vericache_full_tier == "device"


def test_the_disk_tier_is_a_host_placement_with_a_directory():
    config = VeriCacheConfig.build({"enable_vericache": True, "vericache_full_tier": "disk",
                                    "vericache_full_tier_budget": "1GiB",
                                    "vericache_disk_dir": "/srv/kv"})
    assert config.host_placement and config.vericache_disk_dir == "/srv/kv"
    assert not VeriCacheConfig.build({"enable_vericache": True,
                                      "vericache_full_tier": "device"}).host_placement


def test_engine_values_are_accepted():
    config = VeriCacheConfig.build({"enable_vericache": True, "vericache_draft_length": 24})
    assert config.vericache_draft_length == 24


def test_size_parsing_for_budgets():
    assert parse_size("4GiB") == 4 * 1024**3
    assert parse_size("512MB") == 512 * 1000**2


@pytest.mark.parametrize(("values", "message"), [
    ({"vericache_draft_length": "0"}, "--vericache-draft-length must be a positive integer"),
    ({"vericache_draft_length": -3}, "--vericache-draft-length must be a positive integer"),
    ({"vericache_draft_length": "many"}, "--vericache-draft-length"),
    ({"vericache_draft_length": 2.5}, "--vericache-draft-length"),
    ({"vericache_max_draft_length": "8"}, "min-draft-length <= --vericache-draft-length"),
    ({"vericache_full_tier": "cloud"},
     "--vericache-full-tier must be one of auto, device, host, disk"),
    ({"vericache_full_tier_budget": "lots"}, "--vericache-full-tier-budget: 'lots' is not a size"),
    ({"vericache_disk_dir": "/srv/kv"}, "--vericache-disk-dir places the disk tier"),
    ({"vericache_draft_length": 10000, "vericache_max_draft_length": 10000},
     "--vericache-max-draft-length must be at most 256"),
    ({"vericache_full_tier": "device", "vericache_full_tier_budget": "4GiB"},
     "--vericache-full-tier-budget sizes the host placement"),
    ({"vericache_full_tier": "device", "vericache_staging_budget": "64MiB"},
     "--vericache-staging-budget sizes the host placement"),
    ({"vericache_compressor": "zip:level=3"}, "--vericache-compressor: .*zip"),
    ({"vericache_store_codec_processes": -1},
     "--vericache-store-codec-processes must be 0 .one per CPU core. or more, got -1"),
    ({"vericache_store_timeout": 0},
     "--vericache-store-timeout must be a positive number of seconds, got 0"),
    ({"vericache_store_timeout": "-5"},
     "--vericache-store-timeout must be a positive number of seconds, got -5"),
    ({"vericache_store_timeout": "inf"},
     "--vericache-store-timeout must be a positive number of seconds, got inf"),
    ({"vericache_store_timeout": "soon"}, "--vericache-store-timeout: 'soon' is not a number"),
    ({"vericache_drafter": "eagle"}, "--vericache-drafter must be one of auto, none, ngram, model"),
    ({"vericache_drafter": "model"}, "--vericache-drafter model needs --vericache-draft-model"),
    ({"vericache_draft_model": "/nonexistent/draft"}, "/nonexistent/draft is not a model dir"),
    ({"vericache_drafter": "ngram", "vericache_draft_model": "/srv/draft"},
     "cannot be combined with --vericache-drafter ngram"),
    ({"vericache_drafter": "ngram", "vericache_drafter_max_length": 64},
     "--vericache-drafter-max-length <= 32"),
    ({"vericache_drafter": "ngram", "vericache_drafter_min_length": 4,
      "vericache_drafter_max_length": 2}, "1 <= --vericache-drafter-min-length"),
    ({"vericache_drafter": "none", "vericache_drafter_max_length": 4},
     "they do nothing with --vericache-drafter none"),
    ({"vericache_early_drafting": True, "vericache_drafting_deadline": -1},
     "--vericache-drafting-deadline must be 0 or more seconds, got -1"),
    ({"vericache_early_drafting": True, "vericache_drafting_deadline": "soon"},
     "--vericache-drafting-deadline: 'soon' is not a number"),
    ({"vericache_drafting_deadline": 0.5},
     "it does nothing without --vericache-early-drafting"),
])
def test_invalid_values_raise_one_clear_error(values, message):
    with pytest.raises(VeriCacheConfigError, match=message) as info:
        VeriCacheConfig.build({"enable_vericache": True, **values})
    assert "\n" not in str(info.value)


def test_options_without_enable_are_refused():
    with pytest.raises(VeriCacheConfigError, match="given without --enable-vericache"):
        VeriCacheConfig.build({"vericache_draft_length": 8})


def test_a_draft_model_selects_the_model_drafter(demo_models):
    config = VeriCacheConfig.build({"enable_vericache": True,
                                    "vericache_draft_model": str(demo_models.draft)})
    assert config.vericache_drafter == "model"


def test_a_draft_model_must_share_the_target_tokenizer(demo_models, tmp_path):
    """Same vocabulary: accepted. Two tokens' ids swapped in the draft's tokenizer: refused,
    since its proposals would read as other tokens."""
    check_draft_model(str(demo_models.draft), str(demo_models.target))
    shutil.copytree(demo_models.draft, tmp_path / "draft")
    path = tmp_path / "draft" / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["def"], vocab["class"] = vocab["class"], vocab["def"]
    path.write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        check_draft_model(str(tmp_path / "draft"), str(demo_models.target))


@pytest.mark.parametrize("text", [
    "not json", '{"ids": [1, 2]}', '{"token_ids": []}', '{"token_ids": [5, 5]}',
    '{"token_ids": [1, 49152]}', '{"token_ids": [-1]}', '{"token_ids": ["def"]}',
])
def test_a_broken_draft_vocabulary_is_refused(demo_models, tmp_path, text):
    shutil.copytree(demo_models.draft, tmp_path / "draft")
    (tmp_path / "draft" / DRAFT_VOCAB_FILE).write_text(text)
    with pytest.raises(ValueError, match=DRAFT_VOCAB_FILE) as info:
        check_draft_model(str(tmp_path / "draft"), str(demo_models.target))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("given", "message"), [
    ({"speculative_num_draft_tokens": 8}, "--speculative-num-draft-tokens cannot be combined"),
    ({"speculative_eagle_topk": 4}, "--speculative-eagle-topk cannot be combined"),
    ({"enable_mixed_chunk": True}, "--enable-mixed-chunk cannot be combined"),
    ({"kv_cache_dtype": "fp8_e4m3"},
     "--kv-cache-dtype fp8_e4m3 with --enable-vericache is not supported yet"),
    ({"grammar_backend": "outlines"}, "--grammar-backend outlines cannot be combined"),
    ({"context_length": 64}, "leaves no room in --context-length 64"),
    ({"speculative_algorithm": "EAGLE"}, "--enable-vericache replaces speculative decoding"),
    ({"tp_size": 2}, "--tp-size 2 with --enable-vericache is not supported yet"),
    ({"pp_size": 2}, "--pp-size 2 with --enable-vericache is not supported yet"),
])
def test_sglang_settings_vericache_cannot_honour_are_refused(given, message):
    """What SGLang's own flags ask for and VeriCache would have to override: one line, at
    startup (test_cli.py shows such a line reaching the user from a real launch)."""
    args = vericache_server_args(**given)
    with pytest.raises(SystemExit, match=f"^vericache: error: .*{message}") as info:
        algorithm.configure(args)
    assert "\n" not in str(info.value)
    assert args.speculative_algorithm == given.get("speculative_algorithm")  # nothing set


def test_sglang_declares_the_settings_vericache_implies(demo_model):
    """SGLang's own resolution switches to VERICACHE and runs its `handle_server_args`, and
    records what it sets as that algorithm's declarations, not as the user's input."""
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.plugins import load_plugins

    load_plugins()  # the plugin's flags and hooks (idempotent)
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", str(demo_model), "--enable-vericache",
                                "--vericache-max-draft-length", "32"])
    args.resolve_once()  # what the launcher and Engine do before publishing
    declared = {name: value for source, fields in args._resolved_overrides
                if source == "handle_speculative_decoding.custom_algo"
                for name, value in fields.items()}
    assert declared == {"speculative_num_draft_tokens": 33, "speculative_num_steps": 32,
                        "speculative_eagle_topk": 1, "disable_overlap_schedule": True,
                        "decode_log_interval": 1}
    assert args._raw_input["disable_overlap_schedule"] is False  # the user's, untouched
    resolved = resolved_view(args)  # what SGLang projects onto the published record
    assert (resolved.speculative_algorithm, resolved.speculative_num_draft_tokens,
            resolved.speculative_num_steps, resolved.disable_overlap_schedule,
            resolved.decode_log_interval) == (algorithm.ALGORITHM, 33, 32, True, 1)
