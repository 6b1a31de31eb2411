"""The options of `fleetctl autopilot`, defined once (the command is autopilot_cmds.py)."""

from __future__ import annotations

from pathlib import Path

import typer

Router: str = typer.Option(
    ...,
    "--router",
    metavar="URL",
    help="route-serve's base URL (http://host:port): the autopilot reads its /metrics to "
    "drain a server before it sleeps.",
    show_default=False,
)
RequestLog: Path | None = typer.Option(
    None,
    "--request-log",
    metavar="PATH",
    help="route-serve's request log, its folder or one file (default: the state folder's "
    "requests/).",
)
Interval: float = typer.Option(
    60.0, "--interval", metavar="SECONDS", help="Seconds between decisions."
)
DryRun: bool = typer.Option(
    False, "--dry-run", help="Print what it would do and why; change nothing."
)
AuditLog: Path | None = typer.Option(
    None,
    "--audit-log",
    metavar="FILE",
    help="Where every decision is appended as a JSON line, 0600 (default: the state "
    "folder's autopilot.jsonl).",
)
Once: bool = typer.Option(False, "--once", help="Decide and carry out one interval, then exit.")
MovesPerHour: int | None = typer.Option(
    None,
    "--moves-per-hour",
    metavar="N",
    help="Starts and wakes allowed in any hour (default: two per GPU group of the fleet, "
    "at least 30).",
)
DownAfter: int = typer.Option(
    5,
    "--down-after",
    metavar="N",
    help="Intervals in a row a server must be unneeded before it sleeps or stops.",
)
Floor: int = typer.Option(
    1, "--floor", metavar="N", help="Awake servers each model keeps, whatever its traffic."
)
DrainTimeout: float = typer.Option(
    120.0,
    "--drain-timeout",
    metavar="SECONDS",
    help="Longest wait for route-serve's requests in flight at a server before it sleeps.",
)
