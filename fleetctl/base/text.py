"""Words for counts in messages: "1 model", "2 models", "1 change", "3 GPUs"."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """`n word`, with the plural form (`many`, else word + "s") unless n is 1."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"
