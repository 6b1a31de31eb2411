"""The autopilot run against the simulator: its decisions carried out as the simulated fleet's
controls, each change taking its seconds, over every model's traffic on one clock; and the
same fleet left static, or scaled by the field's reactive scaler, for comparison. The figures
are the fleet's: GPU-hours with a server awake, minutes in which every model met its
objectives, and the actions taken.

What runs at the start is the inventory's plan (every server awake). Each interval the
controller counts the requests that arrived in it per model, asks the autopilot for a
decision (the gate replays the last `GATE_INTERVALS` intervals), and turns the changes into
controls: servers that free GPUs for an arrival leave at once, arrivals begin at once and
serve after their seconds, servers that wait for the arrivals leave when the slowest is ready.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from fleetctl.autopilot.changes import Costs, Resident
from fleetctl.autopilot.decide import Autopilot, Decision, Settings
from fleetctl.autopilot.reactive import POLL_S, Reactive
from fleetctl.base.errors import Location, UserError
from fleetctl.base.tables import Cell, Col, Records
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.model.calibration import Calibration
from fleetctl.model.startup import wake_seconds, warmup_seconds
from fleetctl.planner import plan_fleet
from fleetctl.routing.goodput import Slo
from fleetctl.routing.policy import RoutingConfig
from fleetctl.sim.command import slo_in_force, write_day_plot
from fleetctl.sim.compare import mean_shape
from fleetctl.sim.controls import Control, Observation
from fleetctl.sim.fleet import Outcome, Server, SimResult, servers_from_plan, simulate
from fleetctl.sim.multi import MINUTE_S, gpus_by_owner, slo_minutes, timeline, trace_by_model
from fleetctl.sim.workload import WorkItem

GATE_INTERVALS = 5
# A node's host memory where nothing says it: twice its GPUs' memory, a common server build.
HOST_PER_GPU_MEMORY = 2


def sim_name(d: Deployment) -> str:
    """The simulated server of `d`: one name per GPU group and command."""
    digest = hashlib.blake2b("\0".join(d.vllm_args).encode(), digest_size=4).hexdigest()
    gpus = ",".join(map(str, d.gpu_indices))
    return f"{d.node}[{gpus}]:{d.model}:{digest}"


def default_costs(inv: Inventory, calibration: Calibration | None) -> Costs:
    """A start's seconds as apply would measure them (or the estimate), a wake's from the
    performance model, and each node's host memory at HOST_PER_GPU_MEMORY x its GPUs'."""
    nodes = {n.name: n for n in inv.nodes}
    gpus = {n.gpu.name: n.gpu for n in inv.nodes}

    def start_s(d: Deployment) -> float:
        s = d.server
        profile = inv.model(d.model).profile.name
        return warmup_seconds(
            calibration, d.gpu_type, profile, d.variant, s.tensor_parallel_size, s.weights_bytes
        )

    def wake_s(d: Deployment, level: int) -> float:
        s = d.server
        return wake_seconds(gpus[d.gpu_type], s.weights_bytes, s.tensor_parallel_size, level)

    def host_bytes(node: str) -> int:
        n = nodes.get(node)
        return 0 if n is None else HOST_PER_GPU_MEMORY * n.gpu.memory_bytes * n.gpu_count

    return Costs(start_s, wake_s, host_bytes)


@dataclass
class FleetDay:
    """One run over the traffic: per model its figures, and the fleet's."""

    name: str
    result: SimResult
    slos: dict[str, Slo | None]
    span_s: float
    decisions: list[Decision] = field(default_factory=list)

    def by_model(self) -> dict[str, SimResult]:
        out: dict[str, list[Any]] = {}
        for o in self.result.outcomes:
            out.setdefault(o.item.model, []).append(o)
        r = self.result
        return {
            m: SimResult(r.policy, outs, r.horizon, 0, 0, slo=self.slos.get(m))
            for m, outs in sorted(out.items())
        }

    def fleet(self) -> dict[str, Any]:
        models = self.by_model()
        share, minutes = slo_minutes(list(models.values()), self.span_s)
        awake = self.result.awake
        assert awake is not None
        gpus = gpus_by_owner(awake.per_minute(self.span_s, MINUTE_S), awake.owners)
        return {
            "gpu_hours": round(awake.gpu_hours(self.span_s), 3),
            "slo_minutes": round(share, 4),
            "minutes": minutes,
            "actions": dict(sorted(awake.actions.items())),
            "timeline": timeline(models, self.span_s, gpus),
        }

    def to_json(self) -> dict[str, Any]:
        models = {}
        for m, r in self.by_model().items():
            s = r.summary()
            keys = ("requests", "completed", "rejected", "slo_attainment", "ttft_p99_s")
            models[m] = {k: s[k] for k in (*keys, "tpot_p99_s")}
        return {"models": models, "fleet": self.fleet()}


def _merged(traffic: Mapping[str, Sequence[WorkItem]]) -> list[WorkItem]:
    items = sorted((w for ws in traffic.values() for w in ws), key=lambda w: (w.arrival, w.model))
    return [replace(w, id=i) for i, w in enumerate(items)]


def _config(
    inv: Inventory,
    servers: Sequence[Server],
    traffic: Mapping[str, Sequence[WorkItem]],
    calibration: Calibration | None,
) -> RoutingConfig:
    """The router's settings for a run, each model's objectives the ones it is judged by."""
    shapes = {m: mean_shape(ws) for m, ws in traffic.items() if ws}
    engines = [(s.model, s.perf, s.max_model_len) for s in servers]
    config = RoutingConfig.of(inv, engines, shapes)
    return replace(config, slo={**config.slo, **judged_slos(inv, traffic, calibration)})


def judged_slos(
    inv: Inventory, traffic: Mapping[str, Sequence[WorkItem]], calibration: Calibration | None
) -> dict[str, Slo]:
    """Each model's SLO a run plans, routes and judges by, as `simulate` judges it: the
    inventory's, else the one `plan --workload-from` derives from this traffic on every
    class that could serve the model (sim/command.py's slo_in_force). One derived from the
    servers a plan happened to place would move with the placement: a model placed on its
    fastest GPUs only would be held to their speed."""
    out = {}
    for m, items in traffic.items():
        if items and (slo := slo_in_force(inv, m, list(items), {}, calibration)) is not None:
            out[m] = slo
    return out


def _servers(inv: Inventory, ds: Sequence[Deployment], cal: Calibration | None) -> list[Server]:
    return [
        replace(s, name=sim_name(d))
        for d, s in zip(ds, servers_from_plan(ds, inv, cal), strict=True)
    ]


def run_static(
    inv: Inventory,
    traffic: Mapping[str, Sequence[WorkItem]],
    *,
    policy: str = "hardware-aware",
    calibration: Calibration | None = None,
    seed: int = 0,
) -> FleetDay:
    """The inventory's plan, every server awake throughout."""
    plan = plan_fleet(inv, None, calibration)
    servers = _servers(inv, plan.deployments, calibration)
    items = _merged(traffic)
    config = _config(inv, servers, traffic, calibration)
    result = simulate(servers, items, policy, seed=seed, config=config)
    span = max((w.arrival for w in items), default=0.0)
    return FleetDay("static", result, dict(config.slo), span)


def run_reactive(
    inv: Inventory,
    traffic: Mapping[str, Sequence[WorkItem]],
    *,
    policy: str = "hardware-aware",
    calibration: Calibration | None = None,
    seed: int = 0,
    floor: int = 1,
) -> FleetDay:
    """The field's reactive scaler (autopilot/reactive.py) over the inventory's plan: each
    model's servers started and stopped on its waiting requests."""
    plan = plan_fleet(inv, None, calibration)
    servers = _servers(inv, plan.deployments, calibration)
    costs = default_costs(inv, calibration)
    by_name = {sim_name(d): d for d in plan.deployments}
    owned: dict[str, list[str]] = {}
    for d in plan.deployments:
        owned.setdefault(d.model, []).append(sim_name(d))
    scaler = Reactive(owned, lambda n: costs.start_s(by_name[n]), floor=floor)
    items = _merged(traffic)
    config = _config(inv, servers, traffic, calibration)
    result = simulate(
        servers, items, policy, seed=seed, config=config, controller=scaler, tick_s=POLL_S
    )
    span = max((w.arrival for w in items), default=0.0)
    return FleetDay("reactive", result, dict(config.slo), span)


def run_autopilot(
    inv: Inventory,
    traffic: Mapping[str, Sequence[WorkItem]],
    settings: Settings = Settings(),
    *,
    policy: str = "hardware-aware",
    calibration: Calibration | None = None,
    seed: int = 0,
    costs: Costs | None = None,
) -> FleetDay:
    """The autopilot moving the inventory's fleet through the traffic."""
    start = plan_fleet(inv, None, calibration)
    servers = _servers(inv, start.deployments, calibration)
    config = _config(inv, servers, traffic, calibration)
    pilot = Autopilot(
        inv,
        costs or default_costs(inv, calibration),
        settings,
        [Resident(d) for d in start.deployments],
        calibration,
        {m: slo for m, slo in config.slo.items() if slo is not None},
    )
    items = _merged(traffic)
    decisions: list[Decision] = []
    seen = 0

    def controller(o: Observation) -> list[Control]:
        nonlocal seen
        if o.now <= 0:
            return []
        arrived: Sequence[Any] = o.arrived
        counts: dict[str, float] = {}
        fresh: dict[str, list[WorkItem]] = {}
        for w in arrived[seen:]:
            counts[w.model] = counts.get(w.model, 0.0) + 1
            fresh.setdefault(w.model, []).append(w)
        seen = len(arrived)
        pilot.residents = woken_by_router(pilot.residents, o.states)
        met: dict[str, tuple[int, int]] = {}
        for out in o.finished:
            assert isinstance(out, Outcome)
            good, total = met.get(out.item.model, (0, 0))
            ok = out.met(config.slo.get(out.item.model))
            met[out.item.model] = (good + ok, total + 1)
        pilot.record(counts, met, fresh)
        since = o.now - GATE_INTERVALS * settings.interval_s
        recent: dict[str, list[WorkItem]] = {}
        # Arrivals are in time order: only the last intervals' are read, not the whole day's.
        for w in arrived[bisect.bisect_left(arrived, since, key=lambda w: w.arrival) :]:
            mine = recent.setdefault(w.model, [])
            mine.append(replace(w, id=len(mine), arrival=w.arrival - since))
        decision = pilot.decide(o.now, recent)
        decisions.append(decision)
        pilot.carried_out(decision)
        return _controls(inv, decision, o.now, calibration, pilot.costs)

    result = simulate(
        servers,
        items,
        policy,
        seed=seed,
        config=config,
        controller=controller,
        tick_s=settings.interval_s,
    )
    span = max((w.arrival for w in items), default=0.0)
    return FleetDay("autopilot", result, dict(config.slo), span, decisions)


def woken_by_router(residents: Sequence[Resident], states: Mapping[str, str]) -> list[Resident]:
    """The residents as the fleet has them: a sleeper the router woke (its model had no
    awake server, or every awake one would miss) is awake again, for the autopilot to keep
    or put back to sleep like any other."""
    up = {n for n, s in states.items() if s in ("awake", "waking")}
    return [
        Resident(r.deployment) if not r.awake and sim_name(r.deployment) in up else r
        for r in residents
    ]


def _controls(
    inv: Inventory,
    decision: Decision,
    now: float,
    calibration: Calibration | None,
    costs: Costs,
) -> list[Control]:
    """A decision's changes as controls: leave, arrive, then leave after the arrivals. A
    sleep carries its wake's seconds: the router may wake the server itself."""
    arrivals = [c for c in decision.changes if c.kind in ("start", "wake")]
    ready = now + max((c.seconds for c in arrivals), default=0.0)
    out = []
    for c in decision.changes:
        name = sim_name(c.deployment)
        if c.kind in ("start", "wake"):
            new = _servers(inv, [c.deployment], calibration)[0] if c.kind == "start" else None
            out.append(Control(now, name, c.kind, c.seconds, new))
        else:
            wake_s = costs.wake_s(c.deployment, c.level) if c.kind == "sleep" else None
            out.append(Control(ready if c.after else now, name, c.kind, wake_s=wake_s))
    return out


RUNS = ("autopilot", "reactive", "static")


def simulate_day(
    inv: Inventory,
    trace: Path,
    run: str,
    *,
    policy: str = "hardware-aware",
    window: tuple[float, float] | None = None,
    seed: int = 0,
    calibrated: bool = True,
    plot: Path | None = None,
) -> tuple[dict[str, Any], RenderableType]:
    """`simulate --autopilot` / `--scaler reactive`: every model of a multi-model trace on the
    inventory's fleet, moved by `run`; its JSON (each model's figures, the fleet's
    gpu_hours, slo_minutes and actions by kind, and its minute-by-minute timeline) and its
    table; `plot`: the day's picture written there (sim/dayplot.py)."""
    from fleetctl.fleet.statedir import StateDir

    traffic = trace_by_model(trace, [m.name for m in inv.models], window)
    if not traffic:
        raise UserError("the trace has no requests", Location(str(trace)), "check the file")
    calibration = StateDir.of(inv).load_calibration() if calibrated else None
    if run == "autopilot":
        day = run_autopilot(inv, traffic, policy=policy, calibration=calibration, seed=seed)
    elif run == "reactive":
        day = run_reactive(inv, traffic, policy=policy, calibration=calibration, seed=seed)
    else:
        day = run_static(inv, traffic, policy=policy, calibration=calibration, seed=seed)
    data = {"run": run, "policy": policy, **day.to_json(), "span_s": round(day.span_s, 3)}
    if day.decisions:
        data["decisions"] = [d.to_json() for d in day.decisions if d.changes or d.held]
    fleet = data["fleet"]
    rows: list[list[Cell]] = [
        [m, f"{v['requests']:,}", f"{v['slo_attainment']:.1%}"] for m, v in data["models"].items()
    ]
    acts = ", ".join(f"{n} {k}" for k, n in fleet["actions"].items()) or "none"
    table = Records(
        f"The fleet moved by the {run} over {day.span_s / 3600:.2f} h: "
        f"{fleet['gpu_hours']:,.1f} GPU-hours, {fleet['slo_minutes']:.1%} of minutes within "
        f"the objectives; actions: {acts}",
        [Col("model", head=True), Col("requests", numeric=True), Col("SLO met", numeric=True)],
        rows,
        caption="minutes within the objectives: one-minute windows in which every model's "
        "requests met both objectives for its SLO's share",
    )
    if plot is None:
        return data, Group(table)
    title = f"{Path(inv.path).stem}: every model of {trace.name} moved by the {run}"
    line = write_day_plot(plot, title, [(f"{run}, {policy} routing", fleet)])
    data["plot"] = str(plot)
    return data, Group(table, Text(line))
