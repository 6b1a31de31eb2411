"""What-if accuracy: how close `plan --what-if`'s prediction is to the fleet it predicts, live.

Run (from the repository root, in the dev venv):

    python benchmarks/whatif_accuracy.py [--trace FILE] [--requests 600] [--skip 0] [--time-scale 4]
        [--check PCT] [--truth-speed X] [--quick] [--out DIR]

Two plans of one Llama-3 8B BF16 fleet (max_model_len 8192), each the planner's placement for
an inventory: `mixed` (1 A100 SXM4 80GB + 3 RTX 4090) and `rtx` (3 RTX 4090). The requests are
the first N rows of the Azure LLM inference code trace (../shared/traces) at the trace's own
times (no --load rescaling: what `plan --what-if` does), each with max_tokens = its output
length, as route-serve's request log would record it.

Predicted: fleetctl.whatif.predict.what_if, the function behind `plan --what-if` and `apply --gate`
(the simulator's engines, the router's scheduler and hardware-aware policy), per plan.
Measured: one `fleetctl emulate --time-scale X` process per planned server, with that server's
vLLM flags (the same engine model, run in real time X times faster), behind `fleetctl
route-serve --policy hardware-aware` (profiles only: --no-calibration --no-online-fit, as the
prediction; --no-request-log), fresh per plan. The load generator sends each request at its
arrival / X: a streamed /v1/completions with a prompt of exactly the trace's token count
(unique text, 4 characters per token) and max_tokens = the trace's output (the emulator makes
exactly that many). TTFT = the first SSE token event, TPOT = (last event - first) / (tokens -
1), both at the client, times X (model seconds).

Printed and written to --out (whatif_accuracy.json): per plan, each figure predicted and
measured and the error (predicted / measured - 1). `--check PCT` exits 1 when an error in p99
TTFT or p99 TPOT is larger than PCT percent (the test runs a scaled-down run so).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from fleet_replay import TRACES, bodies, emulator_cmd

from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from fleetctl.sim.workload import WorkItem, load_trace
from fleetctl.whatif.predict import what_if
from harness.commands import route_serve_cmd
from harness.load import completion_body, open_loop
from harness.procs import REPO, Proc, free_ports
from harness.ready import wait_ready
from harness.results import header, out_dir, write_json
from harness.results import pct_linear as pct

MODEL = "llama-3-8b"
PROFILE = "llama-3-8b"
NODES = {
    "mixed": [
        ("a100-1", "127.0.0.1", "A100-SXM4-80GB"),
        ("rtx-[1:3]", "127.0.0.[2:4]", "RTX-4090"),
    ],
    "rtx": [("rtx-[1:3]", "127.0.0.[2:4]", "RTX-4090")],
}
# Figures compared: (label, predicted key, measured key); the check judges the p99s.
FIGURES = [
    ("TTFT p50 s", "ttft_p50_s"),
    ("TTFT p99 s", "ttft_p99_s"),
    ("TPOT p50 ms", "tpot_p50_ms"),
    ("TPOT p99 ms", "tpot_p99_ms"),
    ("E2E p99 s", "e2e_p99_s"),
]
CHECKED = ("ttft_p99_s", "tpot_p99_ms")


def inventory(name: str, folder: Path) -> Path:
    lines = ["nodes:"]
    for node, host, gpu in NODES[name]:
        lines += [f"  - name: {node}", f"    host: {host}", f"    gpus: {{type: {gpu}, count: 1}}"]
    lines += [
        "models:",
        f"  - name: {MODEL}",
        f"    profile: {PROFILE}",
        "    variants: {bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}}",
        "    max_context: 8192",
        "    workload: {requests_per_s: 4, mean_prompt_tokens: 2000, mean_output_tokens: 30}",
    ]
    path = folder / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def requests(args: argparse.Namespace) -> list[WorkItem]:
    rows = load_trace(Path(args.trace), MODEL, args.skip + args.requests)[args.skip :]
    t0 = rows[0].arrival
    return [
        replace(w, id=i, arrival=w.arrival - t0, max_tokens=w.output) for i, w in enumerate(rows)
    ]


def measured(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [s for s in samples if s["ok"]]
    ttft = [s["ttft"] for s in ok]
    tpot = [s["tpot_ms"] for s in ok if s["tpot_ms"] is not None]
    return {
        "requests": len(samples),
        "completed": len(ok),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_ms": pct(tpot, 50),
        "tpot_p99_ms": pct(tpot, 99),
        "e2e_p99_s": pct([s["e2e"] for s in ok], 99),
    }


async def replay_plan(
    name: str,
    inv_path: Path,
    deployments: list[Any],
    items: list[WorkItem],
    payloads: list[bytes],
    args: argparse.Namespace,
    work: Path,
) -> tuple[list[dict[str, Any]], float]:
    pdir = work / name
    pdir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    scale = args.time_scale
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=timeout
        ) as session:
            ports = free_ports(len(deployments) + 1)
            port = ports.pop()
            emus = []
            for d, p in zip(deployments, ports, strict=True):
                cmd = emulator_cmd(d, PROFILE, p, scale)
                if args.truth_speed != 1.0:  # a GPU slower than the profiles say
                    cmd += ["--truth-speed", f"{args.truth_speed:g}"]
                emus.append(Proc(f"emu-{d.node}", cmd, pdir))
            procs += emus
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            for u, e in zip(urls, emus, strict=True):
                await wait_ready(session, u + "/health", e, 120)
            entries = [
                {
                    "url": u,
                    "node": d.node,
                    "gpu_type": d.server.gpu_type,
                    "model": d.server.model,
                    "variant": d.server.variant,
                    "kv_budget_tokens": d.server.kv_budget_tokens,
                    "max_num_seqs": d.server.max_num_seqs,
                }
                for u, d in zip(urls, deployments, strict=True)
            ]
            cmd = route_serve_cmd(inv_path, entries, port, "hardware-aware", pdir)
            cmd += ["--no-calibration", "--no-online-fit", "--no-request-log"]
            router = Proc("router", cmd, pdir, {"FLEETCTL_LOG_LEVEL": "WARNING"})
            procs.append(router)
            rurl = f"http://127.0.0.1:{port}"
            ready = completion_body(MODEL, "ready?", 1, False)
            await wait_ready(session, rurl + "/v1/completions", router, 120, ready)
            await asyncio.sleep(1.5)  # its first scrapes of every backend, as fleet_replay
            print(f"  {name}: replaying {len(items)} requests on {len(urls)} servers", flush=True)
            started = time.perf_counter()
            arrivals = [w.arrival / scale for w in items]
            sent = await open_loop(
                session, rurl + "/v1/completions", payloads, arrivals, args.drain_s
            )
            wall = time.perf_counter() - started
            if not router.alive():
                raise RuntimeError(f"router exited: {router.tail()}")
    finally:
        for p in procs:
            p.stop()
    samples = []
    for w, (due, x) in zip(items, sent, strict=True):
        if x is None:
            samples.append({"id": w.id, "ok": False, "error": "not finished"})
            continue
        ok = not x.error and x.status == 200 and x.events == w.output and x.done
        first = x.first_event or x.ended
        tpot = (x.ended - first) / (x.events - 1) * scale * 1000 if x.events > 1 else None
        samples.append(
            {
                "id": w.id,
                "ok": ok,
                "error": x.error or ("" if ok else f"HTTP {x.status}, {x.events}/{w.output}"),
                "lag_s": x.started - due,
                "ttft": (first - x.started) * scale,
                "e2e": (x.ended - x.started) * scale,
                "tpot_ms": tpot,
            }
        )
    return samples, wall


def error(predicted: float | None, got: float) -> float | None:
    if predicted is None or not got or got != got:
        return None
    return predicted / got - 1


async def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    items = requests(args)
    payloads = bodies(items, MODEL)
    catalog = load_catalog()
    span = items[-1].arrival
    print(
        f"{len(items)} requests of {Path(args.trace).name} over {span:.0f} model s "
        f"({len(items) / span:.2f} req/s), time scale {args.time_scale:g}",
        flush=True,
    )
    out: dict[str, Any] = {}
    for name in args.plans.split(","):
        inv_path = inventory(name, work)
        inv = load_inventory(inv_path, catalog)
        plan = plan_fleet(inv)
        started = time.perf_counter()
        fig = what_if(inv, plan.deployments, {MODEL: items})
        sim_s = time.perf_counter() - started
        samples, wall = await replay_plan(
            name, inv_path, list(plan.deployments), items, payloads, args, work
        )
        live = measured(samples)
        predicted = fig.to_json()
        errors = {k: error(predicted[k], live[k]) for _, k in FIGURES}
        out[name] = {
            "servers": [f"{d.node} {d.gpu_type}" for d in plan.deployments],
            "predicted": predicted,
            "measured": live,
            "errors": errors,
            "wall_s": wall,
            "simulated_in_s": sim_s,
            "lag_p99_ms": pct([s["lag_s"] for s in samples if "lag_s" in s], 99) * 1000,
            "samples": samples,
        }
        shown = ", ".join(
            f"{label} {predicted[k]:.3g}/{live[k]:.3g} ({errors[k]:+.0%})"
            for label, k in FIGURES
            if errors[k] is not None
        )
        print(
            f"    {live['completed']}/{live['requests']} ok in {wall:.0f} s; "
            f"predicted/measured: {shown}",
            flush=True,
        )
    return {"items": len(items), "span_s": span, "plans": out}


def report(result: dict[str, Any]) -> str:
    rows = [
        "| plan | servers | figure | predicted | measured | error |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result["plans"].items():
        for label, k in FIGURES:
            e = r["errors"][k]
            rows.append(
                f"| {name} | {len(r['servers'])} | {label} | {r['predicted'][k]:.3f} | "
                f"{r['measured'][k]:.3f} | {'-' if e is None else f'{e:+.1%}'} |"
            )
        m = r["measured"]
        rows.append(
            f"| {name} | | completed | | {m['completed']}/{m['requests']} | "
            f"send lag p99 {r['lag_p99_ms']:.0f} ms |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument(
        "--trace",
        default=str(TRACES / "AzureLLMInferenceTrace_code.csv"),
        help="Azure CSV or Mooncake JSONL (default: the Azure code trace)",
    )
    ap.add_argument("--requests", type=int, default=600, help="first N rows of the trace")
    ap.add_argument("--skip", type=int, default=0, help="rows of the trace to skip first")
    ap.add_argument("--time-scale", type=float, default=4.0, help="emulators run X times faster")
    ap.add_argument("--plans", default="mixed,rtx", help="which plans, of mixed and rtx")
    ap.add_argument("--drain-s", type=float, default=120.0, help="wall s to wait for the last")
    ap.add_argument("--check", type=float, default=None, metavar="PCT")
    ap.add_argument(
        "--truth-speed",
        type=float,
        default=1.0,
        help="the emulated GPUs run X times as fast as their profiles (the prediction reads "
        "the profiles): shows the check failing when the model is wrong",
    )
    ap.add_argument("--quick", action="store_true", help="150 requests at time scale 8")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "whatif_accuracy"))
    args = ap.parse_args()
    if args.quick:
        args.requests, args.time_scale = 150, 8.0
    work = out_dir(args.out)
    started = time.monotonic()
    result = asyncio.run(bench(args, work))
    took = time.monotonic() - started
    print()
    print("\n".join(header(__file__, took)))
    print()
    print(report(result))
    write_json(work / "whatif_accuracy.json", {"args": vars(args), **result})
    if args.check is not None:
        worst = [
            (name, k, e)
            for name, r in result["plans"].items()
            for k in CHECKED
            if (e := r["errors"][k]) is None or abs(e) > args.check / 100
        ]
        if worst:
            print(f"drift past {args.check:g}%: {worst}", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
