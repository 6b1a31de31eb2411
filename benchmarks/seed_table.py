"""The seed's claim, simulated: round-robin against hardware-aware on 4xA100 + 8xRTX 4090.

Run: python benchmarks/seed_table.py [--quick]

Part 1 sweeps the offered load for a 4K-context workload (Llama-3 8B, max_model_len 8192,
prompts lognormal around 3,000 tokens) and a 16K one (Llama-3.1 8B, max_model_len 16384,
prompts around 6,000 tokens), several seeds each, and prints round-robin's p99 and mean TTFT
as multiples of hardware-aware's. Part 2 replays both Azure traces at 70% and 90% of the
fleet's capacity with all five policies. Part 3 times the simulator itself.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

from fleetctl.base.resources import examples
from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from fleetctl.sim.compare import compare
from fleetctl.sim.fleet import servers_from_plan, simulate
from fleetctl.sim.workload import load_trace, parse_spec

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
FIVE = ("round-robin", "least-outstanding", "power-of-two", "kv-aware", "hardware-aware")
WORKLOADS = {
    "4K": ("seed-mixed-8b", "duration=900,prompt=3000,output=300"),
    "16K": ("seed-mixed-8b-16k", "duration=900,prompt=6000,output=300"),
}


def setup(example: str):  # type: ignore[no-untyped-def]
    inv = load_inventory(examples()[example], load_catalog())
    return inv, plan_fleet(inv)


def sweep(loads: list[float], seeds: list[int]) -> None:
    print("## Load sweep: round-robin vs hardware-aware\n")
    print(
        "| workload | load | RR p99 / HA p99 | RR mean / HA mean | HA p99 s | RR p99 s | RR preemptions |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, (example, spec) in WORKLOADS.items():
        inv, plan = setup(example)
        model = inv.models[0].name
        for load in loads:
            p99, mean, ha99, rr99, pre = [], [], [], [], []
            for seed in seeds:
                items = parse_spec(spec + f",max_context={inv.models[0].spec.max_context}", model)
                c = compare(
                    inv,
                    plan,
                    model,
                    items.generate(seed),
                    ("round-robin", "hardware-aware"),
                    load=load,
                    seed=seed,
                )
                rr = c.results["round-robin"].summary()
                ha = c.results["hardware-aware"].summary()
                p99.append(rr["ttft_p99_s"] / ha["ttft_p99_s"])
                mean.append(rr["ttft_mean_s"] / ha["ttft_mean_s"])
                ha99.append(ha["ttft_p99_s"])
                rr99.append(rr["ttft_p99_s"])
                pre.append(rr["preemptions"])
            print(
                f"| {label} | {load:.2f} | {statistics.mean(p99):.2f} ({min(p99):.2f}-{max(p99):.2f}) "
                f"| {statistics.mean(mean):.2f} | {statistics.mean(ha99):.2f} | {statistics.mean(rr99):.2f} "
                f"| {statistics.mean(pre):.0f} |"
            )
    print()


def traces(loads: list[float]) -> None:
    print("## Azure traces, five policies (Llama-3.1 8B, max_model_len 16384)\n")
    inv, plan = setup("seed-mixed-8b-16k")
    model = inv.models[0].name
    print(
        "| trace | load | policy | TTFT mean s | p50 | p90 | p99 | TPOT ms | completed | starved | preemptions |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("conv", "code"):
        items = load_trace(TRACES / f"AzureLLMInferenceTrace_{name}.csv", model)
        for load in loads:
            c = compare(inv, plan, model, items, FIVE, load=load)
            best = min(r.summary()["ttft_p99_s"] for r in c.results.values())
            for pol, r in c.results.items():
                s = r.summary()
                mark = " **lowest p99**" if s["ttft_p99_s"] == best else ""
                print(
                    f"| {name} | {load:.0%} | {pol}{mark} | {s['ttft_mean_s']:.3f} | {s['ttft_p50_s']:.3f} "
                    f"| {s['ttft_p90_s']:.3f} | {s['ttft_p99_s']:.3f} | {s['tpot_mean_s'] * 1e3:.1f} "
                    f"| {s['completed']} | {s['starved']} | {s['preemptions']} |"
                )
    print()


def speed() -> None:
    print("## Simulator speed (one-hour conv trace at its real rate)\n")
    print("| fleet | requests | policy | simulated s | wall s | x real time |")
    print("|---|---|---|---|---|---|")
    items = load_trace(TRACES / "AzureLLMInferenceTrace_conv.csv", "llama-3.1-8b")
    inv, plan = setup("seed-mixed-8b-16k")
    base = servers_from_plan(plan.deployments, inv)
    for copies in (1, 4):
        servers = [replace(s, name=f"{s.name}#{c}") for c in range(copies) for s in base]
        for n in (5000, len(items)) if copies == 1 else (len(items),):
            subset = items[:n]
            # More servers: proportionally denser arrivals, so each server sees the same load.
            if copies > 1:
                from fleetctl.sim.workload import scale_time

                subset = scale_time(subset, copies)
            for pol in ("round-robin", "hardware-aware"):
                t = time.perf_counter()
                simulate(servers, subset, pol)
                wall = time.perf_counter() - t
                span = subset[-1].arrival
                print(
                    f"| {len(servers)} servers | {n:,} | {pol} | {span:.0f} | {wall:.2f} | {span / wall:.0f} |"
                )
    print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        sweep([0.45], [1])
        speed()
        return
    sweep([0.3, 0.4, 0.45, 0.5], [1, 2, 3])
    traces([0.7, 0.9])
    speed()


if __name__ == "__main__":
    main()
