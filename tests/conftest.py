"""Shared test helpers: run the real CLI entry point in-process, and small inventories."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetctl.model.catalog import Catalog, load_catalog

REPO = Path(__file__).resolve().parent.parent
# Test files sit one folder down, by package: they name these, not their own folder's parents.
TESTS = REPO / "tests"
DATA = TESTS / "data"


class Result:
    def __init__(self, code: int, out: str, err: str):
        self.code, self.out, self.err = code, out, err


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--reverse-order",
        action="store_true",
        help="run the collected tests last to first: a test that leans on another's leftovers"
        " (a host it broke, a file it wrote) fails one way or the other",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--reverse-order"):
        items.reverse()


# Loggers that `fleetctl --debug` turns up in-process (fleetctl.cli.common.debug_logging).
DEBUG_LOGGERS = ("paramiko", "fleetctl.ssh")


@pytest.fixture(autouse=True)
def _loggers_restored() -> Iterator[None]:
    """Undo what an in-process `--debug` did to logging, so that it cannot leak paramiko's
    log into the output of every later test in this process (which then depend on order)."""
    saved = {
        n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers)) for n in DEBUG_LOGGERS
    }
    yield
    for name, (level, handlers) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = handlers


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


def seed_nodes() -> str:
    """The seed fleet's `nodes:` section as inventory/seed-mixed-8b.yaml writes it (4 A100
    SXM4 80GB nodes beside 8 RTX 4090 nodes), for tests that vary its models or prices."""
    text = (REPO / "inventory" / "seed-mixed-8b.yaml").read_text()
    start = text.index("nodes:\n")
    return text[start : text.index("\nmodels:", start) + 1]


def write(tmp_path: Path, text: str, name: str = "inventory.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def record_the_plan_as_applied(inv, serial: int = 1, servers: bool = True) -> None:
    """state.json beside `inv` as apply would leave it having started the plan (or, without
    `servers`, having destroyed it)."""
    from fleetctl.fleet.inventory import load_inventory
    from fleetctl.fleet.state import State
    from fleetctl.fleet.statedir import StateDir
    from fleetctl.model.catalog import load_catalog
    from fleetctl.planner import plan_fleet

    loaded = load_inventory(inv, load_catalog())
    deployments = plan_fleet(loaded).deployments if servers else ()
    StateDir(inv.parent / ".fleetctl").save_state(State(serial, deployments))
