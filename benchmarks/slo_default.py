"""The derived SLO: what it is per bundled example, whether hardware-aware keeps the seed's
first-token lead by it, and what the simulator's goodput rate costs `plan`.

Run (from the repository root, in the dev venv):

    python benchmarks/slo_default.py [--traces DIR] [--requests 4000] [--loads 0.3,0.5,0.7]
        [--parts slos,seed,plan]

- slos: each bundled example's SLO per model (stated, or derived from its plan's servers).
- seed: round-robin against hardware-aware on the seed's fleets (`seed-mixed-8b`, 8K, and
  `seed-mixed-8b-16k`), the Azure conversation and code traces (their first --requests
  requests, time-scaled to each load of the fleet's saturation capacity), no SLO stated:
  round-robin's p99 and mean TTFT as multiples of hardware-aware's, with hardware-aware routing
  by the derived SLO (what runs now) and by plain seconds (what ran before an SLO was derived),
  side by side on the same requests, both judged by the derived SLO.
- plan: `fleetctl plan example:seed-mixed-8b --workload-from TRACE` timed, with the capacity
  it signs, then the whole trace replayed at that rate and at 1.25x it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from fleetctl.base.resources import examples
from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from fleetctl.routing.policy import RoutingConfig
from fleetctl.routing.scheduler import Aging
from fleetctl.sim.compare import at_load, compare, fleet_capacity, mean_shape
from fleetctl.sim.fleet import servers_from_plan, simulate
from fleetctl.sim.workload import load_trace
from harness.procs import REPO

TRACES = REPO.parent / "shared" / "traces"
FLEETS = ("seed-mixed-8b", "seed-mixed-8b-16k")


def slos() -> None:
    print("## SLO per bundled example (stated, or derived from the plan)\n")
    print("| example | model | TTFT s | TPOT ms | share | source | derived from |")
    print("|---|---|---|---|---|---|---|")
    catalog = load_catalog()
    for name, path in sorted(examples().items()):
        inv = load_inventory(path, catalog)
        for model, s in plan_fleet(inv).slos.items():
            tpot = "-" if s.tpot_s is None else f"{s.tpot_s * 1000:g}"
            print(
                f"| {name} | {model} | {s.ttft_s:g} | {tpot} | {s.share:g} | {s.source} "
                f"| {s.basis or '-'} |"
            )
    print()


def seed(traces: Path, requests: int, loads: list[float]) -> None:
    print("## The seed's claim by the derived SLO: round-robin over hardware-aware\n")
    print(
        "| fleet | trace | load | SLO | RR p99 / HA p99 | RR mean / HA mean | p99 ratio / mean "
        "ratio | same, HA by plain seconds | HA p99 s | HA met | HA (seconds) met | RR met |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    catalog = load_catalog()
    for fleet in FLEETS:
        inv = load_inventory(examples()[fleet], catalog)
        plan = plan_fleet(inv)
        model = inv.models[0].name
        servers = [s for s in servers_from_plan(plan.deployments, inv) if s.model == model]
        aging, workload = inv.spec.router.aging, inv.models[0].spec.workload
        for name in ("conv", "code"):
            items = load_trace(traces / f"AzureLLMInferenceTrace_{name}.csv", model)[:requests]
            capacity = fleet_capacity(servers, *mean_shape(items))
            estimate = workload.mean_output_tokens if workload else mean_shape(items)[1]
            for load in loads:
                c = compare(inv, plan, model, items, ("round-robin", "hardware-aware"), load=load)
                assert c.slo is not None and c.slo.derived
                # The rule before an SLO was derived: hardware-aware by plain seconds (a config
                # with no SLO), judged by the same derived SLO.
                plain = simulate(
                    servers,
                    at_load(items, load, capacity),
                    "hardware-aware",
                    config=RoutingConfig.of(inv),
                    aging=Aging(aging.factor, aging.window_s, aging.enabled),
                    output_estimate={model: estimate},
                    slo=c.slo,
                ).summary()
                rr = c.results["round-robin"].summary()
                ha = c.results["hardware-aware"].summary()
                p99 = rr["ttft_p99_s"] / ha["ttft_p99_s"]
                mean = rr["ttft_mean_s"] / ha["ttft_mean_s"]
                p99_plain = rr["ttft_p99_s"] / plain["ttft_p99_s"]
                mean_plain = rr["ttft_mean_s"] / plain["ttft_mean_s"]
                print(
                    f"| {fleet} | {name} | {load:.2f} | {c.slo.text()} | {p99:.2f} | {mean:.2f} "
                    f"| {p99 / mean:.2f} | {p99_plain:.2f} / {mean_plain:.2f} "
                    f"| {ha['ttft_p99_s']:.2f} | {ha['slo_attainment']:.1%} "
                    f"| {plain['slo_attainment']:.1%} | {rr['slo_attainment']:.1%} |"
                )
    print()


def plan(traces: Path) -> None:
    print("## plan --workload-from: time and the capacity it signs, replayed whole\n")
    print(
        "| trace | plan wall s | analytic req/s | signed req/s | SLO | whole trace at signed | "
        "at 1.25x |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in ("conv", "code"):
        trace = traces / f"AzureLLMInferenceTrace_{name}.csv"
        cmd = [sys.executable, "-m", "fleetctl", "plan", "example:seed-mixed-8b"]
        cmd += ["--workload-from", str(trace), "--json"]
        t = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout
        wall = time.perf_counter() - t
        check = json.loads(out)["capacity_check"]["llama-3-8b"]
        signed = check["goodput_rps"]
        shares = []
        for rate in (signed, 1.25 * signed):
            sim = [sys.executable, "-m", "fleetctl", "simulate", "example:seed-mixed-8b"]
            sim += ["--trace", str(trace), "--rate", f"{rate}", "--policies", "hardware-aware"]
            got = subprocess.run([*sim, "--json"], capture_output=True, text=True, check=True)
            shares.append(json.loads(got.stdout)["policies"]["hardware-aware"]["slo_attainment"])
        slo = check["replay"]["slo"]
        print(
            f"| {name} | {wall:.1f} | {check['analytic_rps']:.2f} | {signed:.2f} "
            f"| {slo['ttft_p99_s']} s, {slo['tpot_p99_ms']} ms, {slo['share']} "
            f"| {shares[0]:.1%} | {shares[1]:.1%} |"
        )
    print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--loads", default="0.3,0.5,0.7")
    ap.add_argument("--parts", default="slos,seed,plan")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if "slos" in parts:
        slos()
    if "seed" in parts:
        seed(args.traces, args.requests, [float(x) for x in args.loads.split(",")])
    if "plan" in parts:
        plan(args.traces)


if __name__ == "__main__":
    main()
