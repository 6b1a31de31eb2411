"""Every command-line option, defined once, with a metavar a person can read."""

from __future__ import annotations

from pathlib import Path

import typer

EXAMPLE_PREFIX = "example:"

InventoryArg = typer.Argument(
    ...,
    metavar="INVENTORY",
    help="Inventory YAML, or example:NAME for a bundled example (see `fleetctl examples`).",
    show_default=False,
)
ProfilesOpt: list[Path] = typer.Option(
    None,
    "--profiles",
    metavar="DIR",
    help="Folder of extra profiles (gpus/, models/, formats/); overrides bundled ones by name. "
    "Repeatable; FLEETCTL_PROFILES works too.",
)
JsonOpt: bool = typer.Option(False, "--json", help="Print JSON instead of tables.")
StateDirOpt: Path | None = typer.Option(
    None,
    "--state-dir",
    metavar="DIR",
    help="State folder (default: .fleetctl beside the inventory; for example:NAME, in the "
    "current folder).",
)
FactsOpt: Path | None = typer.Option(
    None,
    "--facts",
    metavar="FILE",
    help="Probed facts JSON (default: the state folder's facts.json when present).",
)
KnownHostsOpt: Path | None = typer.Option(
    None, "--known-hosts", metavar="FILE", help="known_hosts file (default ~/.ssh/known_hosts)."
)
AcceptNewOpt: bool = typer.Option(
    False,
    "--accept-new-host-keys",
    help="Trust and record unknown host keys (OpenSSH's accept-new); changed keys are refused.",
)
NO_CALIBRATION_HELP = (
    "Use the profiles alone, not the figures `fleetctl calibrate` measured on live servers."
)


def no_calibration(help: str = NO_CALIBRATION_HELP) -> bool:
    """`--no-calibration`, with what it turns off in this command."""
    return typer.Option(False, "--no-calibration", help=help)


NoCalibrationOpt: bool = no_calibration()
YesOpt: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation.")
SecretsFileOpt: Path | None = typer.Option(
    None,
    "--secrets-file",
    metavar="FILE",
    help="0600 file of KEY=VALUE secrets named in apply.secrets (else the environment).",
)


def parallel(what: str) -> int:
    return typer.Option(32, "--parallel", min=1, metavar="N", help=f"Nodes {what} at once.")


def timeout(default: float) -> float:
    return typer.Option(
        default, "--timeout", metavar="SECONDS", help="Seconds per command on a node."
    )
