"""`calibrate`: read the live servers' /metrics and keep what they measure in the state folder."""

from __future__ import annotations

from pathlib import Path

import typer

from fleetctl.cli import common
from fleetctl.cli.app import app
from fleetctl.cli.options import InventoryArg, JsonOpt, ProfilesOpt, StateDirOpt
from fleetctl.jsonout import print_json


@app.command()
def calibrate(
    inventory: str = InventoryArg,
    backends: Path | None = typer.Option(
        None,
        "--backends",
        metavar="FILE",
        help="YAML list of servers fleetctl did not launch (default: the state).",
    ),
    window: float = typer.Option(
        10.0,
        "--window",
        min=0.1,
        max=3600,
        metavar="SECONDS",
        help="How long to watch each server; its counters' changes over it are the samples.",
    ),
    interval: float = typer.Option(
        1.0,
        "--interval",
        min=0.05,
        metavar="SECONDS",
        help="Time between scrapes: each pair is one sample, at the batch size of its moment.",
    ),
    state_dir: Path | None = StateDirOpt,
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Measure KV capacity, decode step and prefill speed on the running servers."""
    from fleetctl.calibrate_io import refresh
    from fleetctl.router.backends import load_backends

    inv, catalog = common.load(inventory, profiles)
    sdir = common.state_dir(inv, state_dir)
    found = load_backends(inv, catalog, backends, sdir)
    done = refresh(sdir, found, window, interval)
    readings, fresh = done.readings, done.fresh
    failed = [r for r in readings if r.error is not None]
    if as_json:
        entries = []
        for e in fresh:
            j = e.to_json()
            j.pop("samples")
            entries.append(j)
        print_json(
            {
                "calibration": str(sdir.calibration_path),
                "servers": [r.to_json() for r in readings],
                "entries": entries,
            }
        )
    else:
        from fleetctl.render import calibration_table
        from fleetctl.text import plural

        console = common.console()
        console.print(calibration_table(readings))
        for r in failed:
            console.print(r.error, markup=False, highlight=False, soft_wrap=True)
        if fresh:
            console.print(
                f"Saved {plural(len(fresh), 'entry', 'entries')} to {sdir.calibration_path}."
            )
    if failed:
        raise typer.Exit(1)
