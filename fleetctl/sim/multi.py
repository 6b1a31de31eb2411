"""Every model of an inventory on one fleet over a multi-model trace: each model's requests on
the servers the plan gives it, and the fleet's figures over the run (GPU-hours with a server
awake, and the share of one-minute windows in which every model meets its objectives)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fleetctl.base.errors import Location, UserError
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Plan
from fleetctl.fleet.slo import Slo
from fleetctl.model.calibration import Calibration
from fleetctl.routing.scheduler import Aging
from fleetctl.sim.compare import Comparison, compare
from fleetctl.sim.fleet import SimResult, servers_from_plan
from fleetctl.sim.workload import WorkItem, trace_files, trace_row

MINUTE_S = 60.0


def trace_by_model(
    path: Path, models: Sequence[str], window: tuple[float, float] | None = None
) -> dict[str, list[WorkItem]]:
    """Each model's requests of a JSONL trace whose rows name their model (route-serve's
    request log, or a scenario), on one clock: arrivals count from the trace's first request,
    whichever model it was for. A row that names no model, or a model the inventory does not
    serve, is an error: the fleet's figures would leave its requests out."""
    known = set(models)
    rows: list[WorkItem] = []
    for f in trace_files(path):
        with f.open(encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = Location(str(f), line_no)
                try:
                    row = json.loads(line)
                    named = row.get("model") if isinstance(row, dict) else None
                    if not isinstance(named, str):
                        raise UserError(
                            "this trace row names no model",
                            where,
                            "simulate one model's traffic with --model, or give every row a "
                            '"model"',
                        )
                    if named not in known:
                        raise UserError(
                            f"the trace has requests for '{named}', which the inventory does "
                            "not serve",
                            where,
                            f"add it to the inventory, or cut its rows (it serves "
                            f"{', '.join(sorted(known))})",
                        )
                    item = trace_row(row, named)
                except (ValueError, KeyError, TypeError, AttributeError):
                    raise UserError(
                        f"bad trace row {line.strip()[:80]!r}",
                        where,
                        "expected JSON with model, timestamp (ms), input_length and output_length",
                    ) from None
                if item is not None:
                    rows.append(item)
    rows.sort(key=lambda w: w.arrival)
    if not rows:
        return {}
    start = rows[0].arrival + (window[0] if window else 0.0)
    end = rows[0].arrival + window[1] if window else math.inf
    out: dict[str, list[WorkItem]] = {}
    for w in rows:
        if start <= w.arrival < end:
            mine = out.setdefault(w.model, [])
            mine.append(replace(w, id=len(mine), arrival=w.arrival - start))
    return out


@dataclass(frozen=True)
class Minutes:
    """The run's one-minute windows: per model (in the order given) the requests that arrived
    in each and those that met its objectives, and whether the window held for every model."""

    arrived: list[list[int]]
    met: list[list[int]]
    held: list[bool]


def judge_minutes(results: Sequence[SimResult], span_s: float) -> Minutes:
    """Each one-minute window judged: it holds when every model's requests arriving in it met
    its objectives for at least its SLO's share. A window in which a model had no requests
    holds for that model; a model without an SLO holds when served."""
    minutes = max(1, math.ceil(span_s / MINUTE_S))
    arrived: list[list[int]] = []
    met: list[list[int]] = []
    for r in results:
        a, m = [0] * minutes, [0] * minutes
        for o in r.outcomes:
            k = min(minutes - 1, int(o.item.arrival // MINUTE_S))
            a[k] += 1
            if o.met(r.slo):
                m[k] += 1
        arrived.append(a)
        met.append(m)
    held = [
        all(
            a[k] == 0 or m[k] >= (r.slo.share if r.slo is not None else 1.0) * a[k] - 1e-9
            for r, a, m in zip(results, arrived, met, strict=True)
        )
        for k in range(minutes)
    ]
    return Minutes(arrived, met, held)


def slo_minutes(results: Sequence[SimResult], span_s: float) -> tuple[float, int]:
    """(share of the run's one-minute windows that held (judge_minutes), how many windows)."""
    held = judge_minutes(results, span_s).held
    return sum(held) / len(held), len(held)


# Per model, per role: (GPUs awake, GPUs asleep) in each minute.
GpuSeries = Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]]


def timeline(results: Mapping[str, SimResult], span_s: float, gpus: GpuSeries) -> dict[str, Any]:
    """The run minute by minute, as the JSON carries it and the day's plot draws it: per model
    the requests that arrived and those within its objectives (the windows slo_minutes
    counts), whether each minute held, and per model and role the GPUs awake and asleep."""
    judged = judge_minutes(list(results.values()), span_s)
    return {
        "minute_s": MINUTE_S,
        "minutes": len(judged.held),
        "held": judged.held,
        "models": {
            m: {
                "requests": a,
                "met": mt,
                "slo_share": r.slo.share if r.slo is not None else None,
            }
            for (m, r), a, mt in zip(results.items(), judged.arrived, judged.met, strict=True)
        },
        "gpus": {
            m: {
                role: {"awake": [round(v, 3) for v in up], "asleep": [round(v, 3) for v in down]}
                for role, (up, down) in sorted(roles.items())
            }
            for m, roles in sorted(gpus.items())
        },
    }


def gpus_by_owner(
    per_server: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    owners: Mapping[str, tuple[str, str]],
) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """Servers' (awake, asleep) GPU series summed per model and role."""
    out: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for name, (up, down) in per_server.items():
        model, role = owners[name]
        have = out.setdefault(model, {}).get(role)
        if have is None:
            out[model][role] = (list(up), list(down))
        else:
            out[model][role] = (
                [x + y for x, y in zip(have[0], up, strict=True)],
                [x + y for x, y in zip(have[1], down, strict=True)],
            )
    return out


@dataclass
class FleetRun:
    """A multi-model run: each model's comparison, and the fleet they share."""

    comparisons: dict[str, Comparison]
    gpus: int  # GPUs with a server on them (a static plan keeps every one awake)
    span_s: float  # from the first arrival to the last, whichever model
    # GPUs per model and role, every one awake throughout: the timeline's GPU series.
    groups: dict[str, dict[str, int]] = field(default_factory=dict)

    def fleet(self, policy: str) -> dict[str, Any]:
        """The fleet's figures under one routing policy (every model routed by it)."""
        results = {m: c.results[policy] for m, c in self.comparisons.items()}
        share, minutes = slo_minutes(list(results.values()), self.span_s)
        series = {
            m: {role: ([float(n)] * minutes, [0.0] * minutes) for role, n in roles.items()}
            for m, roles in self.groups.items()
        }
        return {
            "gpu_hours": round(self.gpus * self.span_s / 3600, 3),
            "slo_minutes": round(share, 4),
            "minutes": minutes,
            "actions": {},  # a static plan changes nothing while it runs
            "timeline": timeline(results, self.span_s, series),
        }

    def to_json(self, policies: Sequence[str]) -> dict[str, Any]:
        return {
            "models": {m: c.to_json() for m, c in self.comparisons.items()},
            "fleet": {p: self.fleet(p) for p in policies},
            "gpus": self.gpus,
            "span_s": round(self.span_s, 3),
        }


def run_models(
    inv: Inventory,
    plan: Plan,
    traffic: dict[str, list[WorkItem]],
    policies: Sequence[str],
    *,
    slos: Mapping[str, Slo | None] | None = None,
    seed: int = 0,
    aging: Aging | None = None,
    calibration: Calibration | None = None,
    progress: Callable[[float, str], None] | None = None,
) -> FleetRun:
    """Simulate each model's traffic on its servers of `plan`, every policy, one clock;
    `slos`: the objectives each model is judged by (None: compare derives them)."""
    placed = {d.model for d in plan.deployments}
    missing = sorted(m for m in traffic if m not in placed)
    if missing:
        raise UserError(
            f"the plan places no server for {', '.join(missing)}, which the trace sends "
            "requests to",
            Location(str(inv.path)),
            "run `fleetctl plan` to see why",
        )
    servers = servers_from_plan(plan.deployments, inv, calibration)
    gpus = sum(s.perf.tp for s in servers)
    span = max((w.arrival for items in traffic.values() for w in items), default=0.0)
    comparisons: dict[str, Comparison] = {}
    for k, (model, items) in enumerate(sorted(traffic.items())):
        hook = None
        if progress is not None:

            def hook(done: float, what: str, k: int = k, model: str = model) -> None:
                progress(k * len(policies) + done, f"{model}: {what}")

        comparisons[model] = compare(
            inv,
            plan,
            model,
            items,
            policies,
            seed=seed,
            aging=aging,
            calibration=calibration,
            progress=hook,
            slo=(slos or {}).get(model),
        )
    groups: dict[str, dict[str, int]] = {}
    for s in servers:
        roles = groups.setdefault(s.model, {})
        roles[s.role] = roles.get(s.role, 0) + s.perf.tp
    return FleetRun(comparisons, gpus, span, groups)
