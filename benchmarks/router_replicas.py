"""Router replicas sharing state through Redis: what sharing costs, what `--workers 2` gives on
this machine, and whether a session's turns stay on one node class across replicas, under
load, while Redis is down and after it returns.

Run (from the repository root, in the dev venv; needs redis-server on the PATH):

    python benchmarks/router_replicas.py [--quick] [--phases cost,workers,consistency]

Two stand-in backends (harness/standin.py, one process each; this file's `backend`
subcommand) answer at once, one declared an A100 serving bf16, the other an RTX 4090 serving
GPTQ int4, so a session has two classes to stray between. Each session sends `--turns`
non-streamed completions (max_tokens 4); its first turn names the class with a strict
precision hint (bf16 or int4, alternating), its later turns carry no hint and must follow the
session's pin. The closed-loop load generator (this process) keeps `--conc` requests open.

Phases:
  cost         one route-serve worker without and with `--session-store` (and the backends
               called directly), fresh for each round, rounds rotating the order: throughput,
               p50/p99 latency and what the router adds over direct. Pinning as in
               router_overhead.py: the router on core 1, the load generator, backends and
               redis-server on core 0.
  workers      `--workers 1` and `--workers 2` with the store: both pinned to core 1 (the only
               core the load generator leaves), and `--workers 2` unpinned (both cores, shared
               with the load generator and backends).
  consistency  three replicas (one worker each) and Redis; each turn of a session goes to the
               next replica. Redis is killed (SIGKILL) partway, then started again, empty: the
               share of turns whose class differs from the session's previous turn, while
               Redis is up, while it is down, and after it returns (turns sent more than
               --settle-s after every replica reports the store back).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from harness.replicas import (  # noqa: E402
    MODEL,
    Drive,
    Redis,
    RouteServe,
    Turn,
    backend_entries,
    changed,
    client_session,
    start_backends,
    store_status,
)
from harness.results import header, out_dir, pct_rank, write_json  # noqa: E402
from harness.standin import run_backend  # noqa: E402


@dataclass
class Row:
    name: str
    requests: int = 0
    failed: int = 0
    rps: list[float] = field(default_factory=list)
    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    store_lines: int = 0  # log lines about the session store
    gave_up: list[float] = field(default_factory=lambda: [0.0, 0.0])  # reads, writes (50 ms)
    changed: int = 0
    compared: int = 0


async def closed(urls: list[str], conc: int, total: int, turns: int, tag: str) -> list[Turn]:
    async with client_session(conc) as client:
        warm = Drive(urls, conc, conc * turns, turns, tag + "-warm")
        await warm.run(client)
        return await Drive(urls, conc, total, turns, tag).run(client)


def record(row: Row, got: list[Turn], cpu_s: float = 0.0) -> None:
    ok = [t for t in got if t.status == 200]
    took = max(t.ended for t in got) - min(t.sent for t in got)
    lat = [t.ended - t.sent for t in ok]
    row.requests += len(got)
    row.failed += len(got) - len(ok)
    row.rps.append(len(ok) / took)
    row.p50.append(pct_rank(lat, 0.5))
    row.p99.append(pct_rank(lat, 0.99))
    if cpu_s:
        row.cpu_ms.append(1000 * cpu_s / max(1, len(got)))
    m, n = changed(got)
    row.changed += m
    row.compared += n


async def phase_cost(
    args: argparse.Namespace, work: Path, urls: list[str], redis: Redis
) -> list[Row]:
    rows = {n: Row(n) for n in ("direct", "1 worker, no store", "1 worker, Redis store")}
    entries = backend_entries(urls)
    for r in range(args.rounds):
        order = list(rows)[r % 3 :] + list(rows)[: r % 3]
        for name in order:
            print(f"  cost round {r + 1}: {name}", flush=True)
            if name == "direct":
                got = await closed(urls, args.conc, args.requests, args.turns, f"d{r}")
                record(rows[name], got)
                continue
            extra = ("--session-store", redis.url) if "Redis" in name else ()
            redis.flush()
            rs = RouteServe(work, f"cost{r}-{len(extra)}", entries, *extra, core=args.router_core)
            try:
                cpu0 = rs.cpu_s()
                got = await closed([rs.url], args.conc, args.requests, args.turns, f"c{r}{name[9]}")
                record(rows[name], got, rs.cpu_s() - cpu0)
                rows[name].store_lines += rs.log_text().count("session store")
                gave_up(rows[name], rs)
            finally:
                rs.stop()
    return list(rows.values())


def gave_up(row: Row, rs: RouteServe) -> None:
    """The store's reads and write waits given up (one worker's /metrics)."""
    for i, e in enumerate(("read_timeout", "write_timeout")):
        row.gave_up[i] += rs.metric(f'fleetctl_session_store_pins_total{{event="{e}"}}') or 0


async def phase_workers(
    args: argparse.Namespace, work: Path, urls: list[str], redis: Redis
) -> list[Row]:
    variants = [
        ("--workers 1, core 1", 1, args.router_core),
        ("--workers 2, core 1", 2, args.router_core),
    ]
    variants.append(("--workers 2, both cores", 2, None))
    rows = {n: Row(n) for n, _, _ in variants}
    entries = backend_entries(urls)
    for r in range(args.rounds):
        order = variants[r % 3 :] + variants[: r % 3]
        for name, n, core in order:
            print(f"  workers round {r + 1}: {name}", flush=True)
            extra = ("--session-store", redis.url, "--workers", str(n))
            redis.flush()
            rs = RouteServe(work, f"workers{r}-{n}-{core}", entries, *extra, core=core)
            try:
                cpu0 = rs.cpu_s()
                got = await closed([rs.url], args.conc, args.requests, args.turns, f"w{r}{n}{core}")
                record(rows[name], got, rs.cpu_s() - cpu0)
                rows[name].store_lines += rs.log_text().count("session store")
                gave_up(rows[name], rs)
            finally:
                rs.stop()
    return list(rows.values())


async def wait_for(what: str, check: Callable[[], bool], limit_s: float = 60) -> float:
    """Poll `check` (off the event loop) until true; the seconds it took."""
    start = time.monotonic()
    while not await asyncio.to_thread(check):
        if time.monotonic() - start > limit_s:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def phase_consistency(
    args: argparse.Namespace, work: Path, urls: list[str], redis: Redis
) -> dict[str, Any]:
    entries = backend_entries(urls)
    reps = [
        RouteServe(work, f"replica-{i}", entries, "--session-store", redis.url) for i in range(3)
    ]
    try:
        async with client_session(args.conc) as client:
            drive = Drive([r.url for r in reps], args.conc, 10**9, args.turns, "cons")
            task = asyncio.create_task(drive.run(client))
            third = args.requests // 3

            async def done(n: int) -> None:
                while len(drive.turns_done) < n and not task.done():
                    await asyncio.sleep(0.05)

            await done(third)
            killed = time.monotonic()
            redis.kill()
            print("  Redis killed", flush=True)
            t_degraded = await wait_for(
                "every replica to report the store down",
                lambda: all(store_status(r) == "degraded" for r in reps),
            )
            await done(2 * third)
            redis.start()
            restarted = time.monotonic()
            print("  Redis started again (empty)", flush=True)
            t_back = await wait_for(
                "every replica to report the store back",
                lambda: all(store_status(r) == "ok" for r in reps),
            )
            back = time.monotonic()
            await asyncio.sleep(args.settle_s)  # the measure of "after" starts then
            await done(len(drive.turns_done) + third)
            drive.stop = True
            turns = await task
        settled = back + args.settle_s
        up = changed(turns, lambda t: t.ended < killed)
        down = changed(turns, lambda t: killed <= t.sent and t.ended < restarted)
        after = changed(turns, lambda t: t.sent >= settled)
        conflicts = sum(
            r.metric('fleetctl_session_store_pins_total{event="conflicts"}') or 0 for r in reps
        )
        timeouts = sum(
            r.metric('fleetctl_session_store_pins_total{event="read_timeout"}') or 0 for r in reps
        )
        return {
            "read_timeouts": timeouts,
            "turns": len(turns),
            "failed": sum(t.status != 200 for t in turns),
            "up": up,
            "down": down,
            "after": after,
            "degraded_after_kill_s": t_degraded,
            "ok_after_restart_s": t_back,
            "conflicts": conflicts,
            "outages": [r.metric("fleetctl_session_store_outages_total") for r in reps],
            "store_lines": [r.log_text().count("session store") for r in reps],
            "errors": sum("session store:" in r.log_text() for r in reps),
        }
    finally:
        for r in reps:
            r.stop()


# --- the report ---------------------------------------------------------------------------------


def ms(x: float) -> str:
    return f"{1000 * x:.2f}"


def share(m: int, n: int) -> str:
    return f"{m}/{n} ({100 * m / n:.2f}%)" if n else "0/0"


def report(rows: list[Row], base: str | None) -> list[str]:
    med = statistics.median
    out = [
        "| target | requests | failed | req/s | p50 ms | p99 ms | p50 added | p99 added | "
        "router CPU ms/req | class changes | 'session store' log lines | "
        "store waits cut at 50 ms (reads/writes) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ref = next((r for r in rows if r.name == base), None)
    for r in rows:
        added50 = added99 = "-"
        if ref is not None and r is not ref:
            added50 = ms(med(r.p50) - med(ref.p50))
            added99 = ms(med(r.p99) - med(ref.p99))
        cpu = f"{med(r.cpu_ms):.3f}" if r.cpu_ms else "-"
        out.append(
            f"| {r.name} | {r.requests} | {r.failed} | {med(r.rps):.0f} | {ms(med(r.p50))} | "
            f"{ms(med(r.p99))} | {added50} | {added99} | {cpu} | "
            f"{share(r.changed, r.compared)} | {r.store_lines} | "
            f"{r.gave_up[0]:.0f}/{r.gave_up[1]:.0f} |"
        )
    return out


async def bench(args: argparse.Namespace, work: Path) -> list[str]:
    lines: list[str] = []
    backends, urls = start_backends(work, args.backend_core)
    redis = Redis(work, args.backend_core)
    try:
        if "cost" in args.phases:
            print("== cost of sharing", flush=True)
            rows = await phase_cost(args, work, urls, redis)
            lines += ["", "Cost of sharing (medians over rounds; 'added' is over direct):", ""]
            lines += report(rows, "direct")
            a, b = rows[1], rows[2]
            lines.append("")
            lines.append(
                f"Redis store vs none: throughput {100 * (statistics.median(b.rps) / statistics.median(a.rps) - 1):+.1f}%, "
                f"p50 {ms(statistics.median(b.p50) - statistics.median(a.p50))} ms, "
                f"p99 {ms(statistics.median(b.p99) - statistics.median(a.p99))} ms"
            )
        if "workers" in args.phases:
            print("== workers", flush=True)
            rows = await phase_workers(args, work, urls, redis)
            lines += ["", "Workers (all with the Redis store; medians over rounds):", ""]
            lines += report(rows, None)
        if "consistency" in args.phases:
            print("== consistency", flush=True)
            c = await phase_consistency(args, work, urls, redis)
            lines += [
                "",
                "Consistency (3 replicas, each turn to the next replica; turns whose class "
                "differs from the session's previous turn):",
                "",
                f"- turns {c['turns']}, failed {c['failed']}",
                f"- Redis up: {share(*c['up'])}",
                f"- Redis down: {share(*c['down'])}",
                f"- after it returned (+{args.settle_s:g} s): {share(*c['after'])}",
                f"- every replica said degraded {c['degraded_after_kill_s']:.2f} s after the kill, "
                f"ok {c['ok_after_restart_s']:.2f} s after the restart; LWW conflicts resolved "
                f"{c['conflicts']:.0f}; reads given up after 50 ms {c['read_timeouts']:.0f}; "
                f"outages counted per replica {c['outages']}; "
                f"'session store' log lines per replica {c['store_lines']}",
            ]
    finally:
        redis.stop()
        for b in backends:
            b.stop()
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    be = sub.add_parser("backend", help="run one stand-in backend (used by the benchmark)")
    be.add_argument("--port", type=int, required=True)
    ap.add_argument("--phases", default="cost,workers,consistency")
    ap.add_argument("--requests", type=int, default=48_000, help="turns per measurement")
    ap.add_argument("--conc", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4, help="turns per session")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--quick", action="store_true", help="4,000 requests, 1 round")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "router_replicas"))
    args = ap.parse_args()
    if args.cmd == "backend":
        run_backend(args.port, 1.0, MODEL)
        return
    if args.quick:
        args.requests, args.rounds = 4000, 1
    pin = not args.no_pin and shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
    args.router_core = 1 if pin else None
    args.backend_core = 0 if pin else None
    if pin:
        os.sched_setaffinity(0, {0})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    work = out_dir(args.out)
    started = time.monotonic()
    lines = asyncio.run(bench(args, work))
    print()
    print("\n".join(header(__file__, time.monotonic() - started)))
    print(
        "- Pinning: "
        + (
            "routers on core 1 (`taskset -c 1`) unless a row says otherwise; the load "
            "generator, both stand-in backends and redis-server on core 0"
            if pin
            else "none"
        )
    )
    print("\n".join(lines))
    write_json(work / "results.json", {"lines": lines, "args": vars(args)})


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
