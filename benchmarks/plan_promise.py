"""Does a plan keep its promise: the planner's capacity beside the simulator's goodput rate.

Run (from the repository root, in the dev venv):

    python benchmarks/plan_promise.py [--requests 3000] [--before PATH]
        [--examples seed-mixed-8b,...] [--traces conv,code,mooncake] [--out DIR]

For every bundled example that serves one model (the public traces do not say which model a
request was for) and every public trace, at the SLO `ttft_p99_s: 2.0, tpot_p99_ms: 60`
stated on the model: the workload is derived from the trace's first --requests requests as
`plan --workload-from` derives it, the plan made, and its capacity read; then the same
requests are replayed by the simulator (hardware-aware routing, the SLO given) at rates found
by bisection: the highest rate at which 99% of requests meet both objectives (the simulator's
goodput rate), and the share within at the plan's capacity and at 1.25x it. The promise is
kept when the share at the capacity is within 3 points of 99% or above, and the share at
1.25x is below 99%. The plan's analytic capacity (planner/queueing.py: what `plan` prints
without a trace, and what placement and the cost objective optimise) and its signed one
(sim/capacity.py: what `plan --workload-from` prints, the simulator's search on the same
requests) are each judged so.

--slo derived: no SLO stated; the model's derived SLO (fleet/slo.py, from the planned
servers) is what the planner plans by and what the simulator judges by.

--before PATH: a checkout of the code before (e.g. `git worktree add /tmp/before main`); its
planner's capacity for the same inventory (the workload fields its schema knows) is shown
beside.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from fleetctl.base.resources import examples
from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from fleetctl.routing.goodput import Slo
from fleetctl.sim.capacity import goodput_rate
from fleetctl.sim.compare import compare
from fleetctl.sim.workload import (
    WorkItem,
    derive_workload,
    length_buckets,
    load_trace,
    workload_spec,
)
from harness.procs import REPO
from harness.results import header, out_dir, write_json

# The public traces beside the checkout (a worktree's one folder further up).
TRACES = next(
    (
        p
        for p in (REPO.parent / "shared" / "traces", REPO.parent.parent / "shared" / "traces")
        if p.is_dir()
    ),
    REPO.parent / "shared" / "traces",
)
TRACE_FILES = {
    "conv": TRACES / "AzureLLMInferenceTrace_conv.csv",
    "code": TRACES / "AzureLLMInferenceTrace_code.csv",
    "mooncake": TRACES / "mooncake_conversation_trace.jsonl",
}
SLO: dict[str, float] = {"ttft_p99_s": 2.0, "tpot_p99_ms": 60}  # empty: derived
SHARE = 0.99
TOLERANCE = 0.03  # points of share the capacity may fall short by
OVER = 1.25  # at this times the capacity, the share must fall short
BISECT_STEPS = 7

BEFORE = """
import json, sys
from pathlib import Path
from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
plan = plan_fleet(load_inventory(Path(sys.argv[1]), load_catalog()))
print(json.dumps([m.capacity_rps for m in plan.models]))
"""
OLD_FIELDS = {"requests_per_s", "mean_prompt_tokens", "mean_output_tokens", "buckets"}


def inventory_for(example: str, trace: str, items: list[WorkItem], folder: Path, new: bool) -> Path:
    """The example with its model's workload derived from `items` and the SLO stated; `new`:
    with the length quantiles and burstiness (the code before knows only the means)."""
    src = examples()[example]
    doc = yaml.safe_load(src.read_text())
    inv = load_inventory(src, load_catalog())
    derived = derive_workload(items, inv.spec.router.long_context_tokens)
    assert derived is not None
    spec = workload_spec(derived, length_buckets(items, 4)).model_dump(exclude_none=True)
    if not new:
        spec = {k: v for k, v in spec.items() if k in OLD_FIELDS}
    doc["models"][0]["workload"] = spec
    if SLO:
        doc["models"][0]["slo"] = dict(SLO)
    out = folder / f"{example}-{trace}-{'new' if new else 'old'}.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def slo_of(inv: Any, plan: Any, model: str) -> Slo:
    """The SLO stated on the model (SLO), else the one `plan` derives for the plan."""
    if SLO:
        return Slo(SLO["ttft_p99_s"], SLO["tpot_p99_ms"] / 1000)
    return plan.slos[model]


def attained(inv: Any, plan: Any, model: str, items: list[WorkItem], rate: float) -> float:
    slo = slo_of(inv, plan, model)
    c = compare(inv, plan, model, items, ["hardware-aware"], rate=rate, slo=slo)
    return float(c.results["hardware-aware"].summary()["slo_attainment"])


def sim_goodput(inv: Any, plan: Any, model: str, items: list[WorkItem], guess: float) -> float:
    """The highest rate with SHARE within both objectives, by bisection on a log scale."""
    lo, hi = 0.0, max(guess, 0.5)
    while attained(inv, plan, model, items, hi) >= SHARE and hi < 1e4:
        lo, hi = hi, hi * 2
    if lo == 0.0:
        lo = hi / 64
        if attained(inv, plan, model, items, lo) < SHARE:
            return 0.0
    for _ in range(BISECT_STEPS):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if attained(inv, plan, model, items, mid) >= SHARE else (lo, mid)
    return lo


def run_case(example: str, trace: str, n: int, folder: Path, before: Path | None) -> dict[str, Any]:
    probe = load_inventory(examples()[example], load_catalog())
    model = probe.models[0].name
    items = load_trace(TRACE_FILES[trace], model, n)
    path = inventory_for(example, trace, items, folder, new=True)
    inv = load_inventory(path, load_catalog())
    started = time.perf_counter()
    plan = plan_fleet(inv)
    plan_s = time.perf_counter() - started
    summary = plan.models[0]
    capacity = summary.capacity_rps
    old = None
    if before is not None:
        # The code before reads what it knows of the same workload: all of it where its
        # schema takes it, else its own fields only.
        for known in (True, False):
            old_path = inventory_for(example, trace, items, folder, new=known)
            got = subprocess.run(
                [sys.executable, "-c", BEFORE, str(old_path.resolve())],
                cwd=before,
                capture_output=True,
                text=True,
            )
            if got.returncode == 0:
                old = json.loads(got.stdout.strip().splitlines()[-1])[0]
                break
    sim = sim_goodput(inv, plan, model, items, capacity or 1.0)
    at = attained(inv, plan, model, items, capacity) if capacity > 0 else None
    over = attained(inv, plan, model, items, capacity * OVER) if capacity > 0 else None
    kept = keeps(capacity, at, over, sim)
    # The signed figure: what `plan --workload-from` prints, the simulator's own search
    # (sim/capacity.py) on the same requests the plan was made from.
    started = time.perf_counter()
    signed = goodput_rate(inv, plan, model, items, slo=slo_of(inv, plan, model)).rate_rps
    signed_s = time.perf_counter() - started
    s_at = attained(inv, plan, model, items, signed) if signed > 0 else None
    s_over = attained(inv, plan, model, items, signed * OVER) if signed > 0 else None
    return {
        "example": example,
        "trace": trace,
        "requests": len(items),
        "basis": summary.capacity_basis,
        "plan_rps": round(capacity, 3),
        "before_rps": None if old is None else round(old, 3),
        "sim_goodput_rps": round(sim, 3),
        "ratio": None if sim == 0 else round(capacity / sim, 3),
        "before_ratio": None if old is None or sim == 0 else round(old / sim, 3),
        "within_at_capacity": at,
        "within_at_1.25x": over,
        "kept": kept,
        "signed_rps": round(signed, 3),
        "signed_ratio": None if sim == 0 else round(signed / sim, 3),
        "within_at_signed": s_at,
        "within_at_1.25x_signed": s_over,
        "signed_kept": keeps(signed, s_at, s_over, sim),
        "signed_s": round(signed_s, 2),
        "plan_s": round(plan_s, 3),
        "slo": plan.slos[model].describe(),
    }


def keeps(capacity: float, at: float | None, over: float | None, sim: float) -> bool:
    """The promise is kept: within TOLERANCE of SHARE at the capacity and under SHARE at
    OVER times it (or no capacity where the simulator finds none)."""
    if capacity == 0:
        return sim == 0
    assert at is not None and over is not None
    return at >= SHARE - TOLERANCE and over < SHARE


def single_model_examples() -> list[str]:
    catalog = load_catalog()
    return [name for name, p in examples().items() if len(load_inventory(p, catalog).models) == 1]


def report(rows: list[dict[str, Any]]) -> str:
    def f(x: Any, pct: bool = False) -> str:
        if x is None:
            return "-"
        return f"{x:.1%}" if pct else f"{x:g}"

    out = [
        "",
        "| example | trace | analytic req/s (before) | sim goodput req/s "
        "| analytic / sim (before) | within at analytic, at 1.25x | kept "
        "| signed req/s (/ sim) | within at signed, at 1.25x | kept |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['example']} | {r['trace']} | {f(r['plan_rps'])} ({f(r['before_rps'])}) "
            f"| {f(r['sim_goodput_rps'])} | {f(r['ratio'])} ({f(r['before_ratio'])}) "
            f"| {f(r['within_at_capacity'], True)}, {f(r['within_at_1.25x'], True)} "
            f"| {'yes' if r['kept'] else 'NO'} "
            f"| {f(r['signed_rps'])} ({f(r['signed_ratio'])}) "
            f"| {f(r['within_at_signed'], True)}, {f(r['within_at_1.25x_signed'], True)} "
            f"| {'yes' if r['signed_kept'] else 'NO'} |"
        )
    kept = sum(r["kept"] for r in rows)
    signed = sum(r["signed_kept"] for r in rows)
    out.append("")
    out.append(f"Kept: analytic {kept} of {len(rows)}, signed {signed} of {len(rows)}.")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--examples", default="")
    ap.add_argument("--traces", default=",".join(TRACE_FILES))
    ap.add_argument("--before", type=Path, default=None)
    ap.add_argument(
        "--slo",
        default="",
        help="TTFT_S,TPOT_MS in place of 2.0,60 (e.g. 16,100 for Mooncake); derived: none stated",
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "plan_promise"))
    args = ap.parse_args()
    if args.slo == "derived":
        SLO.clear()
    elif args.slo:
        ttft, tpot = args.slo.split(",")
        SLO.update(ttft_p99_s=float(ttft), tpot_p99_ms=float(tpot))
    names = args.examples.split(",") if args.examples else single_model_examples()
    started = time.perf_counter()
    rows = []
    work = out_dir(args.out)
    folder = work / "inventories"  # the inventories planned, kept to look into
    folder.mkdir(exist_ok=True)
    for example in names:
        for trace in args.traces.split(","):
            row = run_case(example, trace, args.requests, folder, args.before)
            print(json.dumps(row), flush=True)
            rows.append(row)
    text = report(rows)
    full = "\n".join([*header(__file__, time.perf_counter() - started), text])
    print(full)
    (work / "report.md").write_text(full + "\n")
    write_json(work / "results.json", {"rows": rows})


if __name__ == "__main__":
    main()
