"""Benchmarks write their results into a marked section of a docs page, and nothing else."""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    """The comments that open and close section `name` of a docs page."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_section(path: Path, name: str, body: str) -> None:
    """Rewrite what lies between section `name`'s markers in `path` with `body`."""
    begin, end = markers(name)
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path} has no {begin} ... {end} section")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}{body}{end}{tail}")
