"""Constrained decoding on each SGLang grammar backend that can roll a grammar back.

A round advances each request's grammar over its drafts and rolls it back before
verification (`vericache_sglang/speculative/grammar.py`). xgrammar, SGLang's default, is what
test_identity.py's constrained tests run on; here llguidance, against plain SGLang on the
same backend (backends compile a schema to different token masks, so each is compared with
itself), under the n-gram drafter: its rounds check proposals under each position's mask. The
pair is shared with test_context_boundary.py (`tests/support/servers.py: VARIANT_ARGS`: a
context of 1,024 tokens, which these requests end well inside; 64 drafts a round).
The masks of single-level drafting (no drafter, one token per forward) are compared with the
proposal path's on both backends in test_grammar.py, which saves CI a server start here.
outlines has no rollback and is refused at startup (test_cli.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.identity import (
    CONSTRAINED_PROMPT,
    CONSTRAINTS,
    levels,
    payload,
    send_all,
    stats,
)
from tests.support.servers import variant_specs
from vericache_tools.server_process import ServerProcess

SHARES_SERVERS_WITH = "variant"
"""Runs next to the other module on this pair (tests/support/servers.py: VARIANT_ARGS), so the
pair starts once (tests/conftest.py orders the modules)."""
pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def llguidance_servers(demo_model: Path, servers) -> list[ServerProcess]:
    """Plain SGLang and VeriCache on llguidance, started side by side."""
    return servers(*variant_specs(demo_model))


def test_llguidance_grammars_draft_and_equal_plain(llguidance_servers, tokenizer):
    """A JSON schema and a regex, in one batch: plain SGLang's tokens under llguidance, and
    each request drafted (so its grammar was advanced over drafts and rolled back), over
    proposals its masks checked (a forbidden proposal never reaches llguidance's matcher,
    which cannot recover from one)."""
    batch = [payload(CONSTRAINED_PROMPT(tokenizer), "chat", max_new_tokens=40, **constraint)
             for constraint in CONSTRAINTS.values()]
    plain, vericache = llguidance_servers
    expected = send_all(plain, batch)
    got = send_all(vericache, batch)
    for name, want, out in zip(CONSTRAINTS, expected, got, strict=True):
        assert out["output_ids"] == want["output_ids"], name
        assert out["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], name
        rounds, drafted, _ = stats(out)
        assert drafted > 0 and rounds < len(out["output_ids"]), name
    assert sum(levels(out)[1] for out in got) > 0
