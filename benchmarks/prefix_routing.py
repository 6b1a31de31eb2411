"""Prefix-cache-aware routing on the Mooncake conversation trace, simulated: every policy side
by side on the example mixed fleet (inventory/mooncake-mixed.yaml) at 70% and 90% load.

Run: python benchmarks/prefix_routing.py [--requests N] [--start K] [--loads 0.7,0.9]
[--policies a,b] [--traces DIR]

`--start K` replays requests K to K+N (another window of the hour, its arrivals from 0).

Load is `fleetctl simulate --load`'s: arrivals time-scaled to that share of the planner's
capacity for the trace's mean request. Prints TTFT (mean, p50, p90, p99), TPOT, the prefix
hit rate, prefill tokens saved and preemptions per policy, and hardware-aware's p99 and mean
as ratios to the best peer policy's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from fleetctl.base.resources import examples
from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from fleetctl.sim.compare import compare
from fleetctl.sim.workload import load_trace

TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
)
PEERS = ("least-outstanding", "power-of-two", "cache-aware", "prefix-kv", "kv-router")
OURS = "hardware-aware"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=0, help="N requests (0: all)")
    ap.add_argument("--start", type=int, default=0, help="skip the first K requests")
    ap.add_argument("--traces", type=Path, default=TRACE.parent, help="the traces' folder")
    ap.add_argument("--loads", default="0.7,0.9")
    ap.add_argument("--policies", default=",".join((*PEERS, OURS)))
    ap.add_argument("--example", default="mooncake-mixed")
    args = ap.parse_args()
    inv = load_inventory(examples()[args.example], load_catalog())
    plan = plan_fleet(inv)
    model = inv.models[0].name
    path = args.traces / TRACE.name
    items = load_trace(path, model, args.start + args.requests if args.requests else None)
    items = items[args.start :]
    # Another window: its first arrival at 0 and its requests numbered from 0, as a trace.
    t0 = items[0].arrival if items else 0.0
    items = [replace(w, id=k, arrival=w.arrival - t0) for k, w in enumerate(items)]
    policies = args.policies.split(",")
    print(
        f"{len(items)} requests from #{args.start}, {len(plan.deployments)} servers "
        f"({args.example})\n"
    )
    print(
        "| load | policy | TTFT mean s | p50 | p90 | p99 | TPOT ms | prefix hit | "
        "prefill saved (M tok) | preemptions | completed | rejected | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for load in (float(x) for x in args.loads.split(",")):
        t0 = time.perf_counter()
        c = compare(inv, plan, model, items, policies, load=load)
        wall = (time.perf_counter() - t0) / len(policies)
        sums = {p: r.summary() for p, r in c.results.items()}
        for p, s in sums.items():
            print(
                f"| {load:.0%} | {p} | {s['ttft_mean_s']:.2f} | {s['ttft_p50_s']:.2f} "
                f"| {s['ttft_p90_s']:.2f} | {s['ttft_p99_s']:.2f} | {s['tpot_mean_s'] * 1e3:.0f} "
                f"| {s['prefix_hit_rate']:.1%} | {s['prefill_saved_tokens'] / 1e6:.1f} "
                f"| {s['preemptions']} | {s['completed']} | {s['rejected']} | {wall:.0f} |"
            )
        peers = [p for p in PEERS if p in sums]
        if OURS in sums and peers:
            best99 = min(peers, key=lambda p: sums[p]["ttft_p99_s"])
            best_mean = min(peers, key=lambda p: sums[p]["ttft_mean_s"])
            ours = sums[OURS]
            print(
                f"\nload {load:.0%}: best peer p99 {best99} {sums[best99]['ttft_p99_s']:.2f} s, "
                f"{OURS} {ours['ttft_p99_s']:.2f} s: "
                f"{sums[best99]['ttft_p99_s'] / ours['ttft_p99_s']:.2f}x lower; best peer mean "
                f"{best_mean} {sums[best_mean]['ttft_mean_s']:.2f} s, {OURS} "
                f"{ours['ttft_mean_s']:.2f} s ({sums[best_mean]['ttft_mean_s'] / ours['ttft_mean_s']:.2f}x)\n"
            )


if __name__ == "__main__":
    main()
