"""Requests that end at the context length: SGLang reserves twice the verify width of KV slots
past each request's committed length at every decode step, and writes them into the request's
row of slot indices; near the context length that reservation used to overrun the row and
crash the server (issue 12). Plain SGLang answers these requests, and so must VeriCache, with
the same tokens.

Plain SGLang with the same --context-length 1024 is the reference (at the boundary SGLang
itself stops a request a few tokens short of the context, so the settings must match). The pair
is shared with test_grammar_backends.py (`tests/support/servers.py: VARIANT_ARGS`): VeriCache
with 4-bit KIVI drafting 64 tokens every round, the widest reservation the default bounds
give. The reservation's arithmetic does not depend on the compressor, so one server covers it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.identity import payload
from tests.support.servers import VARIANT_CONTEXT, variant_specs
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_process import ServerProcess

SHARES_SERVERS_WITH = "variant"
"""Runs next to the other module on this pair (tests/support/servers.py: VARIANT_ARGS), so the
pair starts once (tests/conftest.py orders the modules)."""
pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

CONTEXT = VARIANT_CONTEXT
# (prompt tokens, new tokens): each ends exactly at the context length, from inside the
# reservation's reach of the row end (its last 62 positions).
REQUESTS = [(CONTEXT - 40, 40), (CONTEXT - 12, 12), (CONTEXT - 100, 100)]


def _request(tokenizer, prompt_tokens: int, new_tokens: int) -> dict:
    ids = stdlib_ids(tokenizer, "argparse", prompt_tokens, start=300)
    return payload(ids, "code", max_new_tokens=new_tokens)


@pytest.fixture(scope="module")
def boundary_servers(demo_model: Path, servers) -> list[ServerProcess]:
    """Plain SGLang and VeriCache with a context of CONTEXT tokens, started side by side."""
    return servers(*variant_specs(demo_model))


@pytest.fixture(scope="module")
def plain_answers(boundary_servers, tokenizer) -> list[list[int]]:
    return [boundary_servers[0].generate(_request(tokenizer, *r))["output_ids"]
            for r in REQUESTS]


@pytest.fixture(scope="module")
def boundary_server(boundary_servers) -> ServerProcess:
    return boundary_servers[1]


def test_requests_ending_at_the_context_length(plain_answers, boundary_server, tokenizer):
    for (prompt_tokens, new_tokens), expected in zip(REQUESTS, plain_answers, strict=True):
        got = boundary_server.generate(_request(tokenizer, prompt_tokens, new_tokens))
        assert got["output_ids"] == expected, prompt_tokens
    assert boundary_server.proc.poll() is None  # still serving
