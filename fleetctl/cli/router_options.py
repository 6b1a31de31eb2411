"""route-serve's command-line options, defined once (cli/router_cmds.py takes them)."""

from __future__ import annotations

from pathlib import Path

import typer

from fleetctl.cli.options import no_calibration
from fleetctl.routing.sessions import SESSIONS_MAX

Listen: str | None = typer.Option(
    None,
    "--listen",
    metavar="HOST:PORT",
    help="Address to bind (default: the inventory's router.listen, 127.0.0.1:8080).",
)
Backends: Path | None = typer.Option(
    None,
    "--backends",
    metavar="FILE",
    help="YAML list of servers fleetctl did not launch (default: the state).",
)
Policy: str = typer.Option("hardware-aware", "--policy", metavar="NAME", help="Routing policy.")
ApiKeyFile: Path | None = typer.Option(
    None, "--api-key-file", metavar="FILE", help="File (mode 0600) with the key clients send."
)
BackendApiKeyFile: Path | None = typer.Option(
    None,
    "--backend-api-key-file",
    metavar="FILE",
    help="File (mode 0600) with the key to send to backends.",
)
MaxBodyMb: float = typer.Option(32.0, "--max-body-mb", metavar="MB", help="Largest request body.")
UpstreamTimeout: float = typer.Option(
    600.0, "--upstream-timeout", metavar="SECONDS", help="Wait for a backend's next byte."
)
ScrapeInterval: float = typer.Option(
    0.25,
    "--scrape-interval",
    metavar="SECONDS",
    help="Time between /metrics scrapes of each backend.",
)
SessionStore: str | None = typer.Option(
    None,
    "--session-store",
    metavar="redis://HOST:PORT/DB",
    help="Share session affinity and the aging window across replicas.",
)
UpstreamClient: str = typer.Option(
    "fast",
    "--upstream-client",
    hidden=True,  # for comparing clients (benchmarks, tests); users keep the fast one
    metavar="fast|reference",
    help="HTTP client to the backends: fast (llhttp framing) or reference (aiohttp's).",
)
SkipCalibration: bool = no_calibration(
    "Route with the profiles' KV and speed, not calibration.json's (at start and on reload)."
)
NoOnlineFit: bool = typer.Option(
    False,
    "--no-online-fit",
    help="Do not learn each backend's speed from its /metrics while serving.",
)
PrefixCapacity: int | None = typer.Option(
    None,
    "--prefix-capacity",
    min=0,
    max=1 << 30,
    metavar="BLOCKS",
    help="Blocks the prefix index holds over all backends (default 262144; 0: none).",
)
MaxSessions: int = typer.Option(
    SESSIONS_MAX,
    "--max-sessions",
    min=1,
    max=100_000_000,
    metavar="N",
    help="Session pins held in memory, the least recently used forgotten first (a "
    "forgotten session's next turn is routed afresh; ~260 bytes a pin).",
)
KvEvents: bool | None = typer.Option(
    None,
    "--kv-events/--no-kv-events",
    help="Learn each server's cache from its vLLM KV events, at the ports apply gave it "
    "(default: the inventory's router.prefix_cache.kv_events).",
)
NoRequestLog: bool = typer.Option(
    False,
    "--no-request-log",
    help="Keep no log of finished requests in the state folder's requests/ (default: "
    "the inventory's router.request_log.enabled).",
)
AutopilotLog: Path | None = typer.Option(
    None,
    "--autopilot-log",
    metavar="FILE",
    help="The autopilot's audit log (`fleetctl autopilot --audit-log`): /metrics shows its "
    "decisions, actions and forecasts (fleetctl_autopilot_*).",
)
Workers: int = typer.Option(
    1,
    "--workers",
    min=1,
    max=256,
    metavar="N",
    help="Processes serving the one listening port (SO_REUSEPORT); they share state "
    "through --session-store.",
)
DrainTimeout: float = typer.Option(
    20.0,
    "--drain-timeout",
    min=0.0,
    max=3600.0,
    metavar="SECONDS",
    help="On SIGTERM/SIGINT, how long requests in flight may take to finish before they are "
    "cut (a second signal cuts them at once).",
)
