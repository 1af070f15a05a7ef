"""The text tables the benchmarks print: left-aligned columns two spaces apart, no trailing blanks."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """`header` then `rows`, one line each, every column as wide as its widest cell."""
    lines = [list(header), *(list(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )
