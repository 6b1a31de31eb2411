"""Where the bundled example inventories and profiles are, installed or in a source checkout."""

from __future__ import annotations

import re
from pathlib import Path

_PKG = Path(__file__).resolve().parent.parent  # fleetctl/, above base/


def bundled(name: str) -> Path:
    """The bundled data folder `name` ("inventory" or "profiles")."""
    inside = _PKG / "_bundled" / name  # a built wheel carries it here
    if inside.is_dir():
        return inside
    return _PKG.parent / name  # a source checkout or an editable install


def examples() -> dict[str, Path]:
    """Bundled example inventories by name (file stem)."""
    folder = bundled("inventory")
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def example_description(path: Path) -> str:
    """An example's first sentence, from the comment block that opens its file: whole, over
    as many comment lines as it runs, since a line's end is not a sentence's."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    text = " ".join(x for x in lines if x)
    end = _SENTENCE_END.search(text)
    return text[: end.end()] if end else text
