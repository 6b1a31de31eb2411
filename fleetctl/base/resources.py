"""Where the bundled example inventories and profiles are, installed or in a source checkout."""

from __future__ import annotations

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
