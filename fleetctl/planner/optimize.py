"""Placement as a mixed-integer program over node classes, solved exactly with HiGHS.

Variables: y[o], how many deployments of candidate o (model, variant, TP, class) to run;
z[c, p], how many nodes of class c are cut into GPU "shape" p (a partition of the node's GPUs
into TP-sized slots, so a TP group never spans nodes and no GPU hosts two servers).

Two lexicographic stages:
  1. serve every model at least min_replicas times where possible, then maximize h, the
     smallest ratio of planned capacity (at the target utilization) to a model's workload;
  2. holding stage 1's result, share the spare GPUs by proportional fairness: maximize the sum
     of log(capacity) over models (piecewise linear), which no model's workload size can bias;
     minus a penalty for deployments whose KV cache holds fewer than `warn_sequences_below`
     sequences at max_context (the seed's lesson: weights fit, KV does not), plus a small
     bonus for replicas that stay where they run now (adding a node does not reshuffle).
The problem size depends on the number of classes and candidates, not on the number of nodes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetctl.errors import OperationError
from fleetctl.inventory import Model
from fleetctl.planner.candidates import TP_SIZES, Candidate, NodeClass

UNMET_WEIGHT = 1e4  # one missing minimum replica outweighs any capacity ratio (capped below)
RATIO_CAP = 100.0  # capacity beyond 100x the workload earns nothing more
# Stage 2 works in log-capacity units: 0.05 is worth about 5% of one model's capacity.
KV_STARVED_PENALTY = 0.05  # per deployment with no KV headroom, scaled by how short it falls
STAY_BONUS = 2e-3  # per replica that stays where the current state has it
LOG_BREAKPOINTS = np.geomspace(1e-3, RATIO_CAP, 36)
SOLVER_TIME_LIMIT_S = 20.0


@dataclass
class Solution:
    counts: list[int]  # per candidate
    shapes: dict[int, list[tuple[tuple[int, ...], int]]]  # class index -> [(shape, nodes)]
    min_ratio: float | None
    info: dict[str, Any] = field(default_factory=dict)


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


def demand(model: Model) -> float | None:
    w = model.spec.workload
    return w.requests_per_s if w else None


def solve(
    classes: list[NodeClass],
    cands: list[Candidate],
    models: Sequence[Model],
    target_utilization: float,
    current: Sequence[int] = (),
    warn_sequences_below: int = 8,
) -> Solution:
    """Choose how many of each candidate to run; `current` counts what runs now per candidate."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    if not cands:
        return Solution([], {}, None, {"status": "nothing to place"})
    started = time.perf_counter()
    shapes = {
        c.index: shapes_for(c.gpu_count, sorted({k.tp for k in cands if k.cls is c}) or [1])
        for c in classes
    }
    model_ix = {m.name: i for i, m in enumerate(models)}
    # Normalizer per model: its workload, or (no workload) one replica of its best candidate,
    # so that ratios count "workloads served" or "replica-equivalents".
    norm = []
    for m in models:
        best = max((k.capacity_rps for k in cands if k.model is m), default=1.0)
        d = demand(m)
        norm.append(d if d else best * target_utilization)

    n_y = len(cands)
    z_index: list[tuple[int, tuple[int, ...]]] = [(c, p) for c in shapes for p in shapes[c]]
    n_z = len(z_index)
    n_m = len(models)
    i_h = n_y + n_z
    i_u = i_h + 1
    i_s = i_u + n_m  # s[m] <= log(model m's capacity ratio)
    i_k = i_s + n_m  # k[o] <= min(y[o], current[o]): replicas that stay
    n = i_k + n_y
    current = list(current) or [0] * n_y

    rows: list[tuple[dict[int, float], float, float]] = []

    def row(coefs: dict[int, float], lo: float, hi: float) -> None:
        rows.append((coefs, lo, hi))

    size_of = {c.index: c.size for c in classes}
    for c in classes:  # (1) each node takes one shape
        row({n_y + j: 1.0 for j, (ci, _) in enumerate(z_index) if ci == c.index}, 0, c.size)
        for t in TP_SIZES:  # (2) deployments of TP=t fit in the shapes' t-slots
            coefs = {o: 1.0 for o, k in enumerate(cands) if k.cls is c and k.tp == t}
            if not coefs:
                continue
            for j, (ci, p) in enumerate(z_index):
                if ci == c.index and p.count(t):
                    coefs[n_y + j] = -float(p.count(t))
            row(coefs, -math.inf, 0.0)
    ratio: list[dict[int, float]] = [{} for _ in models]
    for o, k in enumerate(cands):
        mi = model_ix[k.model.name]
        ratio[mi][o] = k.capacity_rps * target_utilization / norm[mi]
    for mi, m in enumerate(models):
        mine = {o: 1.0 for o in ratio[mi]}
        row({**mine, i_u + mi: 1.0}, m.spec.min_replicas, math.inf)  # (3) minimum replicas
        if m.spec.max_replicas is not None:  # (4)
            row(mine, -math.inf, m.spec.max_replicas)
        if demand(m):  # (5) h <= this model's capacity / workload
            row({i_h: 1.0, **{o: -v for o, v in ratio[mi].items()}}, -math.inf, 0.0)
        for a in LOG_BREAKPOINTS:  # (6) s <= tangent of log at a: log(a) + (ratio - a) / a
            coefs = {i_s + mi: 1.0, **{o: -v / a for o, v in ratio[mi].items()}}
            row(coefs, -math.inf, math.log(a) - 1.0)
    for o in range(n_y):
        if current[o]:
            row({i_k + o: 1.0, o: -1.0}, -math.inf, 0.0)  # (7)

    lb = np.zeros(n)
    ub = np.zeros(n)
    for o, k in enumerate(cands):
        ub[o] = k.cls.size * (k.cls.gpu_count // k.tp)
        if k.model.spec.max_replicas is not None:
            ub[o] = min(ub[o], k.model.spec.max_replicas)
    for j, (ci, _) in enumerate(z_index):
        ub[n_y + j] = size_of[ci]
    has_demand = any(demand(m) for m in models)
    ub[i_h] = RATIO_CAP if has_demand else 0.0
    for mi, m in enumerate(models):
        ub[i_u + mi] = m.spec.min_replicas
        lb[i_s + mi] = math.log(LOG_BREAKPOINTS[0]) - 2.0
        ub[i_s + mi] = math.log(RATIO_CAP)
    for o in range(n_y):
        ub[i_k + o] = current[o]
    integrality = np.zeros(n)
    integrality[: n_y + n_z] = 1

    def constraints(extra: list[tuple[dict[int, float], float, float]]) -> Any:
        all_rows = rows + extra
        a = lil_matrix((len(all_rows), n))
        lo = np.empty(len(all_rows))
        hi = np.empty(len(all_rows))
        for r, (coefs, rlo, rhi) in enumerate(all_rows):
            for col, v in coefs.items():
                a[r, col] = v
            lo[r], hi[r] = rlo, rhi
        return LinearConstraint(a.tocsr(), lo, hi)

    options = {"disp": False, "time_limit": SOLVER_TIME_LIMIT_S, "mip_rel_gap": 1e-7}

    def run(cost: np.ndarray, extra: list[tuple[dict[int, float], float, float]]) -> Any:
        res = milp(
            cost,
            constraints=constraints(extra),
            integrality=integrality,
            bounds=Bounds(lb, ub),
            options=options,
        )
        if res.x is None:
            raise OperationError(
                f"placement solver (HiGHS) found no solution: {res.message} "
                "(this is a fleetctl bug; please report it with the inventory)"
            )
        return res

    stage1 = np.zeros(n)
    stage1[i_h] = -1.0
    stage1[i_u : i_u + n_m] = UNMET_WEIGHT
    r1 = run(stage1, [])
    unmet = float(np.sum(r1.x[i_u : i_u + n_m]))
    h = float(r1.x[i_h])

    stage2 = np.zeros(n)
    stage2[i_s : i_s + n_m] = -1.0
    for o, k in enumerate(cands):
        short = max(0.0, 1.0 - k.sequences_at_max_len / warn_sequences_below)
        stage2[o] = KV_STARVED_PENALTY * short
        stage2[i_k + o] = -STAY_BONUS
    hold = [
        ({i_u + mi: 1.0 for mi in range(n_m)}, -math.inf, unmet + 1e-6),
        ({i_h: 1.0}, h * (1 - 1e-6) - 1e-9, math.inf),
    ]
    r2 = run(stage2, hold)
    x = r2.x
    counts = [round(v) for v in x[:n_y]]
    picked: dict[int, list[tuple[tuple[int, ...], int]]] = {}
    for j, (ci, p) in enumerate(z_index):
        k = round(x[n_y + j])
        if k:
            picked.setdefault(ci, []).append((p, k))
    info = {
        "solver": "HiGHS (scipy.optimize.milp)",
        "status": str(r2.message),
        "variables": n,
        "constraints": len(rows) + 2,
        "classes": len(classes),
        "candidates": len(cands),
        "seconds": round(time.perf_counter() - started, 4),
    }
    return Solution(counts, picked, h if has_demand else None, info)
