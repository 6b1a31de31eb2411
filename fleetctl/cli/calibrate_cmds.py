"""`calibrate`: read the live servers' /metrics and keep what they measure in the state folder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from fleetctl.base.jsonout import print_json
from fleetctl.cli import common
from fleetctl.cli.app import app
from fleetctl.cli.options import InventoryArg, JsonOpt, ProfilesOpt, StateDirOpt

if TYPE_CHECKING:
    from fleetctl.model.calibration import Entry
    from fleetctl.routing.types import Backend


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
    from fleetctl.apply.calibrate import refresh
    from fleetctl.base.progress import progress
    from fleetctl.daemon.backends import load_backends

    inv, catalog = common.load(inventory, profiles)
    sdir = common.state_dir(inv, state_dir)
    found = load_backends(inv, catalog, backends, sdir)
    label = f"watching {len(found)} server(s)"
    with progress(label, window, enabled=not as_json) as bar:

        def tell(left: float, samples: int) -> None:
            bar.update(window - left, f"{label}: {left:.0f} s left, {samples} samples")

        done = refresh(sdir, found, window, interval, need_traffic=True, on_progress=tell)
    readings, fresh = done.readings, done.fresh
    failed = [r for r in readings if r.error is not None]
    uses = {e.key: used_as(e, found) for e in fresh}
    if as_json:
        entries = []
        for e in fresh:
            j = e.to_json()
            j.pop("samples")
            j["used_as"] = uses[e.key]
            entries.append(j)
        print_json(
            {
                "calibration": str(sdir.calibration_path),
                "servers": [r.to_json() for r in readings],
                "entries": entries,
            }
        )
    else:
        from fleetctl.base.text import plural
        from fleetctl.cli.render import calibration_table

        console = common.console()
        console.print(calibration_table(readings))
        for r in failed:
            console.print(r.error, markup=False, highlight=False, soft_wrap=True)
        for e in fresh:
            if uses[e.key]:
                said = "; ".join(f"{k} {v}" for k, v in uses[e.key].items())
                console.print(f"{e.key.text}: {said}", markup=False, highlight=False)
        if fresh:
            console.print(
                f"Saved {plural(len(fresh), 'entry', 'entries')} to {sdir.calibration_path}."
            )
    if failed:
        raise typer.Exit(1)


def used_as(entry: Entry, backends: list[Backend]) -> dict[str, str]:
    """How every command will use `entry`: per figure, measured, scaled from a measurement,
    or still the model's (the batch sizes seen too alike, a figure not trusted); empty when no
    server of its class has a model to scale."""
    from fleetctl.model.calibration import Calibration, calibrated

    k = entry.key
    for b in backends:
        p = b.perf
        if p is not None and (b.gpu_type, p.model.name, b.variant, p.tp) == (
            k.gpu,
            k.model,
            k.format,
            k.tp,
        ):
            engine = calibrated(
                Calibration((entry,)),
                p,
                b.kv_tokens,
                vllm_version=k.vllm_version,
                max_model_len=k.max_model_len,
            )
            return engine.sources()
    return {}
