"""What the commands share: loading the inventory, the console, the state folder, exit 3."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from fleetctl.cli.options import EXAMPLE_PREFIX

if TYPE_CHECKING:  # heavy imports wait for the command that needs them
    from fleetctl.fleet.inventory import Inventory
    from fleetctl.fleet.plan import Plan
    from fleetctl.fleet.statedir import StateDir
    from fleetctl.model.catalog import Catalog


def console() -> Any:
    from rich.console import Console

    # Piped output gets a wide page rather than rich's 80 columns, so tables stay on one line.
    wide = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
    return Console(width=wide)


def example_path(arg: str) -> Path:
    """The bundled example `arg` names (example:NAME), else `arg` as a path."""
    from fleetctl.base.errors import UserError
    from fleetctl.base.resources import examples

    if not arg.startswith(EXAMPLE_PREFIX):
        return Path(arg)
    name = arg[len(EXAMPLE_PREFIX) :]
    found = examples()
    if name not in found:
        raise UserError(f"no bundled example '{name}'", None, f"choose one of: {', '.join(found)}")
    return found[name]


def load(
    inventory: str, profiles: list[Path] | None, ssh: bool = False
) -> tuple[Inventory, Catalog]:
    """Load the inventory; `ssh`: this command connects, so its key files must exist."""
    from fleetctl.fleet.inventory import load_inventory
    from fleetctl.model.catalog import load_catalog

    catalog = load_catalog(profiles)
    inv = load_inventory(example_path(inventory), catalog)
    if ssh:
        refuse_bundled_example(inv.path)
        inv.check_ssh_files()
    return inv, catalog


def refuse_bundled_example(path: Path) -> None:
    """A command that connects refuses a bundled example before any connection: its hosts and
    ssh settings are samples (some have no identity_file, so nothing else would stop it), and
    its file sits inside the package, where an edit is lost on upgrade. A saved plan of one
    names the bundled file, so the path is what is checked, not the example:NAME spelling."""
    from fleetctl.base.errors import UserError
    from fleetctl.base.resources import examples

    name = next((n for n, p in examples().items() if p.resolve() == path.resolve()), None)
    if name is None:
        return
    raise UserError(
        f"{EXAMPLE_PREFIX}{name} is a bundled example: its hosts and ssh settings are samples, "
        "so fleetctl does not connect to them",
        None,
        f"run `fleetctl examples copy {name}`, then edit the copy's hosts and ssh settings "
        f"and use {name}.yaml instead",
    )


def state_dir(inv: Inventory, override: Path | None) -> StateDir:
    from fleetctl.fleet.statedir import StateDir

    return StateDir.of(inv, override)


def exit_if_incomplete(result: Plan) -> None:
    """Exit 3 when a model could not be placed: the plan is valid, but not all of it."""
    if not result.unplaced:
        return
    from fleetctl.base.text import plural

    names = ", ".join(u.model for u in result.unplaced)
    sys.stderr.write(
        f"plan incomplete: {plural(len(result.unplaced), 'model')} could not be placed "
        f"({names}); the rest of the plan is valid (exit code 3)\n"
    )
    raise typer.Exit(3)


def unchecked(out: Any, lines: list[str], total: int, verb: str = "check") -> None:
    """One line per node that could not be reached, then how many: unwrapped, no markup."""
    from fleetctl.base.text import plural

    for line in lines:
        out.print(line, style="red", markup=False, highlight=False, soft_wrap=True)
    if lines:
        out.print(f"could not {verb} {len(lines)} of {plural(total, 'node')}", style="red")


class _Stderr:
    """A logging stream that is whatever sys.stderr is at the time (tests swap it)."""

    def write(self, text: str) -> None:
        sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def debug_logging() -> None:
    """--debug: paramiko's own log and each SSH failure's traceback go to stderr.

    Without it they stay quiet (fleetctl.fleet.ssh silences paramiko): one line per node is enough.
    """
    import logging

    for name in ("paramiko", "fleetctl.ssh"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        if not any(getattr(h, "fleetctl_debug", False) for h in logger.handlers):
            handler = logging.StreamHandler(_Stderr())
            handler.setFormatter(logging.Formatter("debug: %(name)s: %(message)s"))
            handler.fleetctl_debug = True  # type: ignore[attr-defined]
            logger.addHandler(handler)
