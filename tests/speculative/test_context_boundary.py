"""Requests that end at the context length: SGLang reserves twice the verify width of KV slots
past each request's committed length at every decode step, and writes them into the request's
row of slot indices; near the context length that reservation used to overrun the row and
crash the server (issue 12). Plain SGLang answers these requests, and so must VeriCache, with
the same tokens, with the widest reservation the default bounds give (drafts up to 64).

Plain SGLang with the same --context-length 1024 is the reference (at the boundary SGLang
itself stops a request a few tokens short of the context, so the settings must match); it is
asked first and stopped, then the VeriCache server (4-bit KIVI, the default draft bounds).
The reservation's arithmetic does not depend on the compressor, so one server covers it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.identity import payload
from tests.support.servers import SERVER_ARGS, ServerSpec
from vericache_tools.prompts import stdlib_ids
from vericache_tools.server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

CONTEXT = 1024
# (prompt tokens, new tokens): each ends exactly at the context length, from inside the
# reservation's reach of the row end (its last 62 positions).
REQUESTS = [(CONTEXT - 40, 40), (CONTEXT - 12, 12), (CONTEXT - 100, 100)]


def _request(tokenizer, prompt_tokens: int, new_tokens: int) -> dict:
    ids = stdlib_ids(tokenizer, "argparse", prompt_tokens, start=300)
    return payload(ids, "code", max_new_tokens=new_tokens)


@pytest.fixture(scope="module")
def boundary_servers(demo_model: Path, servers) -> list[ServerProcess]:
    """Plain SGLang and VeriCache with a context of CONTEXT tokens, started side by side."""
    bounded = [*SERVER_ARGS, "--context-length", str(CONTEXT)]
    return servers(ServerSpec.of(demo_model, bounded, max_total_tokens=8192),
                   ServerSpec.of(demo_model, [*bounded, "--enable-vericache",
                                              "--vericache-compressor", "kivi:bits=4"],
                                 max_total_tokens=8192))


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
