"""`apply`, `status` and `destroy`: carry out a plan over SSH, see what runs, take it down."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from fleetctl.base.jsonout import print_json
from fleetctl.base.public_traces import resolve_trace
from fleetctl.cli import common
from fleetctl.cli.app import app
from fleetctl.cli.options import (
    AcceptNewOpt,
    FactsOpt,
    InventoryArg,
    JsonOpt,
    KnownHostsOpt,
    ProfilesOpt,
    SecretsFileOpt,
    StateDirOpt,
    YesOpt,
    no_calibration,
    parallel,
    timeout,
)

if TYPE_CHECKING:
    from fleetctl.fleet.plan import Plan
    from fleetctl.fleet.state import State
    from fleetctl.model.calibration import Entry


@app.command()
def apply(
    target: str = typer.Argument(
        ...,
        metavar="INVENTORY|PLAN.json",
        help="Inventory YAML (plans now), example:NAME, or a plan saved with `plan -o FILE.json` "
        "(applied exactly, if the state has not changed since).",
        show_default=False,
    ),
    yes: bool = YesOpt,
    parallel: int = parallel("worked on"),
    secrets_file: Path | None = SecretsFileOpt,
    facts: Path | None = FactsOpt,
    accept_new: bool = AcceptNewOpt,
    known_hosts: Path | None = KnownHostsOpt,
    timeout: float = timeout(60.0),
    state_dir: Path | None = StateDirOpt,
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
    skip_calibration: bool = no_calibration(
        "Plan with the profiles alone, not the figures `fleetctl calibrate` measured on live "
        "servers, and do not refresh them from the servers after the apply."
    ),
    gate_trace: Path | None = typer.Option(
        None,
        "--gate",
        metavar="TRACE",
        help="Simulate what runs now and the plan on this trace (a file, a request log, or a "
        "name from `fleetctl traces list`); refuse a plan whose p99 TTFT or SLO attainment is "
        "worse beyond apply.gate's thresholds.",
        callback=resolve_trace,
    ),
    force: bool = typer.Option(False, "--force", help="Apply even if --gate refuses the plan."),
) -> None:
    """Start, replace and stop vLLM servers over SSH until the nodes run the plan."""
    from fleetctl.apply.flow import PlanFile, check_saved_plan, is_plan_file, read_plan_file
    from fleetctl.cli.apply_flow import Common, run_apply

    plan_file = None
    if is_plan_file(target):
        inv_path, serial, deployments, slos = read_plan_file(Path(target))
        inv, catalog = common.load(inv_path, profiles, ssh=True)
        check_saved_plan(Path(target), deployments, inv)
        plan_file = PlanFile(Path(target), serial, deployments, slos)
    else:
        inv, catalog = common.load(target, profiles, ssh=True)
    c = Common(known_hosts, accept_new, timeout, parallel, state_dir, as_json, yes)
    sdir = common.state_dir(inv, state_dir)
    planned: list[Plan] = []

    def make_plan(state: State) -> Plan:
        from fleetctl.planner.make import plan_with_facts

        planned.append(plan_with_facts(inv, catalog, sdir, facts, state, not skip_calibration))
        return planned[-1]

    def refresh() -> tuple[dict[str, Any], list[str]]:
        """After an apply that went well: the servers now running refresh the calibration."""
        if skip_calibration:
            return {"calibration": None}, []
        from fleetctl.apply.calibrate import refresh_running

        done = refresh_running(inv, catalog, sdir)
        return {"calibration": done.to_json()}, done.lines()

    gate = None
    if gate_trace is not None:
        from fleetctl.apply.gate import trace_gate

        # The trace is read now: a bad one fails before anything is locked.
        gate = trace_gate(inv, sdir, gate_trace, force, not skip_calibration, not as_json)
    elif force:
        raise typer.BadParameter("--force overrides --gate: give --gate TRACE too")
    code = run_apply(inv, c, make_plan, plan_file, secrets_file, common.console(), refresh, gate)
    if code:
        raise typer.Exit(code)
    if planned:  # applied as planned, but a model is missing from the plan: say so, exit 3
        common.exit_if_incomplete(planned[0])


@app.command()
def status(
    inventory: str = InventoryArg,
    parallel: int = parallel("asked"),
    secrets_file: Path | None = SecretsFileOpt,
    accept_new: bool = AcceptNewOpt,
    known_hosts: Path | None = KnownHostsOpt,
    timeout: float = timeout(30.0),
    state_dir: Path | None = StateDirOpt,
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
) -> None:
    """What state.json records, checked live on the nodes: running, dead, drifted, ports."""
    from fleetctl.apply.flow import options
    from fleetctl.apply.status import status_fleet
    from fleetctl.cli.apply_flow import Common
    from fleetctl.fleet.engines import server_engines

    inv, _ = common.load(inventory, profiles, ssh=True)
    c = Common(known_hosts, accept_new, timeout, parallel, state_dir, as_json, True)
    sdir = common.state_dir(inv, state_dir)
    state = sdir.load_state()
    if not state.deployments:
        _nothing_recorded(inventory, sdir.state_path, state, as_json)
        return
    engines = server_engines(inv, state, sdir.load_calibration())
    # The servers' /v1/models takes the API key when they have one; no other secret is used.
    opts = options(inv, c.access(), secrets_file, needs=("VLLM_API_KEY",))
    rows, summary = status_fleet(inv, state, opts)
    unreachable = summary["unreachable"]
    # Every server running, and every node asked: nothing unchecked passes for fine.
    good = all(r.condition == "running" for r in rows) and not unreachable
    if as_json:
        servers = []
        for r in rows:
            engine = engines.get((r.node, tuple(r.gpus)))
            servers.append(
                {
                    **r.to_json(),
                    "calibration": _beside(engine.entry if engine else None),
                    "perf": engine.figures() if engine else None,
                }
            )
        print_json({"ok": good, "applied": True, **summary, "servers": servers})
    else:
        from fleetctl.base.text import plural
        from fleetctl.cli.render import status_table

        console = common.console()
        if rows:
            from fleetctl.model.calibration import beside_model_text

            texts = {k: beside_model_text(e.entry) for k, e in engines.items() if e.entry}
            console.print(status_table(rows, texts))
        common.unchecked(console, [u["line"] for u in unreachable], summary["nodes"])
        console.print(f"{plural(len(rows), 'server')}, state serial {summary['serial']}.")
    if not good:
        raise typer.Exit(1)


def _nothing_recorded(inventory: str, path: Path, state: State, as_json: bool) -> None:
    """Status checks what apply recorded: with nothing recorded there is nothing to ask a node,
    and asking every node of a fleet never applied spent its connect timeout on each."""
    if as_json:
        print_json(
            {"ok": True, "applied": False, "serial": state.serial, "servers": [], "nodes": 0}
            | {"unreachable": []}
        )
        return
    since = "yet" if state.serial == 0 else f"(state serial {state.serial}: destroyed)"
    common.console().print(
        f"Nothing applied {since}: {path} records no servers, so no node was contacted. "
        f"Run `fleetctl apply {inventory}` to start the plan.",
        markup=False,
    )


def _beside(entry: Entry | None) -> dict[str, Any] | None:
    from fleetctl.model.calibration import beside_model

    return None if entry is None else beside_model(entry)


@app.command()
def destroy(
    inventory: str = InventoryArg,
    yes: bool = YesOpt,
    parallel: int = parallel("worked on"),
    accept_new: bool = AcceptNewOpt,
    known_hosts: Path | None = KnownHostsOpt,
    timeout: float = timeout(60.0),
    state_dir: Path | None = StateDirOpt,
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Stop every server fleetctl started on the nodes and empty the state."""
    from fleetctl.cli.apply_flow import Common, run_destroy

    inv, _ = common.load(inventory, profiles, ssh=True)
    c = Common(known_hosts, accept_new, timeout, parallel, state_dir, as_json, yes)
    code = run_destroy(inv, c, common.console())
    if code:
        raise typer.Exit(code)
