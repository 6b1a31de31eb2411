"""The command line: thin typer commands over the library, and the one error boundary."""

# Each module registers its commands on `app`; --help lists them in the order of the work.
# isort: off
import fleetctl.cli.plan_cmds
import fleetctl.cli.estimate_cmds
import fleetctl.cli.calibrate_cmds
import fleetctl.cli.router_cmds
import fleetctl.cli.fleet_cmds
import fleetctl.cli.apply_cmds
import fleetctl.cli.autopilot_cmds
import fleetctl.cli.traces_cmds
import fleetctl.cli.misc_cmds  # noqa: F401

# isort: on
from fleetctl.cli.app import app, main

__all__ = ["app", "main"]
