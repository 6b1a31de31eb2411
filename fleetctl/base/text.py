"""Words for counts in messages: "1 model", "2 models", "1 change", "3 GPUs"."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """`n word`, with the plural form (`many`, else word + "s") unless n is 1."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


def rate(x: float) -> str:
    """A request rate as people read one: two decimals at most, no trailing zeros (20, 2.5,
    2.65), not the six digits `:g` keeps of a rate derived from a trace."""
    return f"{x:.2f}".rstrip("0").rstrip(".")
