"""A cost plan checked by the simulator against each model's SLO, re-solved with more capacity
for a model that misses it, until it holds or the fleet can give no more.

The cost objective sizes capacity from a workload's rate and mean shape (capacity x
target_utilization >= requests_per_s, the SLO capping each server's batch), which says
nothing about tails: a trace's bursts, long prompts queued behind each other, a batch that
grows when requests pile up. So every plan it makes is run through the simulator, the
router's own policy over the planner's servers (fleetctl.whatif.predict), on the model's traffic:
the trace's own arrivals when the workload came from one (`plan --workload-from`), else
Poisson arrivals at the workload's rate with lognormal lengths around its means. A model
whose simulated p99 TTFT or TPOT misses its SLO gets `headroom` (its workload is asked for
times that) raised by how far it missed, clamped to [MIN_STEP, MAX_STEP] since latency is not
linear in capacity near saturation, and the MILP solves again. Once a model meets its SLO,
its headroom is bisected back toward the last one that missed, since a doubling overshoots.
It stops after MAX_ROUNDS, when nothing is left to narrow, or when a missing model's capacity
no longer grows (the fleet has nothing more that model can use). The cheapest plan that met
every SLO is the answer; where none did, the last one, saying which SLO fails and by how much.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from fleetctl.fleet.inventory import Inventory, Model
from fleetctl.fleet.plan import Plan, SloCheck
from fleetctl.model.calibration import Calibration
from fleetctl.sim.workload import Synthetic, WorkItem
from fleetctl.whatif.predict import what_if

MAX_ROUNDS = 8
MIN_STEP = 1.15  # the least a missing model's headroom grows by in one round
MAX_STEP = 2.0
NARROW_TO = 1.15  # bisect between a missed and a met headroom until their ratio is below this
SYNTHETIC_REQUESTS = 1500  # per model, where no trace is given
SYNTHETIC_SPAN_S = (120.0, 1800.0)  # at least two minutes, at most half an hour of arrivals


def slo_models(inv: Inventory) -> list[Model]:
    """The models a plan can be checked for: an SLO with a figure, and a workload."""
    return [
        m
        for m in inv.models
        if m.spec.slo is not None
        and (m.spec.slo.ttft_p99_s is not None or m.spec.slo.tpot_p99_ms is not None)
        and m.spec.workload is not None
    ]


def synthetic_traffic(m: Model, seed: int = 0) -> list[WorkItem]:
    """Poisson arrivals at the model's workload rate, lognormal lengths around its means,
    capped at its max_context: about SYNTHETIC_REQUESTS requests. A workload with length
    buckets draws each bucket's share of the rate around its own means, capped at its
    longest request, so the check sees the mix the MILP sized."""
    w = m.spec.workload
    assert w is not None
    lo, hi = SYNTHETIC_SPAN_S
    span = min(hi, max(lo, SYNTHETIC_REQUESTS / w.requests_per_s))
    slices = [
        (b.share, b.mean_prompt_tokens, b.mean_output_tokens, min(b.max_tokens, m.spec.max_context))
        for b in w.buckets
    ] or [(1.0, w.mean_prompt_tokens, w.mean_output_tokens, m.spec.max_context)]
    items: list[WorkItem] = []
    for i, (share, prompt, output, cap) in enumerate(slices):
        spec = Synthetic(
            model=m.name,
            rate=w.requests_per_s * share,
            duration=span,
            prompt=prompt,
            output=output,
            max_context=cap,
        )
        items += spec.generate(seed + i)
    items.sort(key=lambda it: it.arrival)
    return [dataclasses.replace(it, id=i) for i, it in enumerate(items)]


def check(
    inv: Inventory,
    plan: Plan,
    m: Model,
    items: Sequence[WorkItem],
    headroom: float,
    traffic: str,
    calibration: Calibration | None = None,
) -> SloCheck:
    """Model `m`'s simulated p99 tails on `plan`'s servers of it, against its SLO."""
    slo = m.spec.slo
    assert slo is not None
    mine = [d for d in plan.deployments if d.model == m.name]
    figures = what_if(inv, mine, {m.name: items}, calibration=calibration)
    return SloCheck(
        m.name,
        slo.ttft_p99_s,
        slo.tpot_p99_ms,
        figures.ttft_p99_s,
        figures.tpot_p99_ms,
        len(items),
        headroom,
        traffic,
    )


def plan_within_slos(
    inv: Inventory,
    plan_once: Callable[[Mapping[str, float]], Plan],
    traces: Mapping[str, Sequence[WorkItem]] | None = None,
    calibration: Calibration | None = None,
    seed: int = 0,
) -> Plan:
    """The plan `plan_once(headroom)` makes, with each SLO model's headroom raised until the
    simulator finds its SLO met, then narrowed back (geometric bisection between the last
    headroom that missed and the first that met) while rounds are left; the cheapest plan
    that meets every SLO wins. `traces` gives a model's traffic (its trace's requests); a
    model without one is checked on synthetic traffic. See the module's notes."""
    models = slo_models(inv)
    headroom = {m.name: 1.0 for m in inv.models}
    plan = plan_once(headroom)
    if not models:
        return plan
    traffic: dict[str, tuple[str, Sequence[WorkItem]]] = {}
    for m in models:
        given = (traces or {}).get(m.name)
        traffic[m.name] = ("trace", given) if given else ("synthetic", synthetic_traffic(m, seed))
    missed: dict[str, float] = {}  # per model, the largest headroom it missed at
    met: dict[str, float] = {}  # and the smallest it met at
    stuck: set[str] = set()
    best: tuple[Plan, list[SloCheck]] | None = None
    last: tuple[Plan, list[SloCheck]]
    rounds = 0
    while True:
        rounds += 1
        checks = [
            check(
                inv, plan, m, traffic[m.name][1], headroom[m.name], traffic[m.name][0], calibration
            )
            for m in models
        ]
        last = (plan, checks)
        for c in checks:
            if c.met:
                met[c.model] = min(met.get(c.model, c.headroom), c.headroom)
            else:
                missed[c.model] = max(missed.get(c.model, c.headroom), c.headroom)
        if all(c.met for c in checks) and (best is None or _cheaper(plan, best[0])):
            best = (plan, checks)
        if rounds >= MAX_ROUNDS:
            break
        wanted = dict(headroom)
        for c in checks:
            if c.model in stuck:
                continue
            if c.model not in met:  # still growing
                wanted[c.model] = c.headroom * _step(c)
            elif c.model in missed and met[c.model] / missed[c.model] > NARROW_TO:
                wanted[c.model] = (met[c.model] * missed[c.model]) ** 0.5
            else:
                wanted[c.model] = met[c.model]
        if wanted == headroom:
            break  # every model met at its narrowest, or stuck
        before = _capacity(plan)
        headroom = wanted
        plan = plan_once(headroom)
        after = _capacity(plan)
        # A model that still misses and asked for more but got none: the fleet is out of
        # GPUs it can use (or of those the other models leave it).
        for c in checks:
            grew = after.get(c.model, 0.0) > before.get(c.model, 0.0) * (1 + 1e-9)
            if not c.met and c.model not in met and not grew:
                stuck.add(c.model)
    plan, checks = best if best is not None else last
    warnings = [
        f"{c.model} misses its SLO in simulation on this plan: {'; '.join(c.misses)}, with "
        f"capacity for {c.headroom:.2f}x its workload ({c.requests} {c.traffic} requests); "
        + (
            "the fleet has no more GPUs this model can use"
            if c.model in stuck
            else f"still missed after {rounds} rounds"
        )
        for c in checks
        if not c.met
    ]
    solver = {**plan.solver, "slo_rounds": rounds}
    return dataclasses.replace(
        plan,
        slo_checks=tuple(checks),
        warnings=(*warnings, *plan.warnings),
        solver=solver,
    )


def _cheaper(a: Plan, b: Plan) -> bool:
    """Whether plan `a` costs less per hour than `b` (GPUs used, where a price is unknown)."""
    ca, cb = a.cost_per_hour, b.cost_per_hour
    if ca is None or cb is None:
        return sum(m.gpus for m in a.models) < sum(m.gpus for m in b.models)
    return ca < cb - 1e-9


def _step(c: SloCheck) -> float:
    """How much more capacity to ask for: the worst miss's ratio, clamped."""
    ratios = [
        got / want
        for got, want in (
            (c.ttft_p99_s, c.slo_ttft_p99_s),
            (c.tpot_p99_ms, c.slo_tpot_p99_ms),
        )
        if want is not None and got is not None
    ]
    worst = max(ratios, default=MAX_STEP)  # nothing finished: as much as a round allows
    return min(MAX_STEP, max(MIN_STEP, worst))


def _capacity(plan: Plan) -> dict[str, float]:
    return {s.model: s.capacity_rps for s in plan.models}
