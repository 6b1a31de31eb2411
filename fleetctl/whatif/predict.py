"""What-if: a fleet's deployments simulated on a trace, as figures two fleets compare by."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.fleet.prices import gpus_cost_per_hour, per_million_tokens, total
from fleetctl.model.calibration import Calibration
from fleetctl.routing.goodput import Slo
from fleetctl.routing.policy import RoutingConfig
from fleetctl.routing.scheduler import Aging
from fleetctl.sim.command import slo_in_force
from fleetctl.sim.fleet import Outcome, percentile, servers_from_plan, simulate
from fleetctl.sim.workload import WorkItem

# The JSON contract of each side of `what_if` (plan --what-if, apply --gate): exactly these.
KEYS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "e2e_p99_s",
    "slo_attainment",
    "gpus",
    "cost_per_hour",
    "cost_per_million_output_tokens",
)
DEFAULT_POLICY = "hardware-aware"  # route-serve's default


@dataclass(frozen=True)
class Figures:
    """One fleet on one trace. None: unknown (no request finished, no price, nothing runs)."""

    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    e2e_p99_s: float | None
    slo_attainment: float | None
    gpus: int
    cost_per_hour: float | None
    cost_per_million_output_tokens: float | None
    servers: int = 0  # servers simulated
    requests: int = 0
    served: int = 0  # requests that finished
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def runs_nothing(self) -> bool:
        return self.gpus == 0

    def to_json(self) -> dict[str, Any]:
        return {k: _round(getattr(self, k)) for k in KEYS}


def _round(v: float | int | None) -> float | int | None:
    return round(v, 6) if isinstance(v, float) else v


def what_if(
    inv: Inventory,
    deployments: Sequence[Deployment],
    traffic: Mapping[str, Sequence[WorkItem]],
    *,
    policy: str = DEFAULT_POLICY,
    calibration: Calibration | None = None,
    seed: int = 0,
    progress: Callable[[float], None] | None = None,
    slos: Mapping[str, Slo | None] | None = None,
) -> Figures:
    """Run `traffic` (per model, the trace's own arrivals) over `deployments` (the state's or
    a plan's) through the router's scheduler and `policy`, and sum it up.

    A request meets its model's SLO (`slos`, else `judged_by` with no plan applied) when it
    finished with TTFT and its own TPOT within it (a figure the SLO leaves out is met; a
    model no server could hold has none, and every request that finished meets it); one
    that never finished (no server of its model, refused, still queued at the horizon)
    misses. Latency percentiles are over finished
    requests. Deployments the inventory cannot describe (a model, format or GPU type it no
    longer has) count in GPUs and cost but are not simulated, and a note says so.
    `progress`, if given, hears the share of the requests simulated so far (0 to 1)."""
    notes: list[str] = []
    gpu_types = {n.gpu.name for n in inv.nodes}
    formats = {m.name: {v.format.name for v in m.variants} for m in inv.models}
    runnable = [
        d
        for d in deployments
        if d.gpu_type in gpu_types and d.variant in formats.get(d.model, set())
    ]
    if len(runnable) < len(deployments):
        left = sorted(
            {f"{d.model}/{d.variant} on {d.gpu_type}" for d in deployments}
            - {f"{d.model}/{d.variant} on {d.gpu_type}" for d in runnable}
        )
        notes.append(
            f"not simulated (not in the inventory): {len(deployments) - len(runnable)} "
            f"server(s) of {', '.join(left)}"
        )
    spec = inv.spec.router
    config = RoutingConfig.of(inv)
    aging = Aging(spec.aging.factor, spec.aging.window_s, spec.aging.enabled)
    if slos is None:
        slos = judged_by(inv, traffic, {}, calibration)
    outcomes: list[Outcome] = []
    met = 0
    servers = 0
    unrun = 0  # requests of a model no server runs
    everything = sum(len(items) for items in traffic.values()) or 1
    for model, items in traffic.items():
        hook = _share_of(progress, len(outcomes), len(items), everything)
        if not items:
            continue
        mine = servers_from_plan([d for d in runnable if d.model == model], inv, calibration)
        servers += len(mine)
        if not mine:
            if deployments:
                notes.append(f"{len(items)} request(s) of {model}: no server runs it")
            outcomes += [Outcome(w) for w in items]
            unrun += len(items)
            continue
        workload = inv.model(model).spec.workload if model in formats else None
        mean_out = round(sum(w.output for w in items) / len(items))
        estimate = {model: workload.mean_output_tokens if workload else mean_out}
        result = simulate(
            mine,
            list(items),
            policy,
            seed=seed,
            config=config,
            aging=aging,
            output_estimate=estimate,
            progress=hook,
        )
        met += sum(1 for o in result.outcomes if o.met(slos.get(model)))
        outcomes += result.outcomes
    done = [o for o in outcomes if o.done]
    ttft = sorted(o.ttft_s for o in done)
    tpot = sorted(t * 1000 for o in done if (t := o.tpot_s) is not None)
    e2e = sorted(o.finished - o.item.arrival for o in done)  # type: ignore[operator]
    gpus = sum(len(d.gpu_indices) for d in deployments)
    cost = total(_price(inv, d) for d in deployments)
    tokens = sum(o.item.output for o in done)
    last = max((o.finished or 0.0 for o in done), default=0.0)
    span = last - min((o.item.arrival for o in outcomes), default=0.0)
    rate = tokens / span if span and span > 0 else None
    if not deployments:
        notes.append("nothing runs yet: this fleet has no server")
    starved = len(outcomes) - len(done) - unrun
    if deployments and starved:
        notes.append(
            f"{starved} of {len(outcomes) - unrun} simulated request(s) did not finish "
            "(refused, or still queued when the simulation ended)"
        )
    return Figures(
        ttft_p50_s=_pct(ttft, 50),
        ttft_p99_s=_pct(ttft, 99),
        tpot_p50_ms=_pct(tpot, 50),
        tpot_p99_ms=_pct(tpot, 99),
        e2e_p99_s=_pct(e2e, 99),
        slo_attainment=met / len(outcomes) if outcomes and deployments else None,
        gpus=gpus,
        cost_per_hour=cost,
        cost_per_million_output_tokens=per_million_tokens(cost, rate) if deployments else None,
        servers=servers,
        requests=len(outcomes),
        served=len(done),
        notes=tuple(notes),
    )


def judged_by(
    inv: Inventory,
    traffic: Mapping[str, Sequence[WorkItem]],
    recorded: Mapping[str, Slo],
    calibration: Calibration | None = None,
) -> dict[str, Slo | None]:
    """Each model's SLO the what-if judges its requests by: the one `simulate` judges by on
    this traffic (the inventory's; else the applied plan's, `recorded` from state.json; else
    the one `plan --workload-from` derives from it), so a model that states none is judged by
    the objective route-serve holds it to, not met by every request that finishes."""
    known = {m.name for m in inv.models}
    return {
        model: slo_in_force(inv, model, list(items), recorded, calibration)
        for model, items in traffic.items()
        if model in known and items
    }


def _share_of(
    progress: Callable[[float], None] | None, before: int, n: int, everything: int
) -> Callable[[float], None] | None:
    """One model's share simulated, as the share of all the requests done."""
    if progress is None:
        return None
    return lambda share: progress((before + share * n) / everything)


def _price(inv: Inventory, d: Deployment) -> float | None:
    """A deployment's share of its node's price; a node gone from the inventory is priced by
    its GPU type's profile, when another node still has that type."""
    node = next((n for n in inv.nodes if n.name == d.node), None)
    if node is not None:
        return gpus_cost_per_hour(node, len(d.gpu_indices))
    gpu = next((n.gpu for n in inv.nodes if n.gpu.name == d.gpu_type), None)
    if gpu is None or gpu.cost_per_hour is None:
        return None
    return float(gpu.cost_per_hour) * len(d.gpu_indices)


def _pct(values: list[float], p: float) -> float | None:
    """The simulator's percentile of sorted values; None if none."""
    return percentile(values, p) if values else None


@dataclass(frozen=True)
class Verdict:
    """apply --gate's decision: the reasons it refuses (none: it passes) and notes."""

    reasons: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.reasons

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "reasons": list(self.reasons), "notes": list(self.notes)}


def judge(
    current: Figures,
    candidate: Figures,
    max_ttft_p99_rise: float,
    max_slo_drop: float,
    max_tpot_p99_rise: float = 0.10,
) -> Verdict:
    """Refuse a candidate whose p99 TTFT or p99 TPOT rises over the current's by more than
    `max_ttft_p99_rise` or `max_tpot_p99_rise` (relative: a plan that wins the first token
    and loses the decode has not won), or whose SLO attainment drops by more than
    `max_slo_drop` (absolute); a fleet that runs nothing yet cannot regress."""
    if current.runs_nothing:
        return Verdict((), ("nothing runs yet: there is nothing to regress from",))
    reasons = []
    now, then = current.ttft_p99_s, candidate.ttft_p99_s
    if now is not None:
        if then is None:
            reasons.append("p99 TTFT: the candidate finishes no request of the trace")
        elif then > now * (1 + max_ttft_p99_rise):
            reasons.append(
                f"p99 TTFT rises {now:.3g} s -> {then:.3g} s ({then / now - 1:+.0%}), "
                f"more than apply.gate.max_ttft_p99_rise {max_ttft_p99_rise:.0%}"
            )
    now, then = current.tpot_p99_ms, candidate.tpot_p99_ms
    if now is not None and then is not None and then > now * (1 + max_tpot_p99_rise):
        reasons.append(
            f"p99 TPOT rises {now:.3g} ms -> {then:.3g} ms ({then / now - 1:+.0%}), "
            f"more than apply.gate.max_tpot_p99_rise {max_tpot_p99_rise:.0%}"
        )
    a, b = current.slo_attainment, candidate.slo_attainment
    if a is not None and b is not None and a - b > max_slo_drop:
        reasons.append(
            f"SLO attainment drops {a:.1%} -> {b:.1%} ({(b - a) * 100:+.1f} points), "
            f"more than apply.gate.max_slo_drop {max_slo_drop * 100:.1f} points"
        )
    return Verdict(tuple(reasons))
