"""Markdown tables, as every benchmark prints them and writes them into docs."""

from __future__ import annotations


def row(cells: list[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(header: list[str], rows: list[list[object]], align: str = "") -> str:
    """A header, its rule (`align` per column: "r" right-aligned, anything else left) and rows."""
    rule = "|" + "".join("---:|" if align[i:i + 1] == "r" else "---|"
                         for i in range(len(header)))
    return "\n".join([row(header), rule, *(row(r) for r in rows)])
