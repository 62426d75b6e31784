"""The docs stay in step with the code: docs/options.md is what `vericache_tools/gen_options.py`
makes of the flag group, the README stays short with its quick start intact, and docs/index.md
lists every page. No server, no model: seconds."""

from __future__ import annotations

import re
from pathlib import Path

from vericache_tools import gen_options

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

QUICK_START = (
    "./setup.sh && .venv/bin/python -m vericache_sglang.demo",
    "./setup.sh && .venv/bin/python -m pytest -q",
)


def test_options_page_is_generated_from_the_flags():
    expected = gen_options.render()
    actual = gen_options.OPTIONS_MD.read_text()
    assert actual == expected, (
        "docs/options.md is not what the VeriCache flags (vericache_sglang/config.py) give: "
        f"run `{gen_options.COMMAND}` from the repository root")


def test_options_page_lists_every_flag():
    text = gen_options.render()
    for name in gen_options.VeriCacheConfig.__dataclass_fields__:
        flag = "--" + name.replace("_", "-")
        assert f"| `{flag}` |" in text, flag


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def test_readme_is_short_and_keeps_the_quick_start():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines: move detail into docs/"
    long = [f"line {n}: {len(line)} characters" for n, line in _prose_lines(text)
            if len(line) > 200]
    assert not long, "README.md prose lines over 200 characters: " + "; ".join(long)
    for command in QUICK_START:
        assert command in lines, f"README.md lost its quick-start command: {command}"


def test_docs_index_lists_every_page():
    index = (DOCS / "index.md").read_text()
    linked = set(re.findall(r"\]\(([^)#\s]+)", index))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert not pages - linked, f"docs/index.md does not list: {sorted(pages - linked)}"
    for folder in (p for p in DOCS.iterdir() if p.is_dir()):
        assert f"{folder.name}/" in linked, f"docs/index.md does not describe docs/{folder.name}/"
    assert "docs/index.md" in README.read_text()
