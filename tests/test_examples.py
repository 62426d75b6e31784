"""The client examples (examples/) give the same answers on a VeriCache server as on plain
SGLang: the SGLang frontend program, streaming chat through the `openai` client, tool calling,
the agent loop and document question answering, each run against the session's two servers.
Where the API returns token ids (chat completions with `return_token_ids`), they are compared
too; VeriCache drafted for every example (its drafted-tokens counter moved)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from examples import agent_loop, document_qa, frontend_program, openai_chat, tool_call
from tests.support.identity import vericache_metrics
from vericache_tools.prompts import stdlib_source

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[1]
DOCUMENT_CHARS = 9000  # about 2,400 tokens of textwrap.py

EXAMPLES: dict[str, Callable[[str], object]] = {
    "frontend_program": frontend_program.run,
    "openai_chat": lambda url: openai_chat.run(url, max_tokens=64),
    "tool_call": tool_call.run,
    "agent_loop": lambda url: agent_loop.run(url, turns=2),
    "document_qa": lambda url: document_qa.run(
        url, stdlib_source("textwrap")[:DOCUMENT_CHARS], "What does dedent do?",
        max_tokens=48),
}


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_answers_as_plain_sglang(name, plain_server, vericache_server):
    run = EXAMPLES[name]
    before = vericache_metrics(vericache_server)["vericache:drafted_tokens_total"]
    got = run(vericache_server.url)
    drafted = vericache_metrics(vericache_server)["vericache:drafted_tokens_total"] - before
    assert got == run(plain_server.url)
    assert got, name
    assert drafted > 0


def test_an_example_runs_as_the_readme_shows(vericache_server, tmp_path):
    """One command, as README.md gives it: document QA over a file the user names."""
    document = tmp_path / "notes.md"
    document.write_text(stdlib_source("textwrap")[:4000])
    done = subprocess.run(
        [sys.executable, "-m", "examples.document_qa", "--url", vericache_server.url,
         "--file", str(document), "--question", "What is the module for?"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()
    missing = subprocess.run(
        [sys.executable, "-m", "examples.document_qa", "--url", vericache_server.url,
         "--file", str(tmp_path / "absent.txt"), "--question", "?"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert missing.returncode == 2 and "cannot read" in missing.stderr.splitlines()[-1]
