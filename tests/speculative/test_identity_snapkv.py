"""Lossless with a token-dropping tier and a short fixed draft length: SnapKV keeping 25 % of
the tokens, 8 drafts per round, many of them rejected, under the n-gram drafter proposing up
to 4 tokens (VeriCache's default drafter without a draft model). Same prompts and checks as
the 4-bit KIVI configuration in test_identity.py (on eight of its twelve prompts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.identity import assert_batch_identical, levels, payload, stats
from tests.support.servers import SERVER_ARGS, ServerSpec
from vericache_tools.server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def snapkv_server(demo_model: Path, servers) -> ServerProcess:
    return servers(ServerSpec.of(demo_model, [
        *SERVER_ARGS, "--enable-vericache", "--vericache-compressor", "snapkv:ratio=0.25",
        "--vericache-draft-length", "8", "--vericache-min-draft-length", "8",
        "--vericache-max-draft-length", "8", "--vericache-drafter-max-length", "4",
    ]))[0]


# Eight of the twelve prompts (two of the four long ones; argparse_2300 runs alone below): the
# token-dropping path, with its prompt scores recorded through the host tier's prefill, in a
# batch whose requests join and leave; plain SGLang's answers are those test_identity.py got.
BATCH = ["textwrap_2000", "chat_json_decoder_2100", "heapq_400", "bisect_300", "csv_700",
         "fibonacci", "chat_palindrome", "chat_fnmatch"]


def test_eight_real_prompts_in_one_batch(snapkv_server, plain, prompt_ids):
    got = assert_batch_identical(snapkv_server, plain, {name: prompt_ids[name] for name in BATCH},
                                 "snapkv:ratio=0.25, k=8 + ngram")
    assert sum(levels(out)[2] for out in got) > 0  # the drafter's proposals were kept


def test_one_long_request_alone(snapkv_server, plain, prompt_ids):
    """Alone in the batch: at most 8 drafts per round, some rejected, and the statistics add
    up (each round emits its accepted drafts plus one token; the first token is prefill's)."""
    request = payload(prompt_ids["argparse_2300"], "code")
    out = snapkv_server.generate(request)
    assert out["output_ids"] == plain(request)["output_ids"]
    rounds, drafted, accepted = stats(out)
    assert accepted < drafted <= 8 * rounds
    assert len(out["output_ids"]) == 1 + accepted + rounds
    assert sum(out["meta_info"]["spec_correct_drafts_histogram"]) == rounds
