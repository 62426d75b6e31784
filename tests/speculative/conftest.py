"""Fixtures of the drafting tests: the tokenizer, the real prompts, plain SGLang's answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.identity import LONG, PROMPTS, send_all


@pytest.fixture(scope="session")
def tokenizer(demo_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> dict[str, list[int]]:
    ids = {name: make(tokenizer) for name, make in PROMPTS.items()}
    assert len(LONG) >= 4 and all(2000 <= len(ids[n]) <= 6000 for n in LONG)
    return ids


class PlainAnswers:
    """Plain SGLang's response to each /generate payload, asked once and remembered, so the
    VeriCache configurations are compared with the same reference answers."""

    def __init__(self, server) -> None:
        self.server = server
        self._cache: dict[str, dict] = {}

    def __call__(self, payload: dict) -> dict:
        return self.all([payload])[0]

    def all(self, payloads: list[dict]) -> list[dict]:
        """Answers to several payloads; the new ones are sent together, as one batch."""
        keys = [json.dumps(p, sort_keys=True) for p in payloads]
        new = {key: p for key, p in zip(keys, payloads, strict=True) if key not in self._cache}
        if new:
            self._cache.update(zip(new, send_all(self.server, list(new.values())), strict=True))
        return [self._cache[key] for key in keys]


@pytest.fixture(scope="session")
def plain(plain_server) -> PlainAnswers:
    return PlainAnswers(plain_server)
