"""Goodput in the simulator: every routing policy over public traces at 70% and 90% load, each
trace with its SLO stated, judged by the share of requests that met both objectives.

Run (from the repository root, in the dev venv):

    python benchmarks/goodput_sim.py [--cases conv,code,mooncake,goodput-mixed]
        [--loads 0.7,0.9] [--requests 4000] [--policies all] [--out benchmarks/out/goodput_sim]

Cases (fleet, trace, SLO as p99 TTFT and TPOT; the objectives a chat, a code-completion and a
long-context service could hold on these fleets):
- conv: example:seed-mixed-8b (4 A100 + 8 RTX 4090, Llama-3 8B, 8K), the Azure conversation
  trace; TTFT <= 2 s, TPOT <= 50 ms.
- code: the same fleet, the Azure code trace (2K-token prompts, 28-token answers: every step
  carries a prefill chunk); TTFT <= 4 s, TPOT <= 250 ms.
- mooncake: example:mooncake-mixed (4 A100 + 14 RTX 4090, Llama-3.1 8B, 128K / 47K), the
  Mooncake conversation trace; TTFT <= 16 s, TPOT <= 100 ms.
- goodput-mixed: benchmarks/fleets/goodput-mixed.yaml (1 A100 + 3 RTX 4090), the first 300
  Mooncake requests with prompts up to 40K, the HTTP replay's fleet and requests
  (benchmarks/goodput_replay.py) at the replay's own load; its inventory's SLO.

Each case's first --requests requests are time-scaled to each load (`simulate --load`); the SLO
is given to every policy's run as `simulate --slo` gives it (hardware-aware routes by it). Per
case: TTFT p50/p99, TPOT p50/p90/p99, E2E p99 and SLO attainment per policy, the goodput winner,
and whether hardware-aware has the highest attainment and the lowest p99 TTFT.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fleetctl.base.resources import examples
from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from fleetctl.routing.goodput import Slo
from fleetctl.routing.registry import policy_names
from fleetctl.sim.compare import compare
from fleetctl.sim.workload import WorkItem, load_trace
from harness.procs import REPO
from harness.results import header, out_dir, write_json

TRACES = REPO.parent / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_conversation_trace.jsonl"
CASES: dict[str, tuple[str, Path, Slo | None]] = {
    "conv": ("seed-mixed-8b", TRACES / "AzureLLMInferenceTrace_conv.csv", Slo(2.0, 0.050)),
    "code": ("seed-mixed-8b", TRACES / "AzureLLMInferenceTrace_code.csv", Slo(4.0, 0.250)),
    "mooncake": ("mooncake-mixed", MOONCAKE, Slo(16.0, 0.100)),
    # The replay's fleet: its SLO is its inventory's; None keeps it.
    "goodput-mixed": (str(REPO / "benchmarks" / "fleets" / "goodput-mixed.yaml"), MOONCAKE, None),
}
# The replay's requests: prompts up to 40K tokens, 300 of them, at the trace's own times on
# emulators 4x faster than their GPUs (4x the trace's gaps in model time).
REPLAY_MAX_PROMPT, REPLAY_REQUESTS, REPLAY_SCALE = 40_000, 300, 4.0


def items_of(case: str, model: str, n: int) -> list[WorkItem]:
    _, trace, _ = CASES[case]
    if case != "goodput-mixed":
        return load_trace(trace, model, n)
    rows = [w for w in load_trace(trace, model) if w.prompt <= REPLAY_MAX_PROMPT]
    return [replace(w, id=i) for i, w in enumerate(rows[:REPLAY_REQUESTS])]


def run_case(case: str, load: float | None, n: int, policies: list[str]) -> dict[str, Any]:
    fleet, _, slo = CASES[case]
    path = Path(fleet) if fleet.endswith(".yaml") else examples()[fleet]
    inv = load_inventory(path, load_catalog())
    model = inv.models[0].name
    items = items_of(case, model, n)
    rate = None
    if load is None:  # the replay's own arrivals, stretched to model time
        rate = len(items) / (items[-1].arrival * REPLAY_SCALE)
    c = compare(inv, plan_fleet(inv), model, items, policies, load=load, rate=rate, slo=slo)
    rows = {name: r.summary() for name, r in c.results.items()}
    ours = rows["hardware-aware"]
    best_peer = max(
        (r["slo_attainment"] for n_, r in rows.items() if n_ != "hardware-aware"), default=0
    )
    best_ttft = min(
        (r["ttft_p99_s"] for n_, r in rows.items() if n_ != "hardware-aware"), default=math.inf
    )
    assert c.slo is not None
    return {
        "case": case,
        "load": round(c.offered_rps / c.capacity_rps, 3),
        "requests": len(c.items),
        "slo": {"ttft_s": c.slo.ttft_s, "tpot_s": c.slo.tpot_s},
        "winner": c.goodput_winner(),
        "ours_best_on_goodput": ours["slo_attainment"] >= best_peer,
        "ours_best_on_ttft_p99": ours["ttft_p99_s"] <= best_ttft,
        "policies": rows,
    }


def report(results: list[dict[str, Any]]) -> str:
    out: list[str] = []
    for res in results:
        slo = res["slo"]
        out += [
            "",
            f"**{res['case']}** at {res['load']:.0%} load, {res['requests']} requests, SLO "
            f"TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s'] * 1000:g} ms: winner "
            f"{res['winner']}; hardware-aware highest on goodput: "
            f"{'yes' if res['ours_best_on_goodput'] else 'NO'}, lowest p99 TTFT: "
            f"{'yes' if res['ours_best_on_ttft_p99'] else 'NO'}",
            "",
            "| policy | SLO met | TTFT p50 s | p99 | TPOT p50 ms | p90 | p99 | E2E p99 s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in sorted(res["policies"].items(), key=lambda x: -x[1]["slo_attainment"]):
            out.append(
                f"| {name} | {r['slo_attainment']:.1%} | {r['ttft_p50_s']:.2f} "
                f"| {r['ttft_p99_s']:.2f} | {r['tpot_p50_s'] * 1e3:.0f} "
                f"| {r['tpot_p90_s'] * 1e3:.0f} | {r['tpot_p99_s'] * 1e3:.0f} "
                f"| {r['e2e_p99_s']:.1f} |"
            )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--loads", default="0.7,0.9")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--policies", default="all", help="comma-separated, or all")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "goodput_sim"))
    args = ap.parse_args()
    policies = policy_names() if args.policies == "all" else args.policies.split(",")
    if "hardware-aware" not in policies:
        policies.append("hardware-aware")
    started = time.perf_counter()
    results = []
    for case in args.cases.split(","):
        loads: list[float | None] = [float(x) for x in args.loads.split(",")]
        for load in loads if case != "goodput-mixed" else [None]:
            res = run_case(case, load, args.requests, policies)
            print(
                f"{case} {res['load']:.0%}: winner {res['winner']}, ours "
                f"{res['policies']['hardware-aware']['slo_attainment']:.1%}",
                flush=True,
            )
            results.append(res)
    text = report(results)
    full = "\n".join([*header(__file__, time.perf_counter() - started), text])
    print(full)
    work = out_dir(args.out)
    (work / "report.md").write_text(full + "\n")
    write_json(work / "results.json", {"results": json.loads(json.dumps(results, default=str))})


if __name__ == "__main__":
    main()
