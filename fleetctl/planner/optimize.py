"""Placement as a mixed-integer program over node classes, solved exactly with HiGHS (highspy).

Variables: y[o], how many deployments of candidate o (a model variant at one TP size on one
node class) to run. GPUs: on a node whose GPU count is a power of two, TP blocks (powers of
two) pack exactly whenever their GPUs add up, so one row per class suffices. Other GPU counts
(6, 12, ...) get "shape" variables z[c, p]: how many nodes are cut into partition p of their
GPUs into TP-sized slots. Either way a TP group never spans nodes and no GPU hosts two servers.

Objective, in one solve (terms in decreasing weight):
  - every model gets min_replicas where GPUs allow (a missing replica costs UNMET_WEIGHT);
  - a model with min_context whose servers run shorter lengths on some classes also gets one
    at max_context (a short server without one costs UNMET_WEIGHT: the plan says so);
  - every model's workload is covered: SHORTFALL_WEIGHT per unit of (1 - capacity/workload);
  - spare capacity is shared by proportional fairness: the sum over models of log(capacity /
    workload), piecewise linear, so no model's workload size biases who gets the spare GPUs;
  - a penalty for deployments whose KV cache holds fewer than `warn_sequences_below`
    sequences at max_context (the seed's lesson: weights fit, KV does not);
  - a bonus for replicas that stay where they run now: the gain a change must beat, by the
    disruption its warm-up causes (planner.change_threshold per server-minute; at least
    STAY_BONUS, so adding a node does not reshuffle);
  - a bonus per GPU in use, larger than the KV penalty, so that penalty chooses between GPUs
    but never leaves one idle that some model could use (fairness's gain from one more
    replica shrinks as 1/n, and at 55 RTX 4090s it fell below the penalty).
The problem size depends on the number of classes and candidates, not on the number of nodes.

With objective "cost" (Melange's question: the cheapest GPUs that carry the workload, with
TP size, quantization and KV budget chosen in the same program), the terms become:
  - min_replicas and the min_context rule as above (COST_UNMET_WEIGHT each);
  - every model's workload is covered, capacity x target_utilization >= requests_per_s
    (COST_SHORTFALL_WEIGHT per unit not covered: a shortfall is reported, never infeasible);
    with length buckets (a workload derived from traffic: WorkloadSpec.buckets), Melange's
    slices instead: continuous f[o, b], the share of bucket b's rate candidate o carries, each
    bucket covered (sum over o of f[o, b] = 1 less its shortfall) and each candidate's
    replicas busy at most target_utilization (sum over b of f[o, b] x rate_b / capacity[o, b]
    <= y[o] x target), capacity[o, b] being the candidate's goodput at the SLO on the
    bucket's requests, 0 where the bucket's longest request exceeds its max_model_len;
    short requests may then go to small cheap GPUs and long ones to large ones;
  - the price per hour of the GPUs deployments use, divided by the whole fleet's price so
    that it weighs less than any shortfall worth a whole GPU;
  - the stay value: a replica kept saves its replacement's GPU-hours of disruption at its
    price, over planner.payback_hours;
  then, in a second solve among the plans as good on those terms, the KV penalty and
  STAY_BONUS per replica kept, as tie-breakers (folded into one objective at a weight below a
  cent they sat under HiGHS's gap tolerance, and it could stop on a plan that ignored them);
  then, with length buckets and the deployments fixed, an LP that routes each bucket's share
  where its requests cost least (the GPU-hours it takes, at their price): no objective above
  prices the shares, so the solver's vertex would otherwise decide who carries what;
  no fairness term and no GPU-use bonus: GPUs no model needs stay idle (and unpaid for).

Kept whole because it is one program, built and solved in the stages above, whose rows refer to
each other's columns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetctl.base.errors import OperationError
from fleetctl.fleet.inventory import Model
from fleetctl.planner.candidates import Candidate, NodeClass

UNMET_WEIGHT = 1e3  # per missing minimum replica
SHORTFALL_WEIGHT = 20.0  # per unit of workload not covered (log's slope is 1 at ratio 1)
RATIO_CAP = 100.0  # capacity beyond 100x the workload earns nothing more
KV_STARVED_PENALTY = 0.05  # log units (~5% of a model's capacity), scaled by the shortfall
STAY_BONUS = 5e-3  # per replica that stays where the current state has it
GPU_USE_BONUS = 1.2 * KV_STARVED_PENALTY  # per GPU a deployment uses
LOG_BREAKPOINTS = np.geomspace(1e-3, RATIO_CAP, 30)
COST_UNMET_WEIGHT = 1e6  # objective "cost": per missing minimum replica
COST_SHORTFALL_WEIGHT = 1e4  # per unit of workload not covered; the fleet's price weighs 1
# What the second solve may give up of the first objective's prices, over the dearest column's:
# above HiGHS's feasibility tolerance (1e-7), so that the first plan stays feasible, and far
# below the cheapest column's share of the dearest.
LEX_SLACK = 1e-6
SOLVER_TIME_LIMIT_S = 20.0
MIP_REL_GAP = 1e-4


@dataclass
class Solution:
    counts: list[int]  # per candidate
    shapes: dict[int, list[tuple[tuple[int, ...], int]]]  # class index -> [(shape, nodes)]
    info: dict[str, Any] = field(default_factory=dict)
    # Objective cost with length buckets: per candidate, the share of each of its model's
    # buckets that its replicas together carry.
    bucket_shares: dict[int, tuple[float, ...]] = field(default_factory=dict)


def shapes_for(gpu_count: int, sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every way to cut `gpu_count` GPUs into slots of the given sizes, 1-GPU slots filling up."""
    parts = sorted({s for s in sizes if s > 1}, reverse=True)
    out: list[tuple[int, ...]] = []

    def rec(left: int, i: int, acc: tuple[int, ...]) -> None:
        if i == len(parts):
            out.append(acc + (1,) * left)
            return
        size = parts[i]
        for k in range(left // size, -1, -1):
            rec(left - k * size, i + 1, acc + (size,) * k)

    rec(gpu_count, 0, ())
    return out


def _pack(
    prog: _Program, classes: list[NodeClass], cands: list[Candidate], y: list[int]
) -> dict[int, list[tuple[tuple[int, ...], int]]]:
    """Rows that fit the deployments' TP groups into each class's GPUs; the shape columns of
    classes whose GPU count is not a power of two, by class index."""
    shapes: dict[int, list[tuple[tuple[int, ...], int]]] = {}  # class -> [(shape, z column)]
    for c in classes:
        mine = [o for o, k in enumerate(cands) if k.cls is c]
        if not mine:
            continue
        if is_power_of_two(c.gpu_count):  # TP blocks pack exactly: count GPUs
            prog.row({y[o]: float(cands[o].tp) for o in mine}, -math.inf, c.size * c.gpu_count)
            continue
        sizes = sorted({cands[o].tp for o in mine})
        cols = [(p, prog.col(0, c.size, integer=True)) for p in shapes_for(c.gpu_count, sizes)]
        shapes[c.index] = cols
        prog.row({z: 1.0 for _, z in cols}, -math.inf, c.size)
        for t in sizes:  # TP=t deployments fit in the shapes' t-sized slots
            coefs = {y[o]: 1.0 for o in mine if cands[o].tp == t}
            coefs.update({z: -float(p.count(t)) for p, z in cols if p.count(t)})
            prog.row(coefs, -math.inf, 0.0)
    return shapes


def _replica_rows(
    prog: _Program,
    m: Model,
    mine: list[int],
    cands: list[Candidate],
    y: list[int],
    unmet_weight: float,
) -> None:
    """min_replicas, max_replicas, and with min_context one server at max_context."""
    unmet = prog.col(0, m.spec.min_replicas, unmet_weight, held=True)
    prog.row({**{y[o]: 1.0 for o in mine}, unmet: 1.0}, m.spec.min_replicas, math.inf)
    if m.spec.max_replicas is not None:
        prog.row({y[o]: 1.0 for o in mine}, -math.inf, m.spec.max_replicas)
    below = [o for o in mine if cands[o].max_model_len < m.spec.max_context]
    if below:  # sum(below) <= big * (sum(at max_context) + missing): none without a long one
        big = float(sum(prog.ub[y[o]] for o in below))
        missing = prog.col(0, 1, unmet_weight, integer=True, held=True)
        coefs = {y[o]: 1.0 for o in below}
        coefs.update({y[o]: -big for o in mine if o not in below})
        coefs[missing] = -big
        prog.row(coefs, -math.inf, 0.0)


def _most_replicas(k: Candidate) -> int:
    """How many deployments of `k` its class's GPUs hold, at most the model's max_replicas."""
    hi = k.cls.size * (k.cls.gpu_count // k.tp)
    return hi if k.model.spec.max_replicas is None else min(hi, k.model.spec.max_replicas)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def demand(model: Model) -> float | None:
    w = model.spec.workload
    return w.requests_per_s if w else None


class _Program:
    """Column and row bookkeeping for a sparse MILP in HiGHS's row-wise form, with optional
    later objectives: `tie`, which only chooses among solutions as good on the first, and
    `route`, which settles the continuous columns once the integer ones are fixed."""

    def __init__(self) -> None:
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.cost: list[float] = []
        self.tie: list[float] = []
        self.held: list[bool] = []
        self.route: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def col(
        self,
        lo: float,
        hi: float,
        cost: float = 0.0,
        integer: bool = False,
        tie: float = 0.0,
        held: bool = False,
        route: float = 0.0,
    ) -> int:
        """A column; `held`: a penalty (a missing replica, a shortfall) that the second solve
        may not raise above the first plan's; `route`: its cost in a last LP that settles the
        continuous columns no objective prices (who carries which share of a bucket) once the
        integer ones are fixed."""
        self.lb.append(lo)
        self.ub.append(hi)
        self.cost.append(cost)
        self.tie.append(tie)
        self.held.append(held)
        self.route.append(route)
        self.integer.append(integer)
        return len(self.lb) - 1

    def row(self, coefs: dict[int, float], lo: float, hi: float) -> None:
        self.rows.append((coefs, lo, hi))

    def solve(self) -> tuple[Solved, dict[str, Any]]:
        """Minimize `cost`; then, where any column has a `tie` cost, minimize that among the
        solutions as good on `cost` as the first found (a lexicographic second solve: tie
        costs folded into the first objective at a weight small enough not to trade against it
        would sit below the solver's gap tolerance, and it may stop without them); then, where
        any column has a `route` cost, minimize that with the integer columns fixed (an LP)."""
        first, info = self._run(self.cost, self.rows, self.lb, self.ub)
        x = first.x
        if x is None or not first.optimal:
            return first, info  # (out of time: the limit is spent, the plan stands as found)
        # As good on the first objective: no held penalty above its value in the first plan,
        # and the other terms (prices) at most its sum, in a row of their own scale. One row
        # of the whole objective would mix weights of 1e6 with prices of 1e-4, and HiGHS then
        # returned plans that broke it by 0.14.
        ub = [
            (round(x[j]) if self.integer[j] else x[j]) if held else u
            for j, (u, held) in enumerate(zip(self.ub, self.held, strict=True))
        ]
        best = first
        if any(self.tie):
            rows = self.rows
            light = {j: c for j, c in enumerate(self.cost) if c and not self.held[j]}
            if light:
                scale = max(abs(c) for c in light.values())
                bound = sum(c * x[j] for j, c in light.items()) / scale
                keep = ({j: c / scale for j, c in light.items()}, -math.inf, bound + LEX_SLACK)
                rows = [*rows, keep]
            second, _ = self._run(self.tie, rows, self.lb, ub, start=x)
            best = first if second.x is None else second
        if any(self.route) and best.x is not None:
            # The deployments fixed, an LP: which replicas carry what no objective priced.
            fixed = [round(v) if i else None for v, i in zip(best.x, self.integer, strict=True)]
            lb = [lo if f is None else f for lo, f in zip(self.lb, fixed, strict=True)]
            hi = [u if f is None else f for u, f in zip(ub, fixed, strict=True)]
            third, _ = self._run(self.route, self.rows, lb, hi, start=best.x)
            if third.x is not None:
                best = Solved(best.optimal, best.message, third.x, best.mip_gap)
        return best, info

    def _run(
        self,
        cost: list[float],
        rows: list[tuple[dict[int, float], float, float]],
        lb: list[float],
        ub: list[float],
        start: list[float] | None = None,
    ) -> tuple[Solved, dict[str, Any]]:
        import highspy

        inf = highspy.kHighsInf
        index: list[int] = []
        value: list[float] = []
        start_at = [0]
        for coefs, _, _ in rows:
            for c, v in sorted(coefs.items()):
                index.append(c)
                value.append(v)
            start_at.append(len(index))
        lp = highspy.HighsLp()
        lp.num_col_ = len(self.lb)
        lp.num_row_ = len(rows)
        lp.col_cost_ = np.array(cost)
        lp.col_lower_ = np.array(lb)
        lp.col_upper_ = np.array(ub)
        lp.row_lower_ = np.array([max(r[1], -inf) for r in rows])
        lp.row_upper_ = np.array([min(r[2], inf) for r in rows])
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_ = lp.num_col_
        lp.a_matrix_.num_row_ = lp.num_row_
        lp.a_matrix_.start_ = np.array(start_at, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(value)
        kinds = highspy.HighsVarType
        lp.integrality_ = [kinds.kInteger if i else kinds.kContinuous for i in self.integer]
        h = _quiet_highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("time_limit", SOLVER_TIME_LIMIT_S)
        h.setOptionValue("mip_rel_gap", MIP_REL_GAP)
        h.setOptionValue("threads", 1)  # deterministic, and the problems are small
        h.passModel(lp)
        if start is not None:  # the first solve's plan: feasible here, the search starts at it
            given = highspy.HighsSolution()
            given.col_value = start
            given.value_valid = True
            h.setSolution(given)
        h.run()
        status = h.getModelStatus()
        solution = h.getSolution()
        found = solution.value_valid
        return Solved(
            status == highspy.HighsModelStatus.kOptimal,
            h.modelStatusToString(status),
            list(solution.col_value) if found else None,
            h.getInfo().mip_gap,
        ), {"variables": lp.num_col_, "constraints": lp.num_row_}


@dataclass
class Solved:
    optimal: bool
    message: str
    x: list[float] | None
    mip_gap: float


def _quiet_highs() -> Any:
    """A HiGHS instance; its constructor prints a banner to stdout, which would corrupt --json."""
    import os
    import sys

    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solve(
    classes: list[NodeClass],
    cands: list[Candidate],
    models: Sequence[Model],
    target_utilization: float,
    current: Sequence[int] = (),
    warn_sequences_below: int = 8,
    objective: str = "throughput",
    headroom: Mapping[str, float] | None = None,
    stay: Sequence[float] = (),
) -> Solution:
    """Choose how many of each candidate to run; `current` counts what runs now per candidate.
    objective "throughput" shares spare GPUs out fairly; "cost" uses the cheapest GPUs that
    meet every workload (each class needs a price: NodeClass.cost_per_hour), each model's
    times its `headroom` (default 1: the simulator asks for more where an SLO is missed).
    `stay` weighs, per candidate, a replica kept where it runs: in log-capacity units for
    throughput, in the fleet's price per hour for cost (default STAY_BONUS, a tie-breaker)."""
    if not cands:
        return Solution([], {}, {"status": "nothing to place"})
    if objective == "cost":
        return _solve_cost(
            classes,
            cands,
            models,
            target_utilization,
            current,
            warn_sequences_below,
            headroom,
            stay,
        )
    started = time.perf_counter()
    current = list(current) or [0] * len(cands)
    prog = _Program()

    y = []
    for o, k in enumerate(cands):
        hi = _most_replicas(k)
        short = max(0.0, 1.0 - k.sequences_at_max_len / warn_sequences_below)
        cost = KV_STARVED_PENALTY * short - GPU_USE_BONUS * k.tp
        y.append(prog.col(0, hi, cost, integer=True))
        if current[o]:  # k <= min(y, current): replicas that stay put
            kept = prog.col(0, current[o], -max(STAY_BONUS, stay[o] if stay else 0.0))
            prog.row({kept: 1.0, y[o]: -1.0}, -math.inf, 0.0)

    shapes = _pack(prog, classes, cands, y)

    for m in models:
        mine = [o for o, k in enumerate(cands) if k.model is m]
        d = demand(m)
        best = max((cands[o].capacity_rps for o in mine), default=0.0) * target_utilization
        # Ratios count workloads served, or replica-equivalents for a model with no workload.
        norm = d if d else (best or 1.0)
        ratio = {y[o]: cands[o].capacity_rps * target_utilization / norm for o in mine}
        _replica_rows(prog, m, mine, cands, y, UNMET_WEIGHT)
        if d and mine:  # shortfall >= 1 - ratio
            short = prog.col(0, 1, SHORTFALL_WEIGHT, held=True)
            prog.row({short: 1.0, **ratio}, 1.0, math.inf)
        if mine:  # s <= log(ratio), by tangents at the breakpoints
            s = prog.col(math.log(LOG_BREAKPOINTS[0]) - 2.0, math.log(RATIO_CAP), -1.0)
            for a in LOG_BREAKPOINTS:
                prog.row(
                    {s: 1.0, **{c: -v / a for c, v in ratio.items()}}, -math.inf, math.log(a) - 1
                )

    return _solution(prog, y, shapes, classes, cands, started)


def _solution(
    prog: _Program,
    y: list[int],
    shapes: dict[int, list[tuple[tuple[int, ...], int]]],
    classes: list[NodeClass],
    cands: list[Candidate],
    started: float,
    values: list[float] | None = None,
) -> Solution:
    """The solved program's counts and shapes; `values`, if given, receives every column's
    value."""
    res, info = prog.solve()
    if res.x is None:
        raise OperationError(
            f"placement solver (HiGHS) found no solution: {res.message} "
            "(this is a fleetctl bug; please report it with the inventory)"
        )
    if values is not None:
        values[:] = res.x
    counts = [round(res.x[col]) for col in y]
    picked = {
        ci: [(p, round(res.x[z])) for p, z in cols if round(res.x[z])]
        for ci, cols in shapes.items()
    }
    info.update(
        {
            "solver": "HiGHS (highspy)",
            "status": res.message,
            "optimal": res.optimal,
            "mip_gap": res.mip_gap,
            "classes": len(classes),
            "candidates": len(cands),
            "seconds": round(time.perf_counter() - started, 4),
        }
    )
    return Solution(counts, picked, info)


def _solve_cost(
    classes: list[NodeClass],
    cands: list[Candidate],
    models: Sequence[Model],
    target_utilization: float,
    current: Sequence[int],
    warn_sequences_below: int,
    headroom: Mapping[str, float] | None = None,
    stay: Sequence[float] = (),
) -> Solution:
    """The cheapest deployments that meet every model's workload times its headroom (see the
    module's notes)."""
    started = time.perf_counter()
    current = list(current) or [0] * len(cands)
    prices = {c.index: c.cost_per_hour for c in classes}
    if any(prices[k.cls.index] is None for k in cands):
        raise ValueError("objective 'cost' needs a price for every node class")
    fleet = sum(c.size * (c.cost_per_hour or 0.0) for c in classes) or 1.0
    prog = _Program()
    y = []
    for o, k in enumerate(cands):
        hi = _most_replicas(k)
        short = max(0.0, 1.0 - k.sequences_at_max_len / warn_sequences_below)
        price = k.cls.price_of(k.tp) or 0.0
        y.append(prog.col(0, hi, price / fleet, integer=True, tie=KV_STARVED_PENALTY * short))
        if current[o]:
            saved = (stay[o] if stay else 0.0) / fleet
            kept = prog.col(0, current[o], -saved, tie=-STAY_BONUS)
            prog.row({kept: 1.0, y[o]: -1.0}, -math.inf, 0.0)
    shapes = _pack(prog, classes, cands, y)
    shares: dict[int, dict[int, int]] = {}  # candidate -> bucket -> its share column
    for m in models:
        mine = [o for o, k in enumerate(cands) if k.model is m]
        _replica_rows(prog, m, mine, cands, y, COST_UNMET_WEIGHT)
        d = demand(m)
        if d and headroom:
            d *= headroom.get(m.name, 1.0)
        buckets = m.spec.workload.buckets if m.spec.workload else ()
        if d and mine and buckets:
            _bucket_rows(prog, buckets, d, mine, cands, y, target_utilization, shares)
        elif d and mine:  # shortfall >= 1 - capacity x target / workload
            short_col = prog.col(0, 1, COST_SHORTFALL_WEIGHT, held=True)
            ratio = {y[o]: cands[o].capacity_rps * target_utilization / d for o in mine}
            prog.row({short_col: 1.0, **ratio}, 1.0, math.inf)
    x: list[float] = []
    sol = _solution(prog, y, shapes, classes, cands, started, x)
    sol.info["objective"] = "cost"
    for o, cols in shares.items():
        n = len(cands[o].bucket_capacity)
        sol.bucket_shares[o] = tuple(max(0.0, x[cols[b]]) if b in cols else 0.0 for b in range(n))
    return sol


def _bucket_rows(
    prog: _Program,
    buckets: Sequence[Any],
    d: float,
    mine: list[int],
    cands: list[Candidate],
    y: list[int],
    target_utilization: float,
    shares: dict[int, dict[int, int]],
) -> None:
    """Melange's slices: f[o, b] >= 0, the share of bucket b's rate that candidate o's
    replicas carry; each bucket covered (sum over o of f[o, b] + its shortfall = 1, the
    shortfall weighed by the bucket's share of the workload); each candidate's replicas
    busy at most target_utilization (sum over b of f[o, b] x rate_b / capacity[o, b] <=
    y[o] x target). A bucket goes only where its capacity is positive: where its longest
    request fits max_model_len and its mean request meets the SLO."""
    busy: dict[int, dict[int, float]] = {o: {y[o]: -target_utilization} for o in mine}
    for b, bucket in enumerate(buckets):
        rate = bucket.share * d
        short_col = prog.col(0, 1, COST_SHORTFALL_WEIGHT * bucket.share, held=True)
        cover = {short_col: 1.0}
        for o in mine:
            caps = cands[o].bucket_capacity
            if b >= len(caps) or caps[b] <= 0:
                continue
            # Routed where its requests cost least: the GPU-hours its share takes, at their price.
            price = cands[o].cls.price_of(cands[o].tp) or 0.0
            f = prog.col(0, 1, route=rate / caps[b] * price)
            shares.setdefault(o, {})[b] = f
            cover[f] = 1.0
            busy[o][f] = rate / caps[b]
        prog.row(cover, 1.0, 1.0)  # = 1: the shares say who carries the bucket, once
    for o in mine:
        if len(busy[o]) > 1:
            prog.row(busy[o], -math.inf, 0.0)
