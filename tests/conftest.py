"""Shared test helpers: run the real CLI entry point in-process, and small inventories."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fleetctl.catalog import Catalog, load_catalog

REPO = Path(__file__).resolve().parent.parent


class Result:
    def __init__(self, code: int, out: str, err: str):
        self.code, self.out, self.err = code, out, err


@pytest.fixture
def cli(capsys, monkeypatch):
    """Call fleetctl's `main()` (with its error boundary) as the console script would."""
    from fleetctl.cli import main

    def run(*args: str) -> Result:
        monkeypatch.setattr(sys, "argv", ["fleetctl", *map(str, args)])
        monkeypatch.setenv("COLUMNS", "200")
        code = 0
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


@pytest.fixture(scope="session")
def catalog() -> Catalog:
    return load_catalog()


def write(tmp_path: Path, text: str, name: str = "inventory.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p
