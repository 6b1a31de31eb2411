"""Prefill/decode splits in the simulator: the planner's choice against the best colocated
plan and a naive split, on real traces, as goodput.

    python benchmarks/disagg_sim.py [--requests 3000] [--quick] [--networks N,...]
        [--cases C,...] [--loads 0.2,0.4,0.6,0.8] [--traces DIR] [--out DIR]

Fleets: the seed fleet (4 A100 80GB + 8 RTX 4090, `inventory/seed-mixed-8b.yaml`) and
`example:mooncake-mixed` (4 A100 + 14 RTX 4090), each on a 100 Gb RDMA network and on 10 GbE
TCP (`nodes[].network`). Traces: the Azure conversation and code traces on the seed fleet, the
Mooncake conversation trace on mooncake-mixed; each model gets the SLO stated in CASES.

Each plan is made for the trace's own workload (its mean prompt and output lengths and peak
rate, as `plan --workload-from TRACE` derives them), not the fleet file's.

Per fleet, network and trace, three arrangements on the same requests, all routed by
hardware-aware (prefill by routing/phases.py where split):
- **planner**: what `plan` chooses (`disaggregation: auto`): split or colocated;
- **colocated**: the same fleet with `disaggregation: off`;
- **naive split**: every A100 decodes, every 4090 prefills.

Goodput is measured two ways: the share of requests within both objectives at each load of
the sweep (`--loads`, fractions of the colocated servers' saturation throughput for the
trace's mean request), and the highest rate at which 90% of requests meet both (bisection
over `simulate`'s --rate, to 2%). The targets: where the planner splits on 100 Gb, at least
1.3x the colocated plan's 90% rate; where it keeps the servers colocated (10 GbE, short
prompts), it loses nothing; and its choice's share within both at least colocated's at every
load of the sweep.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(REPO))

from fleetctl.fleet.inventory import load_inventory  # noqa: E402
from fleetctl.model.catalog import load_catalog  # noqa: E402
from fleetctl.planner import plan_fleet  # noqa: E402
from fleetctl.routing.goodput import Slo  # noqa: E402
from fleetctl.sim.compare import at_rate, fleet_capacity, mean_shape  # noqa: E402
from fleetctl.sim.fleet import Server, servers_from_plan, simulate  # noqa: E402
from fleetctl.sim.traffic import workloads_from  # noqa: E402
from fleetctl.sim.workload import WorkItem, load_trace  # noqa: E402
from harness.results import header, out_dir  # noqa: E402

TRACES = REPO.parent / "shared" / "traces"
# (fleet file, trace file, TTFT s, TPOT ms, prompt divisor): the objectives a chat service
# states; a divisor > 1 makes a short-prompt trace of the same arrivals and outputs.
CASES = {
    "seed / Azure conv": ("seed-mixed-8b.yaml", "AzureLLMInferenceTrace_conv.csv", 2.0, 50.0, 1),
    "seed / Azure code": ("seed-mixed-8b.yaml", "AzureLLMInferenceTrace_code.csv", 4.0, 100.0, 1),
    "mooncake-mixed / Mooncake": (
        "mooncake-mixed.yaml",
        "mooncake_conversation_trace.jsonl",
        8.0,
        50.0,
        1,
    ),
    # The objectives derived for that fleet (fleet/slo.py), which both arrangements can meet
    # for 99% of requests: 6% of Mooncake's prompts take over 8 s to prefill alone on an A100.
    "mooncake-mixed / Mooncake (derived SLO)": (
        "mooncake-mixed.yaml",
        "mooncake_conversation_trace.jsonl",
        30.0,
        110.0,
        1,
    ),
    "seed / short prompts (Azure conv / 8)": (
        "seed-mixed-8b.yaml",
        "AzureLLMInferenceTrace_conv.csv",
        2.0,
        50.0,
        8,
    ),
}
NETWORKS = {"100 Gb RDMA": (100.0, True), "10 GbE": (10.0, False)}
ATTAINMENT = 0.9
FLOOR = 1e-3  # req/s: a 90% rate below this means the arrangement never gets there


def inventory(fleet: str, ttft: float, tpot: float, gbps: float, rdma: bool, mode: str) -> Path:
    """The fleet file with every node's network, the model's SLO and its disaggregation mode,
    written beside the other runs' (one per arrangement)."""
    text = (REPO / "inventory" / fleet).read_text()
    net = f"\n    network: {{gbps: {gbps:g}, rdma: {str(rdma).lower()}}}"
    for gpu in ("A100-SXM4-80GB", "RTX-4090"):
        line = f"    gpus: {{type: {gpu}, count: 1}}"
        text = text.replace(line, line + net)
    extra = f"    slo: {{ttft_p99_s: {ttft:g}, tpot_p99_ms: {tpot:g}}}\n"
    extra += f"    disaggregation: {mode}\n"
    anchor = "    workload:"
    at = text.index(anchor)
    end = text.index("\n", at) + 1
    text = text[:end] + extra + text[end:]
    path = WORK / f"{fleet.removesuffix('.yaml')}-{gbps:g}-{mode}.yaml"
    path.write_text(text)
    return path


def naive(servers: list[Server]) -> list[Server]:
    """Every A100 decodes, every other GPU prefills."""
    return [
        replace(s, role="decode" if s.gpu_type.startswith("A100") else "prefill") for s in servers
    ]


def attainment(
    servers: list[Server], items: list[WorkItem], rate: float, slo: Slo
) -> dict[str, Any]:
    r = simulate(servers, at_rate(items, rate), "hardware-aware", slo=slo)
    s = r.summary()
    return {
        "rate": rate,
        "slo_attainment": s["slo_attainment"],
        "ttft_p99_s": s["ttft_p99_s"],
        "tpot_p90_ms": s["tpot_p90_s"] * 1000,
    }


def rate_at_90(servers: list[Server], items: list[WorkItem], slo: Slo, start: float) -> float:
    """The highest rate at which ATTAINMENT of the requests meet both objectives (to 2%)."""
    lo, hi = 0.0, start
    while attainment(servers, items, hi, slo)["slo_attainment"] >= ATTAINMENT:
        lo, hi = hi, hi * 2
    while hi - lo > 0.02 * hi:
        if hi < start / 64:  # not even at 1/64 of the start: it never gets there
            return 0.0
        mid = (lo + hi) / 2
        if attainment(servers, items, mid, slo)["slo_attainment"] >= ATTAINMENT:
            lo = mid
        else:
            hi = mid
    return lo


def shortened(trace: str, divisor: int) -> Path:
    """The Azure trace with every prompt `divisor` times shorter (at least one token)."""
    if divisor == 1:
        return TRACES / trace
    path = WORK / f"{Path(trace).stem}-prompts-div{divisor}.csv"
    lines = (TRACES / trace).read_text().splitlines()
    rows = [lines[0]]
    for line in lines[1:]:
        at, prompt, output = line.rsplit(",", 2)
        rows.append(f"{at},{max(1, int(prompt) // divisor)},{output}")
    path.write_text("\n".join(rows) + "\n")
    return path


def run_case(case: str, net: str, requests: int, loads: list[float]) -> dict[str, Any]:
    fleet, trace_name, ttft, tpot, divisor = CASES[case]
    trace = shortened(trace_name, divisor)
    gbps, rdma = NETWORKS[net]
    catalog = load_catalog()
    arrangements: dict[str, list[Server]] = {}
    chosen = ""
    for mode in ("auto", "off"):
        inv = load_inventory(inventory(fleet, ttft, tpot, gbps, rdma, mode), catalog)
        # Planned for the trace's own shape and peak rate, as `plan --workload-from TRACE`.
        inv, _ = workloads_from(inv, trace)
        plan = plan_fleet(inv)
        servers = servers_from_plan(plan.deployments, inv)
        if mode == "auto":
            g = plan.models[0].disaggregation
            chosen = "split" if g is not None and g.chosen else "colocated"
            reason = g.reason if g is not None else "not weighed"
            arrangements["planner"] = servers
        else:
            arrangements["colocated"] = servers
            planned = plan.models[0].capacity_rps
            arrangements["naive split"] = naive(servers)
    model = inv.models[0].name
    items = load_trace(trace, model, requests)
    # Loads of the colocated servers' saturation for the trace's mean request: their goodput
    # can be 0 (no rate meets the SLO's share), their saturation is not.
    capacity = fleet_capacity(arrangements["colocated"], *mean_shape(items))
    slo = Slo(ttft, tpot / 1000)
    out: dict[str, Any] = {
        "planner chose": chosen,
        "why": reason,
        "slo": [ttft, tpot],
        "colocated saturation": capacity,
        "colocated goodput (planned)": planned,
    }
    for name, servers in arrangements.items():
        if name == "planner" and chosen == "colocated":  # the same servers: the same figures
            continue
        sweep = [attainment(servers, items, load * capacity, slo) for load in loads]
        out[name] = {"loads": sweep, "rate_at_90": rate_at_90(servers, items, slo, capacity / 4)}
    if chosen == "colocated":
        out["planner"] = out["colocated"]
    return out


def report(results: dict[str, dict[str, Any]], took: float, loads: list[float]) -> list[str]:
    lines = header(__file__, took)
    for key, r in results.items():
        ttft, tpot = r["slo"]
        lines += [
            "",
            f"**{key}** (SLO TTFT <= {ttft:g} s, TPOT <= {tpot:g} ms): the planner chose "
            f"{r['planner chose']} ({r['why']}); colocated: saturation "
            f"{r['colocated saturation']:.2f} req/s, planned goodput "
            f"{r['colocated goodput (planned)']:.2f}",
            "",
            "| arrangement | "
            + " | ".join(f"within both at {x:.0%}" for x in loads)
            + f" | TTFT p99 s at {loads[-1]:.0%} | TPOT p90 ms at {loads[-1]:.0%} "
            f"| rate with {ATTAINMENT:.0%} within both, req/s | vs colocated |",
            "|---|" + "---|" * (len(loads) + 4),
        ]
        base = r["colocated"]["rate_at_90"]
        for name in ("planner", "colocated", "naive split"):
            a = r[name]
            # Below the bisection's floor a rate is "never": no ratio to it means anything.
            versus = f"{a['rate_at_90'] / base:.2f}x" if base > FLOOR else "colocated never does"
            rate = f"{a['rate_at_90']:.2f}" if a["rate_at_90"] > FLOOR else "never"
            shares = " | ".join(f"{x['slo_attainment']:.1%}" for x in a["loads"])
            last = a["loads"][-1]
            lines.append(
                f"| {name} | {shares} | {last['ttft_p99_s']:.2f} | {last['tpot_p90_ms']:.0f} "
                f"| {rate} | {versus} |"
            )
        held = all(
            p["slo_attainment"] >= c["slo_attainment"]
            for p, c in zip(r["planner"]["loads"], r["colocated"]["loads"], strict=True)
        )
        lines += [
            "",
            f"The planner's choice within both at least colocated's at every load: {held}",
        ]
    return lines


def main() -> None:
    global WORK, TRACES
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument(
        "--loads", default="0.2,0.4,0.6,0.8", help="fractions of the colocated saturation"
    )
    ap.add_argument("--quick", action="store_true", help="600 requests, one network")
    ap.add_argument("--cases", help=f"a comma-separated subset of: {', '.join(CASES)}")
    ap.add_argument(
        "--networks", help=f"a comma-separated subset of: {', '.join(NETWORKS)} (default: all)"
    )
    ap.add_argument("--traces", type=Path, default=TRACES, help="the public traces' folder")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "disagg_sim"))
    args = ap.parse_args()
    WORK = out_dir(args.out)
    TRACES = args.traces
    loads = [float(x) for x in args.loads.split(",")]
    requests = 600 if args.quick else args.requests
    nets = ["100 Gb RDMA"] if args.quick else list(NETWORKS)
    if args.networks:
        nets = [n.strip() for n in args.networks.split(",")]
        unknown = [n for n in nets if n not in NETWORKS]
        if unknown:
            ap.error(f"unknown network {unknown[0]!r}: one of {', '.join(NETWORKS)}")
    cases = list(CASES)
    if args.cases:
        cases = [c.strip() for c in args.cases.split(",")]
        unknown = [c for c in cases if c not in CASES]
        if unknown:
            ap.error(f"unknown case {unknown[0]!r}: one of {', '.join(CASES)}")
    started = time.monotonic()
    results = {}
    for case in cases:
        for net in nets:
            key = f"{case}, {net}"
            print(f"{key} ...", flush=True)
            results[key] = run_case(case, net, requests, loads)
    lines = report(results, time.monotonic() - started, loads)
    (WORK / "report.md").write_text("\n".join(lines) + "\n")
    (WORK / "results.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


WORK = REPO / "benchmarks" / "out" / "disagg_sim"

if __name__ == "__main__":
    main()
