"""`autopilot`: the fleet following its traffic, live (fleetctl/autopilot/live.py)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import typer

from fleetctl.cli import autopilot_options as ao
from fleetctl.cli import common
from fleetctl.cli.app import app
from fleetctl.cli.options import (
    AcceptNewOpt,
    InventoryArg,
    KnownHostsOpt,
    ProfilesOpt,
    SecretsFileOpt,
    StateDirOpt,
    no_calibration,
    parallel,
    timeout,
)


@app.command("autopilot")
def autopilot(
    inventory: str = InventoryArg,
    router: str = ao.Router,
    request_log: Path | None = ao.RequestLog,
    interval: float = ao.Interval,
    dry_run: bool = ao.DryRun,
    audit_log: Path | None = ao.AuditLog,
    once: bool = ao.Once,
    moves_per_hour: int | None = ao.MovesPerHour,
    down_after: int = ao.DownAfter,
    floor: int = ao.Floor,
    drain_timeout: float = ao.DrainTimeout,
    no_calibration_: bool = no_calibration(),
    secrets_file: Path | None = SecretsFileOpt,
    accept_new: bool = AcceptNewOpt,
    known_hosts: Path | None = KnownHostsOpt,
    timeout: float = timeout(60.0),
    parallel_: int = parallel("started or stopped on"),
    state_dir: Path | None = StateDirOpt,
    profiles: list[Path] = ProfilesOpt,
) -> None:
    """Move the fleet with its traffic: sleep and wake servers (vLLM's sleep mode), start and
    stop them over SSH as apply does, as the forecast asks; each decision and its figures in
    an audit log."""
    from fleetctl.apply.flow import Access, options
    from fleetctl.autopilot.decide import Settings
    from fleetctl.autopilot.live import Live, LiveOptions

    _check(router, interval, moves_per_hour, down_after, floor, drain_timeout)
    inv, _ = common.load(inventory, profiles)
    sdir = common.state_dir(inv, state_dir)
    log = request_log if request_log is not None else sdir.requests_path
    _check_paths(log, audit_log)
    calibration = None if no_calibration_ else sdir.load_calibration()
    settings = Settings(
        interval_s=interval, down_after=down_after, moves_per_hour=moves_per_hour, floor=floor
    )
    access = Access(known_hosts, accept_new, timeout, parallel_, state_dir)
    live_options = LiveOptions(
        router,
        log,
        audit_log if audit_log is not None else sdir.autopilot_log_path,
        dry_run,
        once,
        drain_timeout,
        # A dry run reaches no node: it needs no secrets.
        apply=None if dry_run else options(inv, access, secrets_file),
    )
    stop = threading.Event()
    live = Live(inv, sdir, live_options, settings, calibration, stop)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    live.run(_render)
    if stop.is_set():
        typer.echo("stopped; every server is left as it is")


def _check(
    router: str,
    interval: float,
    moves_per_hour: int | None,
    down_after: int,
    floor: int,
    drain_timeout: float,
) -> None:
    from fleetctl.base.errors import Location, UserError

    try:
        parts = urlsplit(router)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(
            f"--router {router!r} is not an http(s) URL",
            Location("--router"),
            "give route-serve's base URL, e.g. http://127.0.0.1:8080",
        )
    if port is None and parts.netloc.endswith(":"):
        raise UserError(f"--router {router!r} has no port", Location("--router"), "add :PORT")
    checks = [
        ("--interval", interval > 0, "a number of seconds above 0"),
        ("--moves-per-hour", moves_per_hour is None or moves_per_hour >= 0, "0 or more"),
        ("--down-after", down_after >= 1, "1 or more intervals"),
        ("--floor", floor >= 0, "0 or more servers"),
        ("--drain-timeout", drain_timeout >= 0, "0 or more seconds"),
    ]
    for name, ok, want in checks:
        if not ok:
            raise UserError(f"{name} is out of range", Location(name), f"give {want}")


def _check_paths(log: Path, audit: Path | None) -> None:
    from fleetctl.base.errors import Location, UserError

    if not log.exists():
        raise UserError(
            "no request log there",
            Location(str(log)),
            "point --request-log at route-serve's requests folder (route-serve keeps it unless "
            "started with --no-request-log)",
        )
    if audit is not None and not audit.parent.is_dir():
        raise UserError(
            "the audit log's folder does not exist", Location(str(audit)), "create it first"
        )


def _render(record: dict[str, Any]) -> None:
    """One decision: when, what came of it, the traffic, and each change with its result."""
    requests = ", ".join(f"{m} {n:g}" for m, n in sorted(record["requests"].items())) or "none"
    servers = ", ".join(f"{m} {n}" for m, n in sorted(record["servers"].items())) or "none"
    typer.echo(
        f"{record['at']}  {record['outcome']}: requests {requests}; awake servers planned: "
        f"{servers}"
    )
    for change, result in zip(record["changes"], record["carried_out"], strict=True):
        where = f"{change['model']} on {result['server']} (GPUs {change['gpus']})"
        if result["result"] == "dry_run":
            typer.echo(f"  would {change['kind']} {where}: {change['why']}")
        else:
            typer.echo(f"  {change['kind']} {where}: {result['result']}: {result['detail']}")
    for why in record["held"]:
        typer.echo(f"  held: {why}")
