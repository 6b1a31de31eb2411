"""Cost plans: what `plan --objective cost` saves, checked against the SLOs in simulation.

Run (from the repository root, in the dev venv):

    python benchmarks/cost_plan.py [--trace conv|code|PATH] [--speedup 4] [--limit N]
        [--ttft 2.0] [--tpot 100] [--model llama-3.1-8b] [--max-context 16384] [--buckets 4]
        [--json FILE]

The Azure conversation trace (../shared/traces) is sped up --speedup times (its arrivals
compressed: the same requests at that many times the rate). Its workload is derived as
`plan --workload-from` does (sim/workload.py derive_workload: the 95th percentile of its
5-minute rates, mean prompt and output). One model (Llama-3.1 8B, bf16 or fp8, max_context
--max-context with min_context 4096: servers that hold less run shorter lengths) gets an SLO
of --ttft seconds TTFT p99 and --tpot ms TPOT p99. With --buckets N (default 4, as `plan
--workload-from` derives them; 0: the mean request only), the workload also carries N length
buckets (sim/workload.py length_buckets: prompt-length halves x output-length halves), which
the cost objective sizes each on the GPUs that carry it cheapest.

Fleets, priced by the GPU profiles' default cost_per_hour (profiles/gpus/*.yaml, on-demand
list prices circa 2025, sources there):
- mixed: 8x H100-SXM-80GB (2 nodes of 4), 8x A100-SXM4-80GB (4 nodes of 2), 16x L40S,
  16x RTX-4090, 16x L4, 16x A10G: more than the workload needs of every type;
- single: for each GPU type, 32 GPUs of it alone (as many nodes of the same shape).
Each fleet is planned with the cost objective; the mixed one with the throughput objective
too. A cost plan is planned as `plan --objective cost --workload-from` plans it: checked by
the simulator on the trace against the SLO and re-solved with more headroom where it misses
(fleetctl/whatif/slo_check.py plan_within_slos). Every plan then runs the sped-up trace in fleetctl's
simulator once more for the figures below (fleetctl/whatif/predict.py what_if:
sim/fleet.py servers_from_plan and simulate, route-serve's hardware-aware policy, the
trace's own arrivals), which gives TTFT p99, TPOT p99 and the share of requests that met
both SLOs. A plan "meets the SLOs" when its simulated TTFT p99 and TPOT p99 are within them,
every request finished, and the planner reports no shortfall (capacity x target_utilization
covers the derived peak rate: the simulated hour's mean rate is below that peak).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fleetctl.fleet.inventory import Inventory, load_inventory  # noqa: E402
from fleetctl.model.catalog import load_catalog  # noqa: E402
from fleetctl.planner import plan_fleet  # noqa: E402
from fleetctl.sim.traffic import BUCKETS  # noqa: E402
from fleetctl.sim.workload import (  # noqa: E402
    Bucket,
    derive_workload,
    length_buckets,
    load_trace,
    scale_time,
)
from fleetctl.whatif.predict import what_if  # noqa: E402
from fleetctl.whatif.slo_check import plan_within_slos  # noqa: E402

TRACES = REPO.parent / "shared" / "traces"
NAMED = {
    "conv": "AzureLLMInferenceTrace_conv.csv",
    "code": "AzureLLMInferenceTrace_code.csv",
}
# (GPU type, GPUs per node, nodes) of the mixed fleet.
MIXED = [
    ("H100-SXM-80GB", 4, 2),
    ("A100-SXM4-80GB", 2, 4),
    ("L40S", 1, 16),
    ("RTX-4090", 1, 16),
    ("L4", 1, 16),
    ("A10G", 1, 16),
]
SINGLE_GPUS = 32


def inventory_text(
    fleet: list[tuple[str, int, int]],
    model: str,
    workload: dict[str, Any],
    ttft: float,
    tpot: float,
    max_context: int,
    buckets: Sequence[Bucket] = (),
) -> str:
    lines = ["ssh: {user: ubuntu}", "nodes:"]
    for i, (gpu, count, nodes) in enumerate(fleet):
        lines += [
            f"  - name: n{i}-[1:{nodes}]",
            f"    host: 10.{i}.0.[1:{nodes}]",
            f"    gpus: {{type: {gpu}, count: {count}}}",
        ]
    lines += [
        "models:",
        f"  - name: {model}",
        f"    profile: {model}",
        "    variants:",
        f"      bf16: {{source: meta-llama/{model}}}",
        f"      fp8: {{source: neuralmagic/{model}-FP8}}",
        f"    max_context: {max_context}",
        "    min_context: 4096",
        f"    slo: {{ttft_p99_s: {ttft}, tpot_p99_ms: {tpot}}}",
        "    workload:",
        f"      requests_per_s: {workload['requests_per_s']:.4f}",
        f"      mean_prompt_tokens: {workload['mean_prompt_tokens']}",
        f"      mean_output_tokens: {workload['mean_output_tokens']}",
    ]
    if buckets:
        lines.append("      buckets:")
        lines += [
            f"        - {{share: {b.share:.6f}, mean_prompt_tokens: {b.mean_prompt_tokens}, "
            f"mean_output_tokens: {b.mean_output_tokens}, max_tokens: {b.max_tokens}}}"
            for b in buckets
        ]
    return "\n".join(lines) + "\n"


def run(
    name: str,
    inv: Inventory,
    objective: str,
    items: list[Any],
    model: str,
    ttft: float,
    tpot: float,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    if objective == "cost":  # as `plan --objective cost --workload-from TRACE` plans
        plan = plan_within_slos(
            inv,
            lambda headroom: plan_fleet(inv, objective="cost", headroom=headroom),
            {model: items},
        )
    else:
        plan = plan_fleet(inv, objective=objective)
    planned = time.perf_counter() - t0
    t0 = time.perf_counter()
    fig = what_if(inv, plan.deployments, {model: items})
    simulated = time.perf_counter() - t0
    used: dict[str, int] = {}
    for d in plan.deployments:
        key = f"{d.gpu_type} {d.variant} TP{d.tensor_parallel_size}"
        used[key] = used.get(key, 0) + d.tensor_parallel_size
    meets = (
        fig.ttft_p99_s is not None
        and fig.tpot_p99_ms is not None
        and fig.ttft_p99_s <= ttft
        and fig.tpot_p99_ms <= tpot
        and fig.served == fig.requests
        and not plan.unplaced
        and not plan.models[0].shortfall_rps
    )
    m = plan.models[0]
    return {
        "fleet": name,
        "objective": objective,
        "gpus": sum(used.values()),
        "used": used,
        "cost_per_hour": plan.cost_per_hour,
        "planned_cost_per_million_output_tokens": plan.cost_per_million_output_tokens,
        "capacity_rps": m.capacity_rps,
        "slo_rounds": plan.solver.get("slo_rounds"),
        "headroom": [c.headroom for c in plan.slo_checks],
        "buckets": [b.to_json() for b in m.buckets],
        "shortfall_rps": m.shortfall_rps,
        "unplaced": [u.model for u in plan.unplaced],
        "ttft_p99_s": fig.ttft_p99_s,
        "tpot_p99_ms": fig.tpot_p99_ms,
        "slo_attainment": fig.slo_attainment,
        "served": fig.served,
        "requests": fig.requests,
        "simulated_cost_per_million_output_tokens": fig.cost_per_million_output_tokens,
        "meets_slo": meets,
        "plan_s": round(planned, 3),
        "sim_s": round(simulated, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="conv")
    ap.add_argument("--speedup", type=float, default=4.0)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--ttft", type=float, default=2.0)
    ap.add_argument("--tpot", type=float, default=100.0)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--max-context", type=int, default=16384)
    ap.add_argument("--buckets", type=int, default=BUCKETS, help="length buckets (0: mean only)")
    ap.add_argument("--only", default=None, help="comma-separated GPU types for the singles")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    path = TRACES / NAMED[args.trace] if args.trace in NAMED else Path(args.trace)
    items = load_trace(path, args.model, limit=args.limit)
    items = scale_time(items, args.speedup)
    items = [w for w in items if w.prompt + w.output <= args.max_context]
    derived = derive_workload(items, 4096)
    assert derived is not None
    workload = derived.to_json()
    buckets = length_buckets(items, args.buckets)
    print(f"trace {path.name} x{args.speedup:g}: {len(items)} requests, workload {workload}")
    for b in buckets:
        print(f"  bucket {b}")
    catalog = load_catalog()
    tmp = REPO / "benchmarks" / "out" / "cost_plan"
    tmp.mkdir(parents=True, exist_ok=True)

    def inv_of(name: str, fleet: list[tuple[str, int, int]]) -> Inventory:
        f = tmp / f"{name}.yaml"
        text = inventory_text(
            fleet, args.model, workload, args.ttft, args.tpot, args.max_context, buckets
        )
        f.write_text(text)
        return load_inventory(f, catalog)

    rows = []
    mixed = inv_of("mixed", MIXED)
    for objective in ("throughput", "cost"):
        rows.append(run("mixed", mixed, objective, items, args.model, args.ttft, args.tpot))
        print(json.dumps(rows[-1]), flush=True)
    singles = [g for g, _, _ in MIXED]
    if args.only:
        singles = [g for g in singles if g in args.only.split(",")]
    for gpu, count, _ in MIXED:
        if gpu not in singles:
            continue
        inv = inv_of(f"only-{gpu}", [(gpu, count, SINGLE_GPUS // count)])
        rows.append(run(f"only {gpu}", inv, "cost", items, args.model, args.ttft, args.tpot))
        print(json.dumps(rows[-1]), flush=True)
    cost_mixed = rows[1]
    ok_singles = [r for r in rows[2:] if r["meets_slo"] and r["cost_per_hour"] is not None]
    summary: dict[str, Any] = {
        "trace": path.name,
        "speedup": args.speedup,
        "requests": len(items),
        "workload": workload,
        "buckets": [vars(b) for b in buckets],
        "slo": {"ttft_p99_s": args.ttft, "tpot_p99_ms": args.tpot},
        "rows": rows,
    }
    summary["cost_plan_meets_slo"] = cost_mixed["meets_slo"]
    if ok_singles:
        best = min(ok_singles, key=lambda r: r["cost_per_hour"])
        summary["cheapest_single"] = best["fleet"]
        if cost_mixed["meets_slo"]:  # a saving only counts where both meet the SLOs
            summary["mixed_saving_vs_single"] = (
                1 - cost_mixed["cost_per_hour"] / best["cost_per_hour"]
            )
    summary["cost_saving_vs_throughput"] = (
        1 - cost_mixed["cost_per_hour"] / rows[0]["cost_per_hour"]
    )
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
