"""`route-serve` and `emulate`: the routing daemon, and a stand-in vLLM server to route to."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from fleetctl.cli import common
from fleetctl.cli import router_options as ro
from fleetctl.cli.app import app
from fleetctl.cli.options import InventoryArg, ProfilesOpt, StateDirOpt

if TYPE_CHECKING:
    from fleetctl.daemon.router import DaemonConfig


@app.command("route-serve")
def route_serve(
    inventory: str = InventoryArg,
    listen: str | None = ro.Listen,
    backends: Path | None = ro.Backends,
    policy: str = ro.Policy,
    api_key_file: Path | None = ro.ApiKeyFile,
    backend_api_key_file: Path | None = ro.BackendApiKeyFile,
    max_body_mb: float = ro.MaxBodyMb,
    upstream_timeout: float = ro.UpstreamTimeout,
    scrape_interval: float = ro.ScrapeInterval,
    session_store: str | None = ro.SessionStore,
    upstream_client: str = ro.UpstreamClient,
    skip_calibration: bool = ro.SkipCalibration,
    no_online_fit: bool = ro.NoOnlineFit,
    prefix_capacity: int | None = ro.PrefixCapacity,
    max_sessions: int = ro.MaxSessions,
    kv_events: bool | None = ro.KvEvents,
    no_request_log: bool = ro.NoRequestLog,
    autopilot_log: Path | None = ro.AutopilotLog,
    workers: int = ro.Workers,
    drain_timeout: float = ro.DrainTimeout,
    state_dir: Path | None = StateDirOpt,
    profiles: list[Path] = ProfilesOpt,
) -> None:
    """Run the OpenAI-compatible routing daemon in front of the fleet (SIGHUP reloads)."""
    from fleetctl.daemon.backends import load_backends
    from fleetctl.daemon.router import PREFIX_CAPACITY
    from fleetctl.daemon.serve import build_router, kv_sources, serve

    config = _daemon_config(
        api_key_file, backend_api_key_file, max_body_mb, upstream_timeout, upstream_client
    )
    config.drain_timeout_s = drain_timeout
    inv, catalog = common.load(inventory, profiles)
    sdir = common.state_dir(inv, state_dir)
    _daemon_log()  # before the backends load: the log says which classes are calibrated
    router = build_router(
        inv,
        catalog,
        backends_file=backends,
        state_dir=sdir,
        policy=policy,
        config=replace(config, priority_classes=inv.spec.router.priority_classes),
        scrape_interval=scrape_interval,
        session_store=session_store,
        online_fit=not no_online_fit,
        calibrated=not skip_calibration,
        prefix_capacity=PREFIX_CAPACITY if prefix_capacity is None else prefix_capacity,
        use_kv_events=kv_events,
        request_log=False if no_request_log else None,
        max_sessions=max_sessions,
        autopilot_log=autopilot_log,
    )

    def reload():  # type: ignore[no-untyped-def]
        fresh_inv, fresh_catalog = common.load(inventory, profiles)
        fresh = load_backends(
            fresh_inv, fresh_catalog, backends, sdir, calibrated=not skip_calibration
        )
        sources = kv_sources(fresh_inv, backends, sdir, kv_events, fresh)
        router.set_kv_events(sources or {})
        return fresh

    serve(router, listen or inv.spec.router.listen, reload, None if backends else sdir, workers)


def _daemon_config(
    api_key_file: Path | None,
    backend_api_key_file: Path | None,
    max_body_mb: float,
    upstream_timeout: float,
    upstream_client: str,
) -> DaemonConfig:
    """The daemon's limits and keys from its options; the keys from 0600 files or
    FLEETCTL_API_KEY, never from the command line."""
    from fleetctl.base.errors import UserError
    from fleetctl.daemon.router import DaemonConfig
    from fleetctl.daemon.serve import read_secret
    from fleetctl.daemon.transport import TRANSPORTS

    if upstream_client not in TRANSPORTS:
        raise UserError(
            f"unknown upstream client '{upstream_client}'",
            None,
            f"choose {' or '.join(TRANSPORTS)}",
        )
    key = (
        read_secret(api_key_file, "API key file")
        if api_key_file
        else os.environ.get("FLEETCTL_API_KEY")
    )
    backend_key = (
        read_secret(backend_api_key_file, "backend API key file") if backend_api_key_file else None
    )
    return DaemonConfig(
        max_body_bytes=int(max_body_mb * 2**20),
        upstream_timeout_s=upstream_timeout,
        api_key=key or None,
        backend_api_key=backend_key,
        transport=upstream_client,
    )


def _daemon_log() -> None:
    """The daemon process's log: messages alone, at FLEETCTL_LOG_LEVEL (INFO)."""
    logging.basicConfig(level=os.environ.get("FLEETCTL_LOG_LEVEL", "INFO"), format="%(message)s")
    # The format prints the message alone, so skip what every log record would otherwise look
    # up (the caller's frame, thread, process): the access log writes a record per request.
    # (The "Optimization" section of the logging HOWTO.) Process-wide, so set here, where the
    # process starts, and never by the library.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


@app.command(
    # `vllm serve`'s flags are forwarded as they are (a `vllm` shim on test hosts calls this),
    # so argparse parses them; typer would reject the hundreds it does not declare.
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def emulate(ctx: typer.Context) -> None:
    """Serve one emulated vLLM OpenAI-compatible server on a modelled GPU (see emulate --help)."""
    from fleetctl.emulator.args import parse_args
    from fleetctl.emulator.config import resolve
    from fleetctl.emulator.server import serve

    args, ignored = parse_args(list(ctx.args))
    logging.basicConfig(  # the emulator process's log
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    for flag in ignored:
        sys.stderr.write(f"warning: emulate ignores the vllm serve flag {flag}\n")
    serve(resolve(args))
