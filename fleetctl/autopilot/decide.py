"""One autopilot decision per interval: forecast each model's traffic, re-plan the fleet for it
at the lowest cost that keeps each SLO, and the changes from what runs, held back by
hysteresis, a change budget and floors, and gated by a what-if replay.

The plan is `plan_fleet` with the cost objective, the state of what runs as its input (a
replica that stays is preferred to a move, planner/place.py) and each model's workload at its
forecast's band (`Forecast.high`) per second, and the lengths, length buckets and
burstiness of the model's last SHAPE_WINDOW requests (the inventory's until MIN_SHAPE have
arrived): a plan sized for the inventory's guess at the shapes keeps no promise on traffic
whose prompts are twice as long. What the plan asks for arrives at once; what it
lets go leaves only after `down_after` intervals in a row without it (a burst's tail is not a
reason to sleep a server that the next minute needs). Each hour allows `moves_per_hour`
starts and wakes. Every decision is kept with its figures (`Decision.to_json`), for the audit
log.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetctl.autopilot.changes import Change, Costs, Resident, changes, overlaps, same_server
from fleetctl.autopilot.forecast import Forecast, forecast
from fleetctl.fleet.inventory import Inventory, SloSpec, WorkloadSpec
from fleetctl.fleet.plan import Deployment, Plan
from fleetctl.fleet.slo import DEFAULT_SHARE, Slo
from fleetctl.fleet.state import State
from fleetctl.model.calibration import Calibration
from fleetctl.planner import plan_fleet
from fleetctl.sim.traffic import BUCKETS
from fleetctl.sim.workload import WorkItem, spec_of
from fleetctl.whatif.predict import what_if
from fleetctl.whatif.slo_check import plan_within_slos

RATE_FLOOR = 1e-3  # req/s: the planner needs a positive rate for a model with no traffic
# Requests a model's attainment is judged by: a model with fewer in an interval is judged
# once its intervals together have finished this many (a 70B at 10 requests a minute missing
# one in thirty was never judged, so never corrected).
MIN_JUDGED = 20
HEADROOM_STEP = 1.5
HEADROOM_DECAY = 0.98
MAX_HEADROOM = 4.0
# Each model's recent requests its plan takes the lengths and burstiness from: enough for a
# p99 and for burstiness's windows of 100 requests, recent enough to follow a change of mix.
MOVES_PER_GROUP = 2
MIN_MOVES = 30
SHAPE_WINDOW = 2000
MIN_SHAPE = 100


@dataclass(frozen=True)
class Settings:
    """How the autopilot moves the fleet."""

    interval_s: float = 60.0
    down_after: int = 5  # intervals a model must not need a server before it leaves
    # Starts and wakes in any hour; None: MOVES_PER_GROUP per GPU group the fleet starts
    # with, at least MIN_MOVES (one swing of a fleet of one-GPU servers must not spend an
    # hour's budget).
    moves_per_hour: int | None = None
    floor: int = 1  # awake servers each model keeps, whatever its traffic
    gate: bool = True  # replay the recent traffic on the new fleet before moving
    # Every this many intervals the plan is checked by the simulator on the recent traffic
    # (as `plan` checks a cost plan; 0: never); the headroom each model needed then sizes the
    # plans between, since a check costs seconds of simulation per model and the shapes
    # move by the hour, not the minute.
    check_every: int = 10


@dataclass
class Decision:
    """What the autopilot decided at `at`, and from what."""

    at: float
    forecasts: dict[str, Forecast]
    target: list[Deployment]
    changes: list[Change]
    held: list[str] = field(default_factory=list)  # why changes were held back

    def to_json(self) -> dict[str, Any]:
        servers: dict[str, int] = {}
        for d in self.target:
            servers[d.model] = servers.get(d.model, 0) + 1
        return {
            "at_s": round(self.at, 3),
            "forecast": {m: f.to_json() for m, f in self.forecasts.items()},
            "servers": servers,
            "changes": [c.to_json() for c in self.changes],
            "held": self.held,
        }


def at_rate(items: Sequence[WorkItem], rate: float) -> list[WorkItem]:
    """`items` (in arrival order) with their times stretched or squeezed to arrive at
    `rate` per second: the same requests and bursts, at the traffic the plan is for."""
    span = items[-1].arrival - items[0].arrival
    if span <= 0 or rate <= 0:
        return list(items)
    k = (len(items) - 1) / span / rate
    t0 = items[0].arrival
    return [dataclasses.replace(w, id=i, arrival=(w.arrival - t0) * k) for i, w in enumerate(items)]


class Autopilot:
    """The decisions of one fleet over time: what it has seen, what runs, what it did."""

    def __init__(
        self,
        inv: Inventory,
        costs: Costs,
        settings: Settings = Settings(),
        residents: Sequence[Resident] = (),
        calibration: Calibration | None = None,
        slos: Mapping[str, Slo] | None = None,
    ) -> None:
        self.inv, self.costs, self.settings = inv, costs, settings
        self.calibration = calibration
        self.residents = list(residents)
        self.groups = len({r.deployment.key for r in self.residents})
        self.history: dict[str, list[float]] = {m.name: [] for m in inv.models}
        self.unneeded: dict[int, int] = {}  # id of an awake deployment -> intervals unneeded
        self.moves: deque[float] = deque()  # times of recent starts and wakes
        self.headroom: dict[str, float] = {}  # per model: traffic planned for / forecast
        self.checked: dict[str, float] = {}  # per model: headroom its last check needed
        self.unjudged: dict[str, tuple[int, int]] = {}  # per model: (met, finished) pending
        self.plans = 0
        self.shapes: dict[str, deque[WorkItem]] = {
            m.name: deque(maxlen=SHAPE_WINDOW) for m in inv.models
        }
        # The SLO each model is planned and judged by (the gate's what-if too): `slos` where
        # the caller judges by them (a simulated run: the traffic's), else the inventory's,
        # else the one its first plan derived (the one route-serve judges by).
        self.judged = dict(slos) if slos is not None else plan_fleet(inv, None, calibration).slos
        self.slos = {
            name: SloSpec(
                ttft_p99_s=slo.ttft_s,
                tpot_p99_ms=None if slo.tpot_s is None else slo.tpot_s * 1000,
                share=slo.share,
            )
            for name, slo in self.judged.items()
        }

    def record(
        self,
        counts: Mapping[str, float],
        met: Mapping[str, tuple[int, int]] | None = None,
        arrived: Mapping[str, Sequence[WorkItem]] | None = None,
    ) -> None:
        """One interval's requests per model (a model left out had none), those requests
        where known (`arrived`: their lengths and times shape the next plans), and, where known,
        how many of the requests that finished in it met the model's objectives, of how many
        (the router's attainment metrics). A model that missed its SLO's share is planned for
        HEADROOM_STEP times more traffic next time, up to MAX_HEADROOM; one that met it gives
        a little of that back (HEADROOM_DECAY): the measured correction of the planner's
        figures (Dynamo's planner corrects by measured over expected TTFT). A model is judged
        on at least MIN_JUDGED requests, its quiet intervals together."""
        for name, series in self.history.items():
            series.append(float(counts.get(name, 0.0)))
        for name, items in (arrived or {}).items():
            if name in self.shapes:
                self.shapes[name].extend(items)
        for name, (good, total) in (met or {}).items():
            pending = self.unjudged.pop(name, (0, 0))
            good, total = good + pending[0], total + pending[1]
            if total < MIN_JUDGED:
                self.unjudged[name] = (good, total)
                continue
            model = next((m for m in self.inv.models if m.name == name), None)
            share = model.spec.slo.share if model and model.spec.slo else DEFAULT_SHARE
            h = self.headroom.get(name, 1.0)
            if good < share * total:
                h = min(MAX_HEADROOM, h * HEADROOM_STEP)
            else:
                h = max(1.0, h * HEADROOM_DECAY)
            self.headroom[name] = h

    @property
    def budget(self) -> int:
        """Starts and wakes allowed in any hour."""
        n = self.settings.moves_per_hour
        return n if n is not None else max(MIN_MOVES, MOVES_PER_GROUP * self.groups)

    def awake(self) -> list[Deployment]:
        return [r.deployment for r in self.residents if r.awake]

    def decide(
        self, now: float, recent: Mapping[str, Sequence[WorkItem]] | None = None
    ) -> Decision:
        """The next interval's fleet. `recent`: each model's requests of the last intervals,
        replayed on the new fleet by the gate (no gate without them)."""
        s = self.settings
        forecasts = {m: forecast(series) for m, series in self.history.items() if series}
        planned = self._wake_first(self._plan(forecasts, recent), forecasts)
        target, held = self._hold(planned)
        steps = changes(self.residents, target, self.costs)
        steps, uncovered = self._covered(steps, forecasts)
        steps, over = self._budget(now, steps)
        held += uncovered + over
        if steps and s.gate and recent:
            why = self._gate(target, recent, forecasts)
            if why:
                return Decision(now, forecasts, self.awake(), [], [*held, why])
        return Decision(now, forecasts, target, steps, held)

    def carried_out(self, decision: Decision) -> None:
        """What runs after `decision`'s changes (the caller carried them out)."""
        by_kind = {"sleep": [], "stop": [], "wake": [], "start": []}  # type: dict[str, list[Change]]
        for c in decision.changes:
            by_kind[c.kind].append(c)
            if c.kind in ("start", "wake"):
                self.moves.append(decision.at)
        kept: list[Resident] = []
        for r in self.residents:
            d = r.deployment
            if any(same_server(c.deployment, d) for c in by_kind["stop"]):
                continue
            slept = next((c for c in by_kind["sleep"] if same_server(c.deployment, d)), None)
            woken = any(same_server(c.deployment, d) for c in by_kind["wake"])
            if slept is not None:
                kept.append(Resident(d, slept.level))
            elif woken:
                kept.append(Resident(d))
            else:
                kept.append(r)
        kept += [Resident(c.deployment) for c in by_kind["start"]]
        self.residents = kept
        # A server counts its unneeded intervals afresh each time it is awake again.
        awake = {id(r.deployment) for r in kept if r.awake}
        self.unneeded = {k: n for k, n in self.unneeded.items() if k in awake}
        for c in (*by_kind["wake"], *by_kind["start"]):
            self.unneeded.pop(id(c.deployment), None)

    # --- the steps ------------------------------------------------------------------------

    def _plan(
        self,
        forecasts: Mapping[str, Forecast],
        recent: Mapping[str, Sequence[WorkItem]] | None = None,
    ) -> list[Deployment]:
        """The cheapest fleet for the forecasts, from what runs (state), checked by the
        simulator as `plan` checks a cost plan (whatif/slo_check.py): on each model's recent
        requests replayed at the forecast's rate, its arrivals' bursts and lengths as they
        came; more capacity for a model whose SLO the replay misses.

        Each model is planned for its forecast's band (`Forecast.high`). Where the fleet
        cannot carry every band, each model first keeps as many servers as a plan for the
        means gives it (its min_replicas for this plan), and the bands share the rest: left
        to itself the solver shortchanges whom it likes, by the bands' traffic, which for a
        quiet model is mostly Poisson scatter (a 70B at 12 requests a minute, banded to 21,
        got one server of the three its mean needed, while the 8B got the A100s)."""
        state = State(deployments=tuple(r.deployment for r in self.residents))
        checked = {m.name: self.checked.get(m.name, 1.0) for m in self.inv.models}

        def solve(inv: Inventory) -> Plan:
            return plan_fleet(inv, state, self.calibration, objective="cost", headroom=checked)

        inv, rates = self._planned_for(forecasts, 1.0)
        plan = solve(inv)
        if any(s.shortfall_rps for s in plan.models):
            means = solve(self._planned_for(forecasts, 0.0)[0])
            floors = {s.model: s.replicas for s in means.models}
            inv = dataclasses.replace(
                inv,
                models=tuple(
                    dataclasses.replace(
                        m,
                        spec=m.spec.model_copy(
                            update={"min_replicas": max(m.spec.min_replicas, floors[m.name])}
                        ),
                    )
                    for m in inv.models
                ),
            )
            plan = solve(inv)
        self.plans += 1
        every = self.settings.check_every
        if not every or (self.plans - 1) % every:
            return list(plan.deployments)
        traces = {
            name: at_rate(mine, rates[name])
            for name, mine in (recent or {}).items()
            if name in rates and len(mine) >= MIN_SHAPE
        }
        if not traces:
            return list(plan.deployments)
        plan = plan_within_slos(
            inv,
            lambda headroom: plan_fleet(
                inv, state, self.calibration, objective="cost", headroom=headroom
            ),
            traces,
            self.calibration,
        )
        for c in plan.slo_checks:
            if c.traffic == "trace":
                self.checked[c.model] = c.headroom
        return list(plan.deployments)

    def _planned_for(
        self, forecasts: Mapping[str, Forecast], band: float
    ) -> tuple[Inventory, dict[str, float]]:
        """The inventory with each model's workload at `band` (0 to 1) of the way from its
        forecast's mean to its high, times its headroom, in the shapes of its recent
        requests; and each model's rate (req/s), at which the simulator's check replays them."""
        s = self.settings
        long_tokens = self.inv.spec.router.long_context_tokens
        models = []
        rates: dict[str, float] = {}
        for m in self.inv.models:
            f = forecasts.get(m.name)
            count = (f.mean + band * (f.high - f.mean)) if f else 0.0
            rate = max(RATE_FLOOR, count * self.headroom.get(m.name, 1.0) / s.interval_s)
            seen = self.shapes.get(m.name, ())
            w = (
                spec_of(list(seen), long_tokens, BUCKETS)
                if len(seen) >= MIN_SHAPE
                else m.spec.workload
            )
            spec = (
                w.model_copy(update={"requests_per_s": rate})
                if w is not None
                else WorkloadSpec(
                    requests_per_s=rate, mean_prompt_tokens=512, mean_output_tokens=128
                )
            )
            slo = m.spec.slo or self.slos.get(m.name)
            update = {"workload": spec, "slo": slo}
            models.append(dataclasses.replace(m, spec=m.spec.model_copy(update=update)))
            rates[m.name] = rate
        return dataclasses.replace(self.inv, models=tuple(models)), rates

    def _wake_first(
        self, planned: list[Deployment], forecasts: Mapping[str, Forecast]
    ) -> list[Deployment]:
        """The plan with sleeping servers woken before anything starts cold: where a model's
        plan starts servers, its sleepers whose GPUs the plan leaves free wake (fastest
        first) until, with its other servers, they carry the forecast at the planner's
        target utilization; the cold starts are dropped where they do, kept for the rest
        where they do not. Sleepers serve in seconds, a start in minutes; the hold lets the
        extra go once the starts serve."""
        sleepers = [r for r in self.residents if not r.awake]
        target_util = self.inv.spec.planner.target_utilization
        out = list(planned)
        for model in sorted({t.model for t in planned}):
            starts = [
                t
                for t in out
                if t.model == model
                and not any(same_server(r.deployment, t) for r in self.residents)
            ]
            if not starts:
                continue
            rest = [o for o in out if o not in starts]
            f = forecasts.get(model)
            required = (f.high if f else 0.0) / self.settings.interval_s / target_util
            need = required - sum(o.capacity_rps for o in rest if o.model == model)
            free = [
                r
                for r in sleepers
                if r.deployment.model == model and not any(overlaps(r.deployment, o) for o in rest)
            ]
            free.sort(key=lambda r: (self.costs.wake_s(r.deployment, r.level), r.deployment.key))
            chosen: list[Deployment] = []
            capacity = 0.0
            for r in free:
                if capacity >= need:
                    break
                if any(overlaps(r.deployment, c) for c in chosen):
                    continue
                chosen.append(r.deployment)
                capacity += r.deployment.capacity_rps
            out = (rest if capacity >= need else out) + chosen
        return out

    def _hold(self, planned: list[Deployment]) -> tuple[list[Deployment], list[str]]:
        """The plan with the servers it lets go kept until they were unneeded `down_after`
        intervals in a row, and each model's `floor` kept awake."""
        s = self.settings
        held: list[str] = []
        target = list(planned)
        awake = self.awake()
        for d in awake:
            if any(same_server(d, t) for t in planned):
                self.unneeded.pop(id(d), None)
                continue
            n = self.unneeded.get(id(d), 0) + 1
            self.unneeded[id(d)] = n
            mine = sum(1 for t in target if t.model == d.model)
            if n < s.down_after or mine < s.floor:
                why = "floor" if mine < s.floor else f"unneeded {n} of {s.down_after} intervals"
                held.append(f"keep {d.model} on {d.node} {list(d.gpu_indices)}: {why}")
                target = [t for t in target if not overlaps(t, d)] + [d]
        return target, held

    def _covered(
        self, steps: list[Change], forecasts: Mapping[str, Forecast]
    ) -> tuple[list[Change], list[str]]:
        """Make before break, per model: a server that would leave at once to free its GPUs
        for another model's arrival stays (and that arrival waits) while its model's servers
        that stay awake cannot carry the model's forecast until its own arrivals serve. A
        start takes minutes; a model left short for them misses its objectives for each of
        them, which no saving of GPU time pays for. A model with no arrival of its own in
        the change set is not moving but shrinking: where the fleet cannot carry every
        forecast the plan gives its GPUs to another model, and holding them would veto that
        choice for as long as the shortage lasts (the other model missing meanwhile)."""
        target_util = self.inv.spec.planner.target_utilization
        leaving = [c for c in steps if c.kind in ("sleep", "stop") and not c.after]
        arriving = {c.deployment.model for c in steps if c.kind in ("start", "wake")}
        kept: list[Change] = []  # leavers that must stay
        for model in sorted({c.deployment.model for c in leaving} & arriving):
            f = forecasts.get(model)
            required = (f.high if f else 0.0) / self.settings.interval_s / target_util
            mine = [c for c in leaving if c.deployment.model == model]
            stay = [
                d
                for d in self.awake()
                if d.model == model and not any(same_server(c.deployment, d) for c in mine)
            ]
            capacity = sum(d.capacity_rps for d in stay)
            for c in sorted(mine, key=lambda c: -c.deployment.capacity_rps):
                if capacity >= required:
                    break
                kept.append(c)
                capacity += c.deployment.capacity_rps
        if not kept:
            return steps, []
        ups = [c for c in steps if c.kind in ("start", "wake")]
        blocked = [u for u in ups if any(overlaps(u.deployment, k.deployment) for k in kept)]
        going = [u for u in ups if u not in blocked]
        # A server that left only to make room for a blocked arrival stays too.
        idle = [
            c
            for c in leaving
            if c not in kept
            and any(overlaps(c.deployment, b.deployment) for b in blocked)
            and not any(overlaps(c.deployment, g.deployment) for g in going)
        ]
        out = [c for c in steps if c not in kept and c not in blocked and c not in idle]
        return out, [
            f"keep {k.deployment.model} on {k.deployment.node} {list(k.deployment.gpu_indices)}: "
            f"its model's other servers cannot carry its forecast until its arrivals serve"
            for k in kept
        ]

    def _budget(self, now: float, steps: list[Change]) -> tuple[list[Change], list[str]]:
        """At most `moves_per_hour` starts and wakes in any hour: the moves beyond it wait,
        with the servers that would leave their GPUs for them."""
        while self.moves and self.moves[0] <= now - 3600:
            self.moves.popleft()
        room = self.budget - len(self.moves)
        ups = [c for c in steps if c.kind in ("start", "wake")]
        if len(ups) <= room:
            return steps, []
        ups.sort(key=lambda c: c.seconds)  # the quickest moves first: wakes before starts
        keep_up = ups[: max(0, room)]
        dropped = ups[max(0, room) :]
        # A server leaves only for an arrival that goes ahead, or when nothing arrives there.
        out = []
        for c in steps:
            if c.kind in ("start", "wake"):
                if c in keep_up:
                    out.append(c)
                continue
            if any(overlaps(c.deployment, u.deployment) for u in dropped):
                continue
            out.append(c)
        return out, [f"{len(dropped)} move(s) wait for the hour's budget of {self.budget}"]

    def _gate(
        self,
        target: Sequence[Deployment],
        recent: Mapping[str, Sequence[WorkItem]],
        forecasts: Mapping[str, Forecast],
    ) -> str | None:
        """Why the new fleet must not replace what runs: on the recent traffic it meets the
        objectives for fewer requests than what runs, and fewer than the SLOs' share."""
        slos = {name: self.judged.get(name) for name in recent}
        new = what_if(self.inv, target, recent, calibration=self.calibration, slos=slos)
        old = what_if(self.inv, self.awake(), recent, calibration=self.calibration, slos=slos)
        if new.slo_attainment is None or old.slo_attainment is None:
            return None
        share = min((s.share for s in self.judged.values()), default=DEFAULT_SHARE)
        if new.slo_attainment < min(old.slo_attainment, share) - 0.005:
            return (
                f"gate: the new fleet met the objectives for {new.slo_attainment:.1%} of the "
                f"recent requests, what runs for {old.slo_attainment:.1%}"
            )
        return None
