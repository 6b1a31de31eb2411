"""`route-serve` and `emulate`: the routing daemon, and a stand-in vLLM server to route to."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from fleetctl.cli import common
from fleetctl.cli.app import app
from fleetctl.cli.options import InventoryArg, ProfilesOpt, StateDirOpt, no_calibration


@app.command("route-serve")
def route_serve(
    inventory: str = InventoryArg,
    listen: str | None = typer.Option(
        None,
        "--listen",
        metavar="HOST:PORT",
        help="Address to bind (default: the inventory's router.listen, 127.0.0.1:8080).",
    ),
    backends: Path | None = typer.Option(
        None,
        "--backends",
        metavar="FILE",
        help="YAML list of servers fleetctl did not launch (default: the state).",
    ),
    policy: str = typer.Option(
        "hardware-aware", "--policy", metavar="NAME", help="Routing policy."
    ),
    api_key_file: Path | None = typer.Option(
        None, "--api-key-file", metavar="FILE", help="File (mode 0600) with the key clients send."
    ),
    backend_api_key_file: Path | None = typer.Option(
        None,
        "--backend-api-key-file",
        metavar="FILE",
        help="File (mode 0600) with the key to send to backends.",
    ),
    max_body_mb: float = typer.Option(
        32.0, "--max-body-mb", metavar="MB", help="Largest request body."
    ),
    upstream_timeout: float = typer.Option(
        600.0, "--upstream-timeout", metavar="SECONDS", help="Wait for a backend's next byte."
    ),
    scrape_interval: float = typer.Option(
        0.25,
        "--scrape-interval",
        metavar="SECONDS",
        help="Time between /metrics scrapes of each backend.",
    ),
    session_store: str | None = typer.Option(
        None,
        "--session-store",
        metavar="redis://HOST:PORT/DB",
        help="Share session affinity and the aging window across replicas.",
    ),
    upstream_client: str = typer.Option(
        "fast",
        "--upstream-client",
        hidden=True,  # for comparing clients (benchmarks, tests); users keep the fast one
        metavar="fast|reference",
        help="HTTP client to the backends: fast (llhttp framing) or reference (aiohttp's).",
    ),
    skip_calibration: bool = no_calibration(
        "Route with the profiles' KV and speed, not calibration.json's (at start and on reload)."
    ),
    no_online_fit: bool = typer.Option(
        False,
        "--no-online-fit",
        help="Do not learn each backend's speed from its /metrics while serving.",
    ),
    prefix_capacity: int | None = typer.Option(
        None,
        "--prefix-capacity",
        min=0,
        max=1 << 30,
        metavar="BLOCKS",
        help="Blocks the prefix index holds over all backends (default 1048576; 0: none).",
    ),
    kv_events: bool | None = typer.Option(
        None,
        "--kv-events/--no-kv-events",
        help="Learn each server's cache from its vLLM KV events, at the ports apply gave it "
        "(default: the inventory's router.prefix_cache.kv_events).",
    ),
    no_request_log: bool = typer.Option(
        False,
        "--no-request-log",
        help="Keep no log of finished requests in the state folder's requests/ (default: "
        "the inventory's router.request_log.enabled).",
    ),
    workers: int = typer.Option(
        1,
        "--workers",
        min=1,
        max=256,
        metavar="N",
        help="Processes serving the one listening port (SO_REUSEPORT); they share state "
        "through --session-store.",
    ),
    state_dir: Path | None = StateDirOpt,
    profiles: list[Path] = ProfilesOpt,
) -> None:
    """Run the OpenAI-compatible routing daemon in front of the fleet (SIGHUP reloads)."""
    from fleetctl.base.errors import UserError
    from fleetctl.daemon.backends import load_backends
    from fleetctl.daemon.router import PREFIX_CAPACITY, DaemonConfig
    from fleetctl.daemon.serve import build_router, kv_sources, read_secret, serve
    from fleetctl.daemon.transport import TRANSPORTS

    if upstream_client not in TRANSPORTS:
        raise UserError(
            f"unknown upstream client '{upstream_client}'",
            None,
            f"choose {' or '.join(TRANSPORTS)}",
        )
    inv, catalog = common.load(inventory, profiles)
    sdir = common.state_dir(inv, state_dir)
    key = (
        read_secret(api_key_file, "API key file")
        if api_key_file
        else os.environ.get("FLEETCTL_API_KEY")
    )
    backend_key = (
        read_secret(backend_api_key_file, "backend API key file") if backend_api_key_file else None
    )
    config = DaemonConfig(
        max_body_bytes=int(max_body_mb * 2**20),
        upstream_timeout_s=upstream_timeout,
        api_key=key or None,
        backend_api_key=backend_key,
        priority_classes=inv.spec.router.priority_classes,
        transport=upstream_client,
    )
    router = build_router(
        inv,
        catalog,
        backends_file=backends,
        state_dir=sdir,
        policy=policy,
        config=config,
        scrape_interval=scrape_interval,
        session_store=session_store,
        online_fit=not no_online_fit,
        calibrated=not skip_calibration,
        prefix_capacity=PREFIX_CAPACITY if prefix_capacity is None else prefix_capacity,
        use_kv_events=kv_events,
        request_log=False if no_request_log else None,
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
    for flag in ignored:
        sys.stderr.write(f"warning: emulate ignores the vllm serve flag {flag}\n")
    serve(resolve(args))
