"""Workload derivation: what `plan --workload-from` derives from route-serve's request log, against
the trace that was replayed through it.

Run (from the repository root, in the dev venv):

    python benchmarks/workload_derivation.py [--trace conv|code|PATH] [--requests 400]
        [--skip 0] [--compress 4] [--time-scale X] [--emulators 2] [--no-stream] [--out DIR]

The first N requests (after --skip) of an Azure LLM inference trace (../shared/traces, or any
trace file) are sent, open loop at their arrival times compressed --compress times, through a
real `fleetctl route-serve` (request log on, as by default) in front of `fleetctl emulate`
processes running --time-scale times faster (default: --compress, so that in model time the
emulated servers see the trace's own load). Each request is a streamed /v1/completions with a
prompt of exactly the trace's token count at 4 characters per token (the emulator's count) and
max_tokens the trace's output length (the emulator generates exactly that many).

Then route-serve is stopped (it flushes its log) and its log folder is read by the code
`plan --workload-from` runs (fleetctl/sim/traffic.py workloads_from: load_trace and
derive_workload), for the inventory's one model, and compared with derive_workload applied to
the trace itself:
- rate, like with like. The log holds real (compressed) arrival times. `derive_workload`'s
  rate is the 95th percentile of 5-minute rates, or a trace's own n/span when it is shorter
  than one window. Two comparisons: (a) the log as logged against the trace compressed the same
  (scale_time(trace, C)): what `plan --workload-from` would print for this replay; (b) the log's
  arrivals stretched back by C against the trace on its own clock: the peak the plan would get
  had the trace been served in real time (the 5-minute windows are then the trace's; with a
  window of a few hundred requests it is n/span too).
- mean prompt and output tokens, p95 prompt, long share (prompt + output over the router's
  long_context_tokens).
Every figure is derive_workload's own (means rounded to whole tokens, as the plan gets them);
the JSON also holds the exact means.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the repository's packages, as the tests see them
    sys.path.insert(0, str(REPO))

from fleetctl.fleet.inventory import Inventory, load_inventory  # noqa: E402
from fleetctl.model.catalog import load_catalog  # noqa: E402
from fleetctl.sim.traffic import workloads_from  # noqa: E402
from fleetctl.sim.workload import WorkItem, derive_workload, load_trace, scale_time  # noqa: E402
from harness.commands import emulate_cmd, route_serve_cmd  # noqa: E402
from harness.load import completion_body, open_loop, random_text  # noqa: E402
from harness.procs import Proc, free_ports  # noqa: E402
from harness.ready import NotReady, http_request, wait_ready  # noqa: E402

TRACES = REPO.parent / "shared" / "traces"
INVENTORY = REPO / "inventory" / "seed-mixed-8b-16k.yaml"  # one model, long_context_tokens 4096
GPU = "A100-SXM4-80GB"
MAX_MODEL_LEN = 16384
CHARS_PER_TOKEN = 4  # the emulator's count, and route-serve's before it has learned a ratio
# (label, Derived field, compared within the target)
FIGURES = [
    ("requests", "requests", False),
    ("mean prompt tokens", "mean_prompt_tokens", True),
    ("mean output tokens", "mean_output_tokens", True),
    ("p95 prompt tokens", "p95_prompt_tokens", False),
    ("long share", "long_share", False),
]
TARGET = 0.05


def trace_path(name: str) -> Path:
    return TRACES / f"AzureLLMInferenceTrace_{name}.csv" if name in ("conv", "code") else Path(name)


def trace_items(path: Path, model: str, skip: int, n: int) -> list[WorkItem]:
    """N requests after `skip`, arrivals from 0 (trace seconds)."""
    rows = load_trace(path, model, skip + n)[skip:]
    t0 = rows[0].arrival
    return [replace(w, id=i, arrival=w.arrival - t0) for i, w in enumerate(rows)]


def payloads(items: list[WorkItem], model: str, stream: bool = True) -> list[bytes]:
    """One completion per item: a prompt of exactly `prompt` tokens at 4 characters per token,
    unique from its first characters (no shared prefix), max_tokens the trace's output."""
    longest = max(w.prompt for w in items) * CHARS_PER_TOKEN
    pool = random_text(2 * longest + 1000, 7, 4000)
    rng = random.Random(11)
    out = []
    for w in items:
        size = w.prompt * CHARS_PER_TOKEN
        head = f"request {w.id}: "
        start = rng.randrange(0, len(pool) - size)
        prompt = (head + pool[start : start + size])[:size]
        out.append(completion_body(model, prompt, w.output, stream))
    return out


@dataclass
class Replay:
    log: Path  # route-serve's request log folder
    sent: int
    statuses: dict[str, int]  # as the client saw them ("none": not ended in time)
    wall_s: float
    late_s: float  # the load generator's worst send lag


def _wait_backends(port: int, router: Proc, n: int, deadline_s: float = 60) -> None:
    """Until route-serve's /health counts all `n` backends healthy: a GET, so no request of
    ours reaches the log before the replay."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not router.alive():
            raise NotReady(f"route-serve exited: {router.tail(40)}")
        try:
            status, _, body = http_request(port, "GET", "/health", timeout=2)
            if status == 200 and json.loads(body).get("healthy") == n:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise NotReady(f"route-serve: backends not all healthy in {deadline_s:.0f} s")


async def replay(
    items: list[WorkItem],
    work: Path,
    compress: float,
    time_scale: float,
    emulators: int = 2,
    stream: bool = True,
    inventory: Path = INVENTORY,
    drain_s: float = 120,
) -> Replay:
    """`items` through a fresh route-serve (state and log under `work`) in front of fresh
    emulators, arrivals `compress` times denser; every process stopped before it returns."""
    inv = load_inventory(inventory, load_catalog())
    m = inv.models[0]
    variant = next(iter(m.spec.variants.values()))
    source = variant.source if variant is not None else m.profile.name
    bodies = payloads(items, m.name, stream)
    procs: list[Proc] = []
    try:
        *ports, port = free_ports(emulators + 1)
        emus = []
        for i, emu_port in enumerate(ports):
            flags = ["--max-model-len", str(MAX_MODEL_LEN)]
            cmd = emulate_cmd(
                emu_port, GPU, m.profile.name, source, m.name, f"{time_scale:g}", *flags
            )
            emus.append(Proc(f"emu-{i}", cmd, work))
        procs += emus
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        backends = [
            {"url": u, "node": f"n{i}", "gpu_type": GPU, "model": m.name}
            | {"max_model_len": MAX_MODEL_LEN}
            for i, u in enumerate(urls)
        ]
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=timeout
        ) as session:
            for u, e in zip(urls, emus, strict=True):
                await wait_ready(session, u + "/health", e, 60)
            cmd = route_serve_cmd(inventory, backends, port, "hardware-aware", work)
            router = Proc("router", cmd, work, {"FLEETCTL_LOG_LEVEL": "WARNING"})
            procs.append(router)
            await asyncio.to_thread(_wait_backends, port, router, emulators)
            arrivals = [w.arrival / compress for w in items]
            started = time.perf_counter()
            url = f"http://127.0.0.1:{port}/v1/completions"
            sent = await open_loop(session, url, bodies, arrivals, drain_s)
            wall = time.perf_counter() - started
        statuses: dict[str, int] = {}
        late = 0.0
        for due, x in sent:
            key = "none" if x is None else (x.error or str(x.status))
            statuses[key] = statuses.get(key, 0) + 1
            if x is not None:
                late = max(late, x.started - due)
        router.stop()  # SIGTERM: route-serve flushes its log at shutdown
        if router.proc.returncode not in (0, -15):
            raise RuntimeError(f"route-serve exited {router.proc.returncode}: {router.tail()}")
        return Replay(work / "state" / "requests", len(sent), statuses, wall, late)
    finally:
        for p in procs:
            p.stop()


def _exact(items: list[WorkItem]) -> dict[str, float]:
    return {
        "mean_prompt_tokens": statistics.fmean(w.prompt for w in items),
        "mean_output_tokens": statistics.fmean(w.output for w in items),
    }


def _span_rate(items: list[WorkItem]) -> float:
    span = items[-1].arrival - items[0].arrival
    return (len(items) - 1) / span if span > 0 else 0.0


def compare(items: list[WorkItem], log: Path, inv: Inventory, compress: float) -> dict[str, Any]:
    """The workload `plan --workload-from LOG` derives, beside derive_workload of the trace."""
    m = inv.models[0]
    long_tokens = inv.spec.router.long_context_tokens
    _, shown = workloads_from(inv, log)  # exactly what `plan --workload-from` does
    derived = shown[m.name]
    logged = load_trace(log, m.name)
    trace = derive_workload(items, long_tokens)
    fast = derive_workload(scale_time(items, compress), long_tokens)
    stretched = derive_workload(scale_time(logged, 1 / compress), long_tokens)
    assert trace is not None and fast is not None and stretched is not None
    rows: list[dict[str, Any]] = [
        _row("req/s, replay clock", derived["requests_per_s"], fast.requests_per_s, True),
        _row(
            "req/s, trace clock (log x C)",
            stretched.requests_per_s,
            trace.requests_per_s,
            True,
        ),
        _row(
            "req/s over the window, (n-1)/span x C",
            _span_rate(logged) / compress,
            _span_rate(items),
            False,
        ),
    ]
    t = trace.to_json()
    rows += [_row(label, derived[key], t[key], judged) for label, key, judged in FIGURES]
    return {
        "rows": rows,
        "log": derived,
        "trace": t,
        "trace_compressed": fast.to_json(),
        "log_stretched": stretched.to_json(),
        "exact": {"log": _exact(logged), "trace": _exact(items)},
        "peak_is_windowed": items[-1].arrival >= 300,
        "ok": all(abs(r["error"]) <= TARGET for r in rows if r["judged"]),
    }


def _row(label: str, got: Any, want: Any, judged: bool) -> dict[str, Any]:
    error = (got - want) / want if want else (0.0 if got == want else float("inf"))
    return {"figure": label, "log": got, "trace": want, "error": error, "judged": judged}


def render(c: dict[str, Any]) -> list[str]:
    out = [
        "| figure | derived from the log | from the trace | error |",
        "|---|---|---|---|",
    ]
    for r in c["rows"]:
        mark = " (target 5%)" if r["judged"] else ""
        out.append(
            f"| {r['figure']}{mark} | {_fmt(r['log'])} | {_fmt(r['trace'])} | {r['error']:+.2%} |"
        )
    e = c["exact"]
    out.append(
        f"\nExact means, log / trace: prompt {e['log']['mean_prompt_tokens']:.2f} / "
        f"{e['trace']['mean_prompt_tokens']:.2f}, output {e['log']['mean_output_tokens']:.2f} / "
        f"{e['trace']['mean_output_tokens']:.2f}"
    )
    return out


def _fmt(v: float) -> str:
    return f"{v:,}" if isinstance(v, int) else f"{v:.4g}"


def main() -> None:
    from harness.results import header, out_dir, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="conv", help="conv, code (../shared/traces) or a path")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--compress", type=float, default=4.0, help="arrivals X times denser")
    ap.add_argument("--time-scale", type=float, default=0.0, help="emulators' (default: C)")
    ap.add_argument("--emulators", type=int, default=2)
    ap.add_argument("--no-stream", action="store_true", help="whole answers, not SSE")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "workload_derivation"))
    args = ap.parse_args()
    work = out_dir(args.out)
    started = time.perf_counter()
    inv = load_inventory(INVENTORY, load_catalog())
    items = trace_items(trace_path(args.trace), inv.models[0].name, args.skip, args.requests)
    span = items[-1].arrival
    print(f"{len(items)} requests over {span:.0f} trace s, {span / args.compress:.0f} s replayed")
    run = work / f"{Path(args.trace).stem}-{args.requests}"
    if run.exists():
        import shutil

        shutil.rmtree(run)
    run.mkdir(parents=True)
    r = asyncio.run(
        replay(
            items,
            run,
            args.compress,
            args.time_scale or args.compress,
            args.emulators,
            not args.no_stream,
        )
    )
    c = compare(items, r.log, inv, args.compress)
    lines = [*header(__file__, time.perf_counter() - started), ""]
    lines.append(
        f"{r.sent} requests sent in {r.wall_s:.1f} s (worst send lag {r.late_s * 1000:.0f} ms); "
        f"answers: {r.statuses}"
    )
    lines += ["", *render(c), "", "PASS" if c["ok"] else "FAIL (over 5%)"]
    print("\n".join(lines))
    write_json(run / "result.json", {**c, "statuses": r.statuses, "wall_s": r.wall_s})


if __name__ == "__main__":
    main()
