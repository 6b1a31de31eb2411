"""What `fleetctl route-serve` adds over calling a backend directly, beside vllm-router and
sglang-router (both round_robin), in one run against the same stand-in backends.

Run (from the repository root, in the dev venv; the peers live in their own venv):

    python3 -m venv /tmp/peers-venv && /tmp/peers-venv/bin/pip install vllm-router sglang-router
    python benchmarks/router_overhead.py [--peers-venv /tmp/peers-venv] [--quick]

The backends are two small aiohttp servers (harness/standin.py, started as this
file's `backend` subcommand, one process each) that answer /v1/completions at once:
streamed, `max_tokens` SSE chunks 1 ms apart (or NN ms apart when the prompt starts with
"GAP=NN:"), or one short JSON answer; they also answer /v1/models, /health, /metrics (a real
vLLM 0.32 page, tests/data) and the /server_info, /model_info probes sglang-router makes when
it registers a worker. Being fast, they let the router's own cost show. Processes, readiness
waits, the load generator's exchange and closed loop, and the report's header and JSON file
come from harness/, which fleet_replay.py and the tests share.

Pinning (2-core machine): the router under test gets core 1 (`taskset -c 1`), the load
generator (this process) and both backends share core 0; the same for every router, and the
"direct" rows run the same load generator and backends with core 1 idle. Every router is
started fresh for each phase and round, so its VmHWM (peak RSS) belongs to that phase. Phases
A and B run in rounds that rotate the order of the targets, so that drift and other tenants
of a shared machine do not always land on the same router; a reported percentile is the
median of the rounds' percentiles.

Phases:
  A  streamed requests (16 chunks, 1 ms apart) at 1, 64 and 512 concurrent streams, and at
     64 with chunks 20 ms apart (a load the load generator's core is not saturated by): time
     to first byte, total time per request and the router's CPU time per request; then
     non-streamed short answers at 64 and 512 concurrency for a fixed window: requests/s
     completed and router CPU ms per request.
  B  the same streamed requests at 64 concurrency with ~100K-token prompts (~400 KB bodies).
  C  1,000 concurrent streams held open ~10 s (100 chunks, 100 ms apart): all must finish
     with every chunk; the router's peak RSS.
"Added" latency is a percentile through the router minus the same percentile direct, at the
same concurrency (a difference of percentiles, not of per-request pairs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import resource
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from harness.commands import peer_router_cmd, route_serve_cmd
from harness.load import Exchange, Gauge, closed_loop, completion_body, exchange, random_text
from harness.procs import (
    REPO,
    Proc,
    cpu_ticks,
    free_port,
    pinned,
    tcp_counters,
    tree_cpu_s,
    tree_kb,
)
from harness.ready import wait_ready
from harness.results import header, machine, out_dir, pct_rank, peer_version, write_json
from harness.standin import gap_prefix, run_backend

MODEL = "llama-3-8b"

INVENTORY = """\
nodes:
  - name: rtx-[1:2]
    gpus: {type: RTX-4090, count: 1}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
    max_context: 8192
    workload: {requests_per_s: 5, mean_prompt_tokens: 500, mean_output_tokens: 64}
"""


# --- targets: direct, fleetctl, the peers ----------------------------------------------------


@dataclass
class Target:
    name: str
    kind: str  # direct | fleetctl | vllm-router | sglang-router
    policy: str = ""
    version: str = ""
    unavailable: str | None = None
    pythonpath: str = ""  # fleetctl from elsewhere (--also): its first entry is the cwd


@dataclass
class Running:
    target: Target
    urls: list[str]  # the load generator spreads over these (several only for direct)
    proc: Proc | None = None
    idle_cpu: float = 0.0  # CPU-s per s the router spends on its own (scrapes, timers)


def make_targets(args: argparse.Namespace) -> list[Target]:
    from importlib.metadata import version

    fv = version("fleetctl")
    targets = [
        Target("direct", "direct"),
        Target("fleetctl round-robin", "fleetctl", "round-robin", fv),
        Target("fleetctl hardware-aware", "fleetctl", "hardware-aware", fv),
    ]
    for spec in args.also:
        label, _, path = spec.partition("=")
        for policy in args.also_policies.split(","):
            targets.append(
                Target(f"fleetctl {policy} [{label}]", "fleetctl", policy, fv, None, path)
            )
    python = Path(args.peers_venv) / "bin" / "python"
    for name, dist in (("vllm-router", "vllm-router"), ("sglang-router", "sglang-router")):
        v = peer_version(python, dist)
        t = Target(name, name, "round_robin", v or "")
        if v is None:
            t.unavailable = f"{dist} is not installed in {args.peers_venv}"
        targets.append(t)
    wanted = set(args.targets.split(",")) if args.targets else None
    return [t for t in targets if wanted is None or t.kind in wanted or t.name in wanted]


def router_cmd(t: Target, port: int, backends: list[str], work: Path, args: argparse.Namespace):
    if t.kind == "fleetctl":
        inv = work / "inventory.yaml"
        inv.write_text(INVENTORY)
        entries = [
            # The stand-ins hold any number of sequences; say so, or hardware-aware's
            # admission (256 per RTX 4090 by default) would queue phase C's 1,000 streams.
            {"url": u, "node": f"rtx-{i + 1}", "gpu_type": "RTX-4090", "model": MODEL}
            | {"max_num_seqs": 1024}
            for i, u in enumerate(backends)
        ]
        return route_serve_cmd(inv, entries, port, t.policy, work)
    peers = Path(args.peers_venv)
    return peer_router_cmd(t.kind, peers, backends, "round_robin", port, free_port())


def ready_body() -> bytes:
    """A small completion: through a router it answers 200 once a backend is reachable."""
    return completion_body(MODEL, "ready?", 2, False)


# --- load generation -------------------------------------------------------------------------


@dataclass
class Sample:
    ttfb: float
    total: float
    ok: bool
    done_at: float
    events: int = 0
    error: str = ""


def sample(x: Exchange, stream: bool, expect_events: int) -> Sample:
    """TTFB is the body's first byte; a stream is whole with every event and [DONE]."""
    ok, error = x.status == 200, ""
    if x.error:
        ok, error = False, x.error
    elif not ok:
        error = f"HTTP {x.status}"
    elif stream and (x.events != expect_events or not x.done):
        ok, error = False, f"stream cut: {x.events}/{expect_events} events"
    events = x.events if stream else 0
    return Sample(
        (x.first_byte or x.ended) - x.started, x.ended - x.started, ok, x.ended, events, error
    )


async def one(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    stream: bool,
    expect_events: int,
    gauge: Gauge | None = None,
) -> Sample:
    return sample(await exchange(session, url, body, gauge, stream), stream, expect_events)


async def loop(
    session: aiohttp.ClientSession,
    urls: list[str],
    body: bytes,
    stream: bool,
    expect: int,
    conc: int,
    n_max: int,
    window_s: float,
) -> tuple[list[Sample], float, float]:
    got, start, end = await closed_loop(session, urls, body, conc, n_max, window_s, stream)
    return [sample(x, stream, expect) for x in got], start, end


def rate_of(samples: list[Sample], start: float, end: float, skip: float = 0.0) -> float:
    """Requests/s that completed fine inside the window, after its first `skip` seconds."""
    start += skip
    done = sum(1 for s in samples if s.ok and start < s.done_at <= end)
    return done / max(1e-9, end - start)


def summarize(samples: list[Sample]) -> dict[str, Any]:
    good = [s for s in samples if s.ok]
    errors: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            errors[s.error] = errors.get(s.error, 0) + 1
    return {
        "n": len(samples),
        "ok": len(good),
        "errors": errors,
        "ttfb_p50": pct_rank([s.ttfb for s in good], 0.5) * 1000,
        "ttfb_p99": pct_rank([s.ttfb for s in good], 0.99) * 1000,
        "total_p50": pct_rank([s.total for s in good], 0.5) * 1000,
        "total_p99": pct_rank([s.total for s in good], 0.99) * 1000,
    }


# --- phases ----------------------------------------------------------------------------------


@dataclass
class Plan:
    rounds: dict[str, int] = field(default_factory=lambda: {"A": 3, "B": 3, "C": 1})
    # (concurrent streams, ms between chunks, requests per round; bounded by stream_window_s).
    # 1 ms gaps saturate core 0 (load generator + backends) from 64 streams on; the 20 ms
    # row keeps it at roughly a third, so that what the router adds is not lost in queueing.
    streams: tuple[tuple[int, float, int], ...] = (
        (1, 1.0, 150),
        (64, 1.0, 1000),
        (64, 20.0, 640),
        (512, 1.0, 1536),
    )
    stream_window_s: float = 6.0
    rate_conc: tuple[int, ...] = (64, 512)
    rate_window_s: float = 4.0
    rate_skip_s: float = 1.0  # the loop's ramp-up, not counted
    big_n: int = 400
    big_window_s: float = 6.0
    big_prompt_chars: int = 400_000
    hold_streams: int = 1000
    hold_events: int = 100
    hold_ramp_s: float = 1.0

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            rounds={"A": 2, "B": 1, "C": 1},
            streams=((1, 1.0, 50), (64, 1.0, 300), (64, 20.0, 192), (512, 1.0, 1024)),
            stream_window_s=2.0,
            rate_window_s=2.0,
            rate_skip_s=0.5,
            big_n=150,
            big_window_s=3.0,
            hold_streams=300,
            hold_events=30,
        )


@dataclass
class Cell:
    """One measurement cell of one target, pooled over rounds."""

    samples: list[Sample] = field(default_factory=list)
    per_round: list[dict[str, Any]] = field(default_factory=list)  # summarize() of each round
    rates: list[float] = field(default_factory=list)  # one per round
    cpu_s: float = 0.0  # router CPU seconds over the cell's requests
    cpu_reqs: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


Acc = dict[str, Cell]


def big_prompt(chars: int) -> str:
    return random_text(chars, 0, 2000)[:chars]


def cpu_mark(run: Running) -> tuple[float, float]:
    return (tree_cpu_s(run.proc.pid) if run.proc else 0.0), time.perf_counter()


def cpu_used(run: Running, mark: tuple[float, float]) -> float:
    """Router CPU-s since `mark` for the requests, less its idle background work."""
    cpu, at = cpu_mark(run)
    return cpu - mark[0] - run.idle_cpu * (at - mark[1])


def stream_key(c: int, gap: float) -> str:
    return f"stream@{c}" if gap == 1.0 else f"stream@{c}/gap{gap:g}"


async def phase_a(session, run: Running, plan: Plan, acc: Acc) -> None:
    urls = [u + "/v1/completions" for u in run.urls]
    for c, gap, n in plan.streams:
        body = completion_body(MODEL, gap_prefix(gap) + " Say something short. " * 4, 16, True)
        cpu0 = cpu_mark(run)
        samples, start, end = await loop(session, urls, body, True, 16, c, n, plan.stream_window_s)
        cell = acc.setdefault(stream_key(c, gap), Cell())
        cell.samples += samples
        cell.per_round.append(summarize(samples))
        cell.rates.append(rate_of(samples, start, end))
        cell.cpu_s += cpu_used(run, cpu0)
        cell.cpu_reqs += len(samples) + c  # and the warm-up wave
        print(f"    stream c={c} gap {gap:g} ms: {fmt_cell(summarize(samples))}", flush=True)
    body = completion_body(MODEL, "Say something short about routers. " * 4, 8, False)
    for c in plan.rate_conc:
        cpu0 = cpu_mark(run)
        samples, start, end = await loop(
            session, urls, body, False, 0, c, 10**9, plan.rate_window_s
        )
        cell = acc.setdefault(f"rate@{c}", Cell())
        cell.samples += samples
        cell.per_round.append(summarize(samples))
        cell.rates.append(rate_of(samples, start, end, skip=plan.rate_skip_s))
        cell.cpu_s += cpu_used(run, cpu0)
        cell.cpu_reqs += len(samples) + c
        errors = sum(1 for s in samples if not s.ok)
        print(f"    rate c={c}: {cell.rates[-1]:.0f} req/s, {errors} errors", flush=True)


async def phase_b(session, run: Running, plan: Plan, acc: Acc) -> None:
    urls = [u + "/v1/completions" for u in run.urls]
    body = completion_body(MODEL, big_prompt(plan.big_prompt_chars), 16, True)
    cpu0 = cpu_mark(run)
    samples, start, end = await loop(
        session, urls, body, True, 16, 64, plan.big_n, plan.big_window_s
    )
    cell = acc.setdefault("big@64", Cell())
    cell.samples += samples
    cell.per_round.append(summarize(list(samples)))
    cell.rates.append(rate_of(samples, start, end))
    cell.cpu_s += cpu_used(run, cpu0)
    cell.cpu_reqs += len(samples) + 64
    cell.extra["body_bytes"] = len(body)
    print(f"    big c=64: {fmt_cell(summarize(samples))}, {cell.rates[-1]:.0f} req/s", flush=True)


async def phase_c(session, run: Running, plan: Plan, acc: Acc) -> None:
    urls = [u + "/v1/completions" for u in run.urls]
    body = completion_body(
        MODEL, gap_prefix(100) + " hold this stream open", plan.hold_events, True
    )
    gauge = Gauge()
    n = plan.hold_streams
    rss_peak = 0

    async def launch(i: int) -> Sample:
        await asyncio.sleep(plan.hold_ramp_s * i / n)  # no SYN burst of 1,000 at once
        return await one(session, urls[i % len(urls)], body, True, plan.hold_events, gauge)

    async def sample_rss() -> None:
        nonlocal rss_peak
        while run.proc is not None:
            rss_peak = max(rss_peak, tree_kb(run.proc.pid, "VmRSS"))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample_rss())
    started = time.perf_counter()
    tcp0 = tcp_counters()
    samples = await asyncio.gather(*(launch(i) for i in range(n)))
    tcp = {k: v - tcp0.get(k, 0) for k, v in tcp_counters().items()}
    wall = time.perf_counter() - started
    sampler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampler
    cell = acc.setdefault("hold", Cell())
    cell.samples += samples
    cell.per_round.append(summarize(list(samples)))
    cell.extra.update(max_open=gauge.max_open, wall_s=wall, rss_sampled_peak_kb=rss_peak, **tcp)
    ok = sum(s.ok for s in samples)
    print(f"    hold {n}: {ok}/{n} ok, max open {gauge.max_open}", flush=True)


PHASES = {"A": phase_a, "B": phase_b, "C": phase_c}


async def run_target(
    session: aiohttp.ClientSession,
    t: Target,
    backends: list[str],
    phase: str,
    plan: Plan,
    work: Path,
    args: argparse.Namespace,
    acc: Acc,
) -> None:
    if t.kind == "direct":
        await PHASES[phase](session, Running(t, backends), plan, acc)
        return
    port = free_port()
    slug = t.name.replace(" ", "-")
    tdir = work / f"{slug}-{phase}"
    tdir.mkdir(parents=True, exist_ok=True)
    cmd = pinned(router_cmd(t, port, backends, tdir, args), args.router_core)
    env, cwd = {}, REPO
    if t.pythonpath:  # `python -m` puts its cwd first on sys.path, before PYTHONPATH
        env, cwd = {"PYTHONPATH": t.pythonpath}, Path(t.pythonpath.split(":")[0])
    proc = Proc(f"router-{slug}-{phase}", cmd, work, env, cwd)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_ready(session, url + "/v1/completions", proc, 60, ready_body())
        # Not a readiness wait (the router has answered): its start-up work (first scrapes,
        # health checks) is kept out of the idle-CPU measurement below. Part of the protocol.
        await asyncio.sleep(1.0)
        run = Running(t, [url], proc)
        mark = cpu_mark(run)
        await asyncio.sleep(1.5)
        run.idle_cpu = cpu_used(run, mark) / 1.5
        meta = acc.setdefault(f"proc-{phase}", Cell()).extra
        meta["rss_idle_kb"] = max(meta.get("rss_idle_kb", 0), tree_kb(proc.pid, "VmRSS"))
        meta.setdefault("idle_cpu", []).append(run.idle_cpu)
        meta["cmd"] = " ".join(cmd)
        await PHASES[phase](session, run, plan, acc)
        meta["vmhwm_kb"] = max(meta.get("vmhwm_kb", 0), tree_kb(proc.pid, "VmHWM"))
        if not proc.alive():
            raise RuntimeError(f"router exited: {proc.tail()}")
    finally:
        proc.stop()


# --- report ----------------------------------------------------------------------------------


def ms(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.2f}"


def fmt_cell(s: dict[str, Any]) -> str:
    return (
        f"n={s['n']} ok={s['ok']} ttfb p50/p99 {ms(s['ttfb_p50'])}/{ms(s['ttfb_p99'])} ms, "
        f"total p50/p99 {ms(s['total_p50'])}/{ms(s['total_p99'])} ms, errors {s['errors']}"
    )


def errs(s: dict[str, Any]) -> str:
    return str(sum(s["errors"].values())) if s["errors"] else "0"


def robust(cell: Cell) -> dict[str, Any]:
    """Counts over all rounds; each percentile the median of the rounds' (one noisy round on
    a shared machine does not set the p99)."""
    out = summarize(cell.samples)
    if len(cell.per_round) >= 3:
        for k in ("ttfb_p50", "ttfb_p99", "total_p50", "total_p99"):
            out[k] = statistics.median(r[k] for r in cell.per_round)
    return out


def rate_text(cell: Cell) -> str:
    """Median over rounds (range when there were several)."""
    if not cell.rates:
        return "-"
    med = statistics.median(cell.rates)
    if len(cell.rates) == 1:
        return f"{med:.0f}"
    return f"{med:.0f} ({min(cell.rates):.0f}-{max(cell.rates):.0f})"


def mb(kb: int | None) -> str:
    return f"{kb / 1024:.0f}" if kb else "-"


def report(targets: list[Target], acc: dict[str, Acc], plan: Plan) -> str:
    lines: list[str] = []
    names = [t.name for t in targets if acc.get(t.name)]
    summ = {n: {k: robust(c) for k, c in acc[n].items() if c.samples} for n in names}
    direct = summ.get("direct", {})

    def added(name: str, key: str, metric: str) -> str:
        d, r = direct.get(key), summ[name].get(key)
        if name == "direct" or not d or not r:
            return "-"
        return f"{r[metric] - d[metric]:+.2f}"

    def hwm(name: str, phase: str) -> str:
        cell = acc[name].get(f"proc-{phase}")
        return mb(cell.extra.get("vmhwm_kb")) if cell else "-"

    ra, rb = plan.rounds.get("A", 1), plan.rounds.get("B", 1)
    lines.append(
        f"### A. Streamed requests, fast backends (16 SSE chunks; {ra} interleaved rounds; "
        "each percentile is the median of the rounds')\n"
    )
    lines.append(
        "| streams | chunk gap ms | router | requests | TTFB p50 ms | TTFB p99 ms | total p50 ms "
        "| total p99 ms | added TTFB p50 / p99 ms | added total p50 / p99 ms | router CPU ms/req "
        "| errors |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c, gap, _ in plan.streams:
        key = stream_key(c, gap)
        for name in names:
            s, cell = summ[name].get(key), acc[name].get(key)
            if not s or not cell:
                continue
            cpu = f"{cell.cpu_s * 1000 / cell.cpu_reqs:.2f}" if name != "direct" else "-"
            lines.append(
                f"| {c} | {gap:g} | {name} | {s['n']} | {ms(s['ttfb_p50'])} | {ms(s['ttfb_p99'])} "
                f"| {ms(s['total_p50'])} | {ms(s['total_p99'])} "
                f"| {added(name, key, 'ttfb_p50')} / {added(name, key, 'ttfb_p99')} "
                f"| {added(name, key, 'total_p50')} / {added(name, key, 'total_p99')} "
                f"| {cpu} | {errs(s)} |"
            )
    lines.append("")
    lines.append(
        "### A. Request rate, non-streamed short answers (closed loop; completions counted "
        f"over {plan.rate_window_s - plan.rate_skip_s:g} s after a {plan.rate_skip_s:g} s ramp; "
        f"median of {ra} rounds, range in brackets)\n"
    )
    header, sep = "| router |", "|---|"
    for c in plan.rate_conc:
        header += f" req/s @{c} | total p99 ms @{c} | router CPU ms/req @{c} |"
        sep += "---|---|---|"
    lines.append(header + " errors | idle router CPU % | peak RSS MB (VmHWM) |")
    lines.append(sep + "---|---|---|")
    for name in names:
        row = f"| {name} |"
        n_err = 0
        for c in plan.rate_conc:
            cell = acc[name].get(f"rate@{c}")
            s = summ[name].get(f"rate@{c}")
            if not cell or not s:
                row += " - | - | - |"
                continue
            n_err += sum(s["errors"].values())
            cpu = f"{cell.cpu_s * 1000 / cell.cpu_reqs:.3f}" if name != "direct" else "-"
            row += f" {rate_text(cell)} | {ms(s['total_p99'])} | {cpu} |"
        proc = acc[name].get("proc-A")
        idle = proc.extra.get("idle_cpu") if proc else None
        idle_pct = f"{100 * statistics.median(idle):.1f}" if idle else "-"
        lines.append(row + f" {n_err} | {idle_pct} | {hwm(name, 'A')} |")
    lines.append("")
    lines.append(
        f"### B. 64 streams with ~100K-token prompts ({plan.big_prompt_chars // 1000}K "
        f"characters each, 16 chunks 1 ms apart; {rb} interleaved rounds, percentiles the "
        "median of the rounds')\n"
    )
    lines.append(
        "| router | requests | req/s | MB/s of prompts | req/s with small prompts @64 | "
        "TTFB p50 / p99 ms | total p50 / p99 ms | added total p50 / p99 ms "
        "| router CPU ms/req | errors | peak RSS MB |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        cell, s = acc[name].get("big@64"), summ[name].get("big@64")
        if not cell or not s:
            continue
        small = acc[name].get("stream@64")
        mbs = statistics.median(cell.rates) * cell.extra["body_bytes"] / 2**20
        cpu = f"{cell.cpu_s * 1000 / cell.cpu_reqs:.2f}" if name != "direct" else "-"
        lines.append(
            f"| {name} | {s['n']} | {rate_text(cell)} | {mbs:.0f} "
            f"| {rate_text(small) if small else '-'} "
            f"| {ms(s['ttfb_p50'])} / {ms(s['ttfb_p99'])} "
            f"| {ms(s['total_p50'])} / {ms(s['total_p99'])} "
            f"| {added(name, 'big@64', 'total_p50')} / {added(name, 'big@64', 'total_p99')} "
            f"| {cpu} | {errs(s)} | {hwm(name, 'B')} |"
        )
    lines.append("")
    lines.append(
        f"### C. {plan.hold_streams:,} concurrent streams held open ({plan.hold_events} chunks "
        f"100 ms apart, opened over {plan.hold_ramp_s:g} s)\n"
    )
    lines.append(
        "| router | completed with every chunk | most open at once | TTFB p99 ms "
        "| total p50 / p99 s | errors | SYN retransmits (listen overflows) | RSS idle MB "
        "| peak RSS MB (VmHWM) |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        cell, s = acc[name].get("hold"), summ[name].get("hold")
        if not cell or not s:
            continue
        meta = acc[name].get("proc-C")
        idle = mb(meta.extra.get("rss_idle_kb")) if meta else "-"
        lines.append(
            f"| {name} | {s['ok']}/{s['n']} | {cell.extra['max_open']} | {ms(s['ttfb_p99'])} "
            f"| {s['total_p50'] / 1000:.2f} / {s['total_p99'] / 1000:.2f} | {errs(s)} "
            f"| {cell.extra.get('TCPSynRetrans', '-')} ({cell.extra.get('ListenOverflows', '-')}) "
            f"| {idle} | {hwm(name, 'C')} |"
        )
    lines.append("")
    lines.append(
        "TTFB = first byte of the response body at the client. Router CPU ms/req: the router "
        "process's CPU time (utime + stime, all threads) over the cell, less its idle rate "
        "measured for 1.5 s before the phase, per request (warm-up included). RSS: the router "
        "process and its children (`/proc/PID/status`); `-` for direct, which has no router. "
        "SYN retransmits and listen overflows: machine-wide TcpExt counters over the cell."
    )
    return "\n".join(lines)


# --- main ------------------------------------------------------------------------------------


async def bench(
    args: argparse.Namespace, plan: Plan, work: Path
) -> tuple[list[Target], dict[str, Acc]]:
    targets = make_targets(args)
    acc: dict[str, Acc] = {t.name: {} for t in targets}
    backends: list[Proc] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120, sock_connect=10)
    try:
        ports = [free_port() for _ in range(2)]
        for i, p in enumerate(ports):
            cmd = [sys.executable, str(Path(__file__).resolve()), "backend", "--port", str(p)]
            backends.append(Proc(f"backend-{i + 1}", pinned(cmd, args.backend_core), work))
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            for u, b in zip(urls, backends, strict=True):
                await wait_ready(session, u + "/v1/completions", b, 20, ready_body())
            for phase in args.phases:
                for r in range(plan.rounds.get(phase, 1)):
                    print(f"== phase {phase}, round {r + 1}", flush=True)
                    # Rotate the order each round, so that drift (and other tenants of the
                    # machine) do not always land on the same router.
                    order = targets[r % len(targets) :] + targets[: r % len(targets)]
                    for t in order:
                        if t.unavailable:
                            continue
                        print(f"  {t.name}", flush=True)
                        try:
                            await run_target(session, t, urls, phase, plan, work, args, acc[t.name])
                        except RuntimeError as e:
                            t.unavailable = f"phase {phase}: {e}"
                            print(f"    FAILED: {e}", flush=True)
                        await asyncio.sleep(0.3)
    finally:
        for b in backends:
            b.stop()
    return targets, acc


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    be = sub.add_parser("backend", help="run one stand-in backend (used by the benchmark)")
    be.add_argument("--port", type=int, required=True)
    be.add_argument("--gap-ms", type=float, default=1.0, help="unless the prompt says GAP=MS:")
    ap.add_argument("--peers-venv", default="/tmp/peers-venv")
    ap.add_argument("--phases", default="ABC", help="any of A, B, C")
    ap.add_argument("--targets", default="", help="comma list of kinds/names (default: all)")
    ap.add_argument("--quick", action="store_true", help="smaller counts (smoke test)")
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="LABEL=PYTHONPATH",
        help="also measure fleetctl imported from PYTHONPATH (e.g. a checkout of an older "
        "commit, or this tree plus a folder holding uvloop), as 'fleetctl POLICY [LABEL]'",
    )
    ap.add_argument("--also-policies", default="round-robin", help="policies for --also")
    ap.add_argument("--no-pin", action="store_true", help="do not use taskset")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "router_overhead"))
    args = ap.parse_args()
    if args.cmd == "backend":
        run_backend(args.port, args.gap_ms, MODEL)
        return
    pin = not args.no_pin and shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
    args.router_core = 1 if pin else None
    args.backend_core = 0 if pin else None
    if pin:
        os.sched_setaffinity(0, {0})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    work = out_dir(args.out)
    plan = Plan.quick() if args.quick else Plan()
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    busy0, steal0 = cpu_ticks()
    started = time.monotonic()
    targets, acc = asyncio.run(bench(args, plan, work))
    took = time.monotonic() - started
    busy1, steal1 = cpu_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    self_ = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    ours = self_.ru_utime + self_.ru_stime + kids.ru_utime + kids.ru_stime
    others = max(0.0, (busy1 - busy0) / hz - ours)
    cores = os.cpu_count() or 1
    print()
    print("\n".join(header(__file__, took)))
    print(
        "- Pinning: "
        + (
            "the router under test on core 1 (`taskset -c 1`); the load generator (one "
            "process, one aiohttp ClientSession, TCPConnector(limit=0)) and both backends on "
            "core 0. Direct rows: the same, core 1 idle."
            if pin
            else "none"
        )
    )
    print(
        f"- Other tenants of the machine: {others:.0f} CPU-s over the run "
        f"({100 * others / (took * cores):.0f}% of {cores} cores), steal "
        f"{(steal1 - steal0) / hz:.1f} s; load average before {' '.join(load_before)}, "
        f"after {' '.join(Path('/proc/loadavg').read_text().split()[:3])}"
    )
    for t in targets:
        if t.kind != "direct":
            print(f"- {t.name}: {t.version or '?'}" + (f", policy {t.policy}" if t.policy else ""))
    for t in targets:
        if t.unavailable:
            print(f"- NOT MEASURED {t.name}: {t.unavailable}")
    print()
    print(report(targets, acc, plan))
    dump = {
        "machine": machine(),
        "plan": plan.__dict__,
        "targets": [t.__dict__ for t in targets],
        "cells": {
            name: {
                key: {
                    "summary": robust(c) if c.samples else None,
                    "per_round": c.per_round,
                    "rates": c.rates,
                    "cpu_s": c.cpu_s,
                    "cpu_reqs": c.cpu_reqs,
                    **c.extra,
                }
                for key, c in cells.items()
            }
            for name, cells in acc.items()
        },
    }
    write_json(work / "router_overhead.json", dump)


if __name__ == "__main__":
    main()
