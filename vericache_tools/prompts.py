"""Real long prompts for the demo, the tests and the benchmarks: text nobody here wrote.

Two sources, both on every machine that runs Python on Debian/Ubuntu: the Python standard
library's sources (by module name, or by file name under the stdlib directory) and the licence
texts in /usr/share/common-licenses. Prompts are token slices of such a text; asking for more
tokens than the text has is an error, never a silently shorter prompt.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sysconfig
from pathlib import Path

STDLIB_DIR = Path(sysconfig.get_paths()["stdlib"])
"""The running interpreter's standard library sources."""

LICENSES_DIR = Path("/usr/share/common-licenses")
"""Debian's common licence texts (GPL-3, Apache-2.0, ...)."""


class PromptTooShortError(ValueError):
    """The text has fewer tokens than the prompt asks for."""


def stdlib_source(module: str) -> str:
    """The source of a standard library module by import name ("textwrap", "json.decoder")."""
    return inspect.getsource(importlib.import_module(module))


def find_file(name: str | os.PathLike[str]) -> Path:
    """A prompt file: an absolute path as given, else `name` under the standard library
    directory ("textwrap.py", "json/decoder.py"), else under the common licences ("GPL-3")."""
    path = Path(name)
    if path.is_absolute():
        return path
    for folder in (STDLIB_DIR, LICENSES_DIR):
        if (folder / path).is_file():
            return folder / path
    raise FileNotFoundError(f"{name}: not an absolute path, nor a file in {STDLIB_DIR} or "
                            f"{LICENSES_DIR}")


def read_file(name: str | os.PathLike[str]) -> str:
    """The text of `find_file(name)`."""
    return find_file(name).read_text(encoding="utf-8")


def token_ids(tokenizer, text: str, tokens: int, *, start: int = 0,
              source: str = "the text") -> list[int]:
    """Tokens start..start+tokens of `text` as `tokenizer(text)` encodes it whole; raises
    PromptTooShortError (naming `source`) when the text has fewer."""
    ids = tokenizer(text)["input_ids"]
    if len(ids) < start + tokens:
        raise PromptTooShortError(
            f"{source} has {len(ids)} tokens; a {tokens}-token prompt from token {start} "
            f"needs {start + tokens}")
    return ids[start : start + tokens]


def stdlib_ids(tokenizer, module: str, tokens: int, *, start: int = 0) -> list[int]:
    """`token_ids` of a standard library module's source, by import name."""
    return token_ids(tokenizer, stdlib_source(module), tokens, start=start,
                     source=f"the source of {module}")


def file_ids(tokenizer, name: str | os.PathLike[str], tokens: int, *,
             start: int = 0) -> list[int]:
    """`token_ids` of a prompt file (`find_file` names)."""
    path = find_file(name)
    return token_ids(tokenizer, path.read_text(encoding="utf-8"), tokens, start=start,
                     source=str(path))


def parse_file_tokens(entry: str) -> tuple[str, int]:
    """A `FILE:TOKENS` command-line prompt -> (FILE, TOKENS)."""
    name, sep, tokens = entry.rpartition(":")
    if not sep or not name or not tokens.isdigit() or int(tokens) < 1:
        raise ValueError(f"prompt must be FILE:TOKENS (TOKENS >= 1), got {entry!r}")
    return name, int(tokens)


def file_prompt(tokenizer, entry: str) -> tuple[str, list[int]]:
    """A `FILE:TOKENS` prompt's label ("textwrap.py[:2048]") and token ids: the first TOKENS
    tokens of `find_file(FILE)`."""
    name, tokens = parse_file_tokens(entry)
    ids = file_ids(tokenizer, name, tokens)
    return f"{find_file(name).name}[:{tokens}]", ids
