"""The typer application, its global flags, and the one error boundary (`main`)."""

from __future__ import annotations

import os
import sys

import typer

app = typer.Typer(
    name="fleetctl",
    help="Plan, apply, route and simulate vLLM serving on heterogeneous GPU fleets.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
profiles_app = typer.Typer(
    help="List, show and import hardware and model profiles.", no_args_is_help=True
)
examples_app = typer.Typer(
    help="The bundled example inventories: list them, or copy one to edit.",
    invoke_without_command=True,
)
traces_app = typer.Typer(
    help="Public LLM request traces by name: list them, download one into the cache.",
    no_args_is_help=True,
)
app.add_typer(profiles_app, name="profiles")
app.add_typer(examples_app, name="examples")
app.add_typer(traces_app, name="traces")


def _version(value: bool) -> None:
    if value:
        from fleetctl import __version__

        typer.echo(f"fleetctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """fleetctl: run a mixed GPU fleet serving open-weight LLMs with vLLM."""
    if debug:
        from fleetctl.cli.common import debug_logging

        debug_logging()


def main() -> None:
    """Entry point: run the app inside the one error boundary."""
    debug = "--debug" in sys.argv[1:] or os.environ.get("FLEETCTL_DEBUG") == "1"
    try:
        app()
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except Exception as e:
        from fleetctl.base.errors import FleetError

        if debug:
            raise
        if isinstance(e, FleetError):
            sys.stderr.write(f"error: {e}\n")
            sys.exit(e.exit_code)
        sys.stderr.write(
            f"internal error: {type(e).__name__}: {e} (run with --debug for the traceback)\n"
        )
        sys.exit(1)
