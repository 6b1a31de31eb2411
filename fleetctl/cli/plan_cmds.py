"""`validate`, `plan` and `simulate`: what the inventory says, where it goes, how it would run."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from fleetctl.base.errors import UserError
from fleetctl.base.jsonout import dump_json, print_json
from fleetctl.base.public_traces import resolve_trace
from fleetctl.cli import common
from fleetctl.cli.app import app
from fleetctl.cli.options import (
    FactsOpt,
    InventoryArg,
    JsonOpt,
    NoCalibrationOpt,
    ProfilesOpt,
    StateDirOpt,
)

# simulate's --policies default: a literal, so `--help` loads no routing code
# (tests/routing/test_policy_registry.py checks it names the registry's compared policies).
DEFAULT_SIM_POLICIES = "round-robin,least-outstanding,power-of-two,kv-aware,hardware-aware"

if TYPE_CHECKING:
    from fleetctl.fleet.plan import Plan
    from fleetctl.routing.goodput import Slo
    from fleetctl.sim.capacity import Capacity


@app.command()
def validate(
    inventory: str = InventoryArg, profiles: list[Path] = ProfilesOpt, as_json: bool = JsonOpt
) -> None:
    """Check an inventory and its profiles; print what it declares."""
    from fleetctl.base.text import plural

    inv, _ = common.load(inventory, profiles)
    gpus = sum(n.gpu_count for n in inv.nodes)
    if as_json:
        print_json(
            {
                "inventory": str(inv.path),
                "nodes": len(inv.nodes),
                "gpus": gpus,
                "models": [m.name for m in inv.models],
            }
        )
        return
    common.console().print(
        f"[green]ok[/green] {inv.path}: {plural(len(inv.nodes), 'node')}, "
        f"{plural(gpus, 'GPU')}, {plural(len(inv.models), 'model')}"
    )


@app.command()
def plan(
    inventory: str = InventoryArg,
    facts: Path | None = FactsOpt,
    state_dir: Path | None = StateDirOpt,
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
    out: Path | None = typer.Option(
        None, "-o", "--out", metavar="FILE", help="Write the plan as JSON to this file."
    ),
    explain: bool = typer.Option(False, "--explain", help="Show why each deployment is placed so."),
    no_calibration: bool = NoCalibrationOpt,
    workload_from: Path | None = typer.Option(
        None,
        "--workload-from",
        metavar="LOGS",
        help="Plan for the traffic in route-serve's request log (a file or its folder) or a "
        "trace (a file, or a name from `fleetctl traces list`), instead of the inventory's "
        "workloads.",
        callback=resolve_trace,
    ),
    what_if: Path | None = typer.Option(
        None,
        "--what-if",
        metavar="TRACE",
        help="Simulate what runs now and this plan on the same trace (a file, a request log, "
        "or a name from `fleetctl traces list`); show TTFT, TPOT, SLO attainment and cost "
        "side by side.",
        callback=resolve_trace,
    ),
    objective: str | None = typer.Option(
        None,
        "--objective",
        metavar="throughput|cost",
        help="throughput: share spare GPUs out among the models; cost: the cheapest GPUs that "
        "meet every workload. Default: the inventory's planner.objective (throughput).",
    ),
) -> None:
    """Compute which model, format and TP size runs on which GPUs, and the diff to what runs."""
    import dataclasses

    from fleetctl.fleet.statedir import write_atomic

    inv, catalog = common.load(inventory, profiles)
    if objective is not None:
        from fleetctl.fleet.prices import with_objective

        inv = with_objective(inv, objective)
    workloads = None
    if workload_from is not None:
        from fleetctl.sim.traffic import workloads_from

        inv, workloads = workloads_from(inv, workload_from)
    sdir = common.state_dir(inv, state_dir)
    traffic = None
    if what_if is not None:
        from fleetctl.sim.traffic import traces_from

        traffic = traces_from(inv, what_if)
    state = sdir.load_state()
    traces = None
    if workload_from is not None and inv.spec.planner.objective == "cost":
        from fleetctl.sim.traffic import traces_from

        traces = traces_from(inv, workload_from)  # the SLO check runs the traffic itself
    from fleetctl.planner.make import plan_with_facts

    result = plan_with_facts(inv, catalog, sdir, facts, state, not no_calibration, traces)
    from fleetctl.apply.warmup import for_plan

    calibration = None if no_calibration else sdir.load_calibration()
    # Warm-up: the start-ups apply measured (the calibration), else estimated from weights.
    disruption = for_plan(inv, result.deployments, state, calibration)
    # Every model has an SLO, stated or derived, the one it was planned by; with traffic
    # given, the simulator replays the plan on it and its goodput rate is the capacity
    # printed (sim/capacity.py).
    slos = result.slos
    checks = {}
    if workload_from is not None:
        from fleetctl.sim.capacity import check_plan

        checks = check_plan(inv, result, workload_from, slos, calibration, not as_json)
    compared = None
    if what_if is not None and traffic is not None:
        from fleetctl.whatif.compare import compare

        compared = compare(
            inv,
            state.deployments,
            result.deployments,
            what_if,
            traffic,
            calibration,
            not as_json,
            state.slo,
        )
    if out is not None:
        # `apply plan.json` may run from another folder: name the inventory absolutely.
        saved = dataclasses.replace(result, inventory=str(Path(result.inventory).resolve()))
        write_atomic(out, dump_json(saved.to_json()) + "\n")
    if as_json:
        data = result.to_json()
        if workloads is not None:
            data["workloads"] = workloads
        if compared is not None:
            data["what_if"] = compared.to_json()
        data["disruption"] = disruption.to_json()
        data["capacity_check"] = capacity_checks(result, checks, workload_from)
        print_json(data)
    else:
        from fleetctl.cli.render import render_plan

        console = common.console()
        if workloads is not None:
            from fleetctl.cli.render import render_workloads

            console.print(render_workloads(workloads))
        replayed = {name: c.rate_rps for name, c in checks.items()}
        console.print(render_plan(result, explain, replayed))
        for line in slo_lines(result, slos, checks, workload_from):
            console.print(line, highlight=False)
        if disruption.line():
            console.print(disruption.line(), highlight=False)
        if compared is not None:
            from fleetctl.cli.whatif_view import render as render_what_if

            console.print(render_what_if(compared))
        if out is not None:
            console.print(f"Saved the plan to {out}; apply exactly it with `fleetctl apply {out}`.")
    common.exit_if_incomplete(result)


def capacity_checks(
    plan: Plan, checks: Mapping[str, Capacity], traffic: Path | None
) -> dict[str, dict[str, Any]]:
    """`plan --json`'s capacity_check: per model, the planner's analytic figure and, where
    the traffic was replayed, the simulator's goodput rate and how it was found."""
    out: dict[str, dict[str, Any]] = {}
    for s in plan.models:
        c = checks.get(s.model)
        out[s.model] = {
            "analytic_rps": round(s.capacity_rps, 3),
            "checked": "replayed" if c is not None else "analytic",
            "goodput_rps": None if c is None else round(c.rate_rps, 3),
            "trace": None if c is None or traffic is None else str(traffic),
            "replay": None if c is None else c.to_json(),
        }
    return out


def slo_lines(
    plan: Plan, slos: Mapping[str, Slo], checks: Mapping[str, Capacity], traffic: Path | None
) -> list[str]:
    """Per model its SLO (stated or derived, and from what), then how its capacity was found:
    replayed on the traffic, or the planner's analytic figure."""
    lines = []
    for s in plan.models:
        slo = slos.get(s.model)
        if slo is not None:
            basis = f"derived: {slo.basis}" if slo.derived else "stated in the inventory"
            lines.append(f"SLO of {s.model}: {slo.share * 100:.4g}% within {slo.text()} ({basis})")
        c = checks.get(s.model)
        if c is not None and traffic is not None:
            lines.append(c.line(traffic.name))
        elif s.replicas:
            lines.append(
                f"{s.model}: capacity {s.capacity_rps:.2f} req/s is analytic, not replayed "
                "(give --workload-from TRACE to check it by the simulator)"
            )
    return lines


@app.command()
def simulate(
    inventory: str = InventoryArg,
    workload: str | None = typer.Option(
        None,
        "--workload",
        metavar="SPEC",
        help="Synthetic workload, key=value,... (rate, duration, prompt, output, long_share, "
        "long_prompt, max_context, lengths, arrivals, burst, sessions, turns, priorities, "
        "precision); or a YAML file of the same keys.",
    ),
    trace: Path | None = typer.Option(
        None,
        "--trace",
        metavar="FILE|NAME",
        help="Request trace: Azure CSV, Mooncake JSONL, or route-serve's request log "
        "(a file, or its folder); or a name from `fleetctl traces list`, once fetched.",
        callback=resolve_trace,
    ),
    window: str | None = typer.Option(
        None,
        "--window",
        metavar="START:END",
        help="Only the trace's requests arriving START to END seconds after its start "
        "(END may be left out).",
    ),
    policies: str = typer.Option(
        DEFAULT_SIM_POLICIES,
        "--policies",
        metavar="A,B,...",
        help="Comma-separated routing policies to compare.",
    ),
    load: float | None = typer.Option(
        None,
        "--load",
        metavar="SHARE",
        help="Scale arrivals to this share of the fleet's capacity (e.g. 0.8).",
    ),
    rate: float | None = typer.Option(
        None,
        "--rate",
        metavar="R",
        help="Scale arrivals to R requests per second (the same traffic for every plan).",
    ),
    slo: str | None = typer.Option(
        None,
        "--slo",
        metavar="TTFT_S,TPOT_MS",
        help="The model's objectives for this run (p99 TTFT in s, TPOT in ms; - for none), "
        "in place of the inventory's slo: hardware-aware routes by them and each policy's "
        "SLO attainment counts them.",
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        metavar="NAME",
        help="Which model the workload targets. Left out with a multi-model inventory and a "
        "trace whose rows name their model, every model runs on one fleet, with the fleet's "
        "GPU-hours and the minutes in which every model met its objectives.",
    ),
    limit: int | None = typer.Option(
        None, "--limit", metavar="N", help="Use only the first N trace requests."
    ),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Random seed (workload and policies)."),
    no_aging: bool = typer.Option(False, "--no-aging", help="Turn priority aging off."),
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
    plot: Path | None = typer.Option(
        None,
        "--plot",
        metavar="FILE",
        help="One model's run: write log-log latency tails (TTFT, e2e) per policy (PNG, "
        "needs matplotlib). Every model of a multi-model trace (also with --autopilot or "
        "--scaler): write the day's picture (FILE.html, one page, no scripts): demand per "
        "model, GPUs per model and role awake and asleep, and the share within the "
        "objectives, minute by minute.",
    ),
    no_calibration: bool = NoCalibrationOpt,
    capacity: bool = typer.Option(
        False,
        "--capacity",
        help="Search the plan's goodput rate instead: the highest rate (the traffic's "
        "arrivals time-scaled) at which hardware-aware serves the SLO's share of requests "
        "within both objectives; bisected to within 5%, replaying the traffic whole, or "
        "four windows of 1,000 requests spread over it.",
    ),
    autopilot: bool = typer.Option(
        False,
        "--autopilot",
        help="With a multi-model trace: the autopilot moves the fleet as the traffic moves "
        "(sleeps, wakes, starts, stops at their modelled seconds); the JSON gives each "
        "model's figures and the fleet's gpu_hours, slo_minutes and actions.",
    ),
    scaler: str | None = typer.Option(
        None,
        "--scaler",
        metavar="KIND",
        help="With a multi-model trace: the field's scaler instead, for comparison. "
        "reactive: KEDA on waiting requests through the HPA (30 s polls, 300 s "
        "scale-down window, cold starts).",
    ),
) -> None:
    """Replay a workload over the planned fleet with each policy; compare goodput, TTFT, TPOT."""
    from fleetctl.sim.command import check_day_plot, run_simulate

    moved = autopilot or scaler is not None
    if moved and plot is not None:  # before loading anything: a bad path wastes no simulation
        check_day_plot(plot)
    inv, _ = common.load(inventory, profiles)
    if moved:
        data, renderable = _moved(
            inv, trace, window, policies, seed, not no_calibration, autopilot, scaler,
            workload is not None or load is not None or rate is not None or slo is not None
            or model is not None or limit is not None or capacity, plot,
        )  # fmt: skip
        if as_json:
            print_json(data)
        else:
            common.console().print(renderable)
        return
    data, renderable = run_simulate(
        inv,
        workload,
        trace,
        policies,
        load,
        model,
        limit,
        seed,
        no_aging,
        plot,
        not as_json,
        not no_calibration,
        window,
        rate=rate,
        slo=slo,
        capacity=capacity,
    )
    if as_json:
        print_json(data)
    else:
        common.console().print(renderable)


def _moved(
    inv: Any,
    trace: Path | None,
    window: str | None,
    policies: str,
    seed: int,
    calibrated: bool,
    autopilot: bool,
    scaler: str | None,
    one_model_options: bool,
    plot: Path | None,
) -> tuple[dict[str, Any], Any]:
    """`simulate --autopilot` or `--scaler`: checked, then run (autopilot/simulated.py)."""
    from fleetctl.autopilot.simulated import simulate_day
    from fleetctl.sim.command import parse_window

    if autopilot and scaler is not None:
        raise UserError("give --autopilot or --scaler, not both", None, "drop one of them")
    if scaler is not None and scaler != "reactive":
        raise UserError(f"unknown scaler {scaler!r}", None, "the one scaler is: reactive")
    if trace is None or one_model_options:
        raise UserError(
            "--autopilot and --scaler run every model of a multi-model trace on one fleet",
            None,
            "give --trace alone (and --window, --policies with one policy, --seed)",
        )
    names = [p.strip() for p in policies.split(",") if p.strip()]
    policy = "hardware-aware" if policies == DEFAULT_SIM_POLICIES else names[0]
    if len(names) != 1 and policies != DEFAULT_SIM_POLICIES:
        raise UserError("--autopilot and --scaler route by one policy", None, "give one")
    cut = parse_window(window) if window is not None else None
    run = "autopilot" if autopilot else "reactive"
    return simulate_day(
        inv, trace, run, policy=policy, window=cut, seed=seed, calibrated=calibrated, plot=plot
    )
