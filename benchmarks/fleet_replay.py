"""Fleet replay: p99 TTFT of an Azure trace replayed through each router, live.

Run (from the repository root, in the dev venv; vllm-router lives in its own venv):

    python3 -m venv /tmp/peers-venv && /tmp/peers-venv/bin/pip install vllm-router
    python benchmarks/fleet_replay.py [--trace code] [--requests 2000] [--time-scale 2]
        [--rounds 1] [--targets fleetctl,round_robin,...] [--quick]

The fleet is the planner's placement for `example:seed-mixed-8b-16k` (4x A100 SXM4 80GB + 8x
RTX 4090, Llama-3.1 8B BF16, max_model_len 16384): twelve `fleetctl emulate` processes, one
per planned server, started with that server's vLLM flags and `--time-scale X`, fresh for
every target (no queue or KV state leaks from one target into the next). The requests are
the first N rows of an Azure LLM inference trace (../shared/traces), their arrivals
compressed to 80% of the fleet's capacity exactly as `fleetctl simulate --load 0.8` does it
(fleetctl.sim.run.compare: the planner's saturation throughput for the window's mean
request), then X times more for the emulators' faster clock. Every target gets the same
requests: a streamed /v1/completions with a prompt of exactly the trace's token count (the
emulator and both routers count 4 characters per token; each prompt is unique text, so no
prefix is shared) and max_tokens set to the trace's output length (the emulator generates
exactly that many). No session ids: the trace has none.

Targets: `fleetctl route-serve --policy hardware-aware` and vllm-router with round_robin,
power_of_two, cache_aware and kv_aware (`--targets` also takes fleetctl-round-robin as a
control: same policy as vllm-router's round_robin, our proxy). The load generator (this
process, asyncio + aiohttp) sends each request at its arrival time and records, per
request, the time to the first SSE token event and to the end of the stream; both are
multiplied by X to give model seconds. Rounds rotate the order of the targets.

With `--skew GPU=SPEED[/KV]` (routing on a wrong prior) the emulators run on a generated profiles
folder in which that GPU type is slower and/or holds less KV cache than its bundled profile;
hardware-aware then runs once per `--priors`: wrong (route-serve on the bundled profiles),
perfect (route-serve --profiles on the emulators' own), calibrated (route-serve on the bundled
profiles, started cold, correcting each backend's speed from its /metrics as it runs). Until
route-serve can turn its online fit off, wrong learns online too: it is calibrated by another
name.
The baselines read no profiles and run once. A robustness table closes the report.

Processes, readiness waits, the open-loop load generator and the report's header and JSON
file come from harness/ (shared with router_overhead.py and the tests).

Printed and written to --out: per target the TTFT mean/p50/p90/p99, E2E p99, errors, how
the requests split between A100s and 4090s (read from the emulators' /metrics at the end),
the emulators' preemptions, the load generator's send lag and the machine's CPU use; and
the simulator's figures for the same requests (`fleetctl simulate`'s engine and policies).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from fleetctl.base.resources import examples
from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from fleetctl.sim.compare import compare
from fleetctl.sim.workload import WorkItem, load_trace
from harness.commands import emulate_cmd, peer_router_cmd, route_serve_cmd
from harness.load import Exchange, completion_body, open_loop, random_text
from harness.procs import REPO, Proc, cpu_ticks, free_ports, tree_cpu_s
from harness.ready import wait_ready
from harness.results import header, out_dir, peer_version, write_json
from harness.results import pct_linear as pct

TRACES = REPO.parent / "shared" / "traces"
EXAMPLE = "seed-mixed-8b-16k"
CHARS_PER_TOKEN = 4  # what fleetctl.emulator.protocol and the router's default assume
SIM_POLICIES = ("round-robin", "least-outstanding", "power-of-two", "kv-aware", "hardware-aware")


@dataclass
class Target:
    name: str
    kind: str  # fleetctl | vllm-router
    policy: str
    prior: str = ""  # with --skew, hardware-aware's profiles: wrong | perfect | calibrated


TARGETS = [
    Target("fleetctl hardware-aware", "fleetctl", "hardware-aware"),
    Target("vllm-router round_robin", "vllm-router", "round_robin"),
    Target("vllm-router power_of_two", "vllm-router", "power_of_two"),
    Target("vllm-router cache_aware", "vllm-router", "cache_aware"),
    Target("vllm-router kv_aware", "vllm-router", "kv_aware"),
    Target("fleetctl round-robin", "fleetctl", "round-robin"),
    # Baselines without peer routers installed; like vllm-router's, they read no profiles.
    Target("fleetctl least-outstanding", "fleetctl", "least-outstanding"),
    Target("fleetctl power-of-two", "fleetctl", "power-of-two"),
]
DEFAULT_TARGETS = "hardware-aware,round_robin,power_of_two,cache_aware,kv_aware"


def pick_targets(spec: str) -> list[Target]:
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    out = []
    for w in wanted:
        found = [t for t in TARGETS if t.name == w or t.policy == w or t.name.endswith(" " + w)]
        if not found:
            found = [t for t in TARGETS if t.name.replace(" ", "-") == w]
        if not found:
            raise SystemExit(f"unknown target {w!r}: use one of {[t.name for t in TARGETS]}")
        out += [t for t in found if t not in out]
    return out


# --- a truth apart from the profiles (routing on a wrong prior) -------------------------------

# What hardware-aware routing is told about the GPUs when the emulators run skewed:
# wrong: the bundled profiles (the emulators are slower / smaller than they say);
# perfect: the emulators' own skewed profiles (`route-serve --profiles`), for reference;
# calibrated: the bundled profiles, corrected online from the servers' /metrics (online fit).
PRIORS = ("wrong", "perfect", "calibrated")


@dataclass(frozen=True)
class Skew:
    speed: float  # the GPU runs this share of its profile's speed
    kv: float  # and holds this share of its profile's KV cache


def parse_skew(spec: str, gpus: list[str]) -> dict[str, Skew]:
    """`rtx=0.7` or `rtx=0.7/0.8,a100=0.9`: GPU (a case-insensitive part of a planned GPU
    type's name) = speed[/KV share]."""
    out: dict[str, Skew] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        key, eq, value = part.partition("=")
        speed, _, kv = value.partition("/")
        found = [g for g in gpus if key.strip().lower() in g.lower()]
        try:
            skew = Skew(float(speed), float(kv or 1.0))
        except ValueError:
            skew = Skew(0.0, 0.0)
        if not eq or not found or skew.speed <= 0 or not 0 < skew.kv <= 1:
            raise SystemExit(
                f"--skew {part!r}: write GPU=SPEED[/KV], GPU a part of one of {sorted(set(gpus))}, "
                "SPEED > 0, KV in (0, 1] (e.g. rtx=0.7/0.8)"
            )
        out.update(dict.fromkeys(found, skew))
    return out


@dataclass
class Truth:
    """The emulators' skewed profiles folder and each planned server's real KV tokens."""

    folder: Path
    skews: dict[str, Skew]
    kv_tokens: dict[str, int]  # node -> KV tokens its emulator holds


def write_truth(fleet: Fleet, skews: dict[str, Skew], folder: Path) -> Truth:
    """Skewed GPU profiles for the emulators (and the perfect prior), from the bundled ones,
    each GPU's KV share taken on its first planned server's flags."""
    from fleetctl.emulator.truth import describe, less_kv, slower, write_gpu
    from fleetctl.model.perf import kv_budget

    catalog = load_catalog()
    truth: dict[str, Any] = {}
    for d in fleet.servers:
        s = d.server
        if s.gpu_type not in skews or s.gpu_type in truth:
            continue
        skew, gpu = skews[s.gpu_type], catalog.gpu(s.gpu_type)
        budget = kv_budget(*_server_budget_args(gpu, fleet, s, catalog))
        gpu = less_kv(slower(gpu, skew.speed), skew.kv, budget, s.gpu_memory_utilization)
        write_gpu(folder, gpu, describe(skew.speed, skew.kv))
        truth[s.gpu_type] = gpu
    kv = {}
    for d in fleet.servers:
        s = d.server
        gpu = truth.get(s.gpu_type, catalog.gpu(s.gpu_type))
        kv[d.node] = kv_budget(*_server_budget_args(gpu, fleet, s, catalog)).kv_tokens
    return Truth(folder, skews, kv)


def _server_budget_args(gpu: Any, fleet: Fleet, s: Any, catalog: Any) -> tuple[Any, ...]:
    model, fmt = catalog.model(fleet.profile), catalog.format(s.variant)
    return (
        gpu,
        model,
        fmt,
        s.tensor_parallel_size,
        s.gpu_memory_utilization,
        s.kv_cache_dtype,
        s.max_num_batched_tokens,
        s.max_num_seqs,
    )


def with_priors(targets: list[Target], priors: list[str]) -> list[Target]:
    """Hardware-aware once per prior; the baselines read no profiles, so they run once."""
    out = []
    for t in targets:
        if t.policy != "hardware-aware":
            out.append(t)
            continue
        out += [replace(t, name=f"{t.name} ({p} prior)", prior=p) for p in priors]
    return out


def check_priors(priors: list[str]) -> None:
    for p in priors:
        if p not in PRIORS:
            raise SystemExit(f"--priors: unknown {p!r}; use some of {', '.join(PRIORS)}")


# --- the fleet and the workload ----------------------------------------------------------------


@dataclass
class Fleet:
    inventory: Path
    model: str  # the served name
    profile: str  # its model profile
    servers: list[Any]  # the planner's Deployments of the model
    inv: Any
    plan: Any


def planned_fleet() -> Fleet:
    path = examples()[EXAMPLE]
    inv = load_inventory(path, load_catalog())
    plan = plan_fleet(inv)
    m = inv.models[0]
    servers = [d for d in plan.deployments if d.model == m.name]
    return Fleet(path, m.name, m.profile.name, servers, inv, plan)


def workload(fleet: Fleet, args: argparse.Namespace) -> tuple[list[WorkItem], dict[str, Any]]:
    """The trace window at `args.load` of the fleet's capacity (model seconds), and the
    simulator's figures for it."""
    path = TRACES / f"AzureLLMInferenceTrace_{args.trace}.csv"
    rows = load_trace(path, fleet.model, args.skip + args.requests)[args.skip :]
    t0 = rows[0].arrival
    # The client states max_tokens, so routers (live and simulated) know each output length.
    rows = [replace(w, arrival=w.arrival - t0, max_tokens=w.output) for w in rows]
    started = time.perf_counter()
    c = compare(fleet.inv, fleet.plan, fleet.model, rows, SIM_POLICIES, load=args.load)
    sim = c.to_json()
    sim["wall_s"] = time.perf_counter() - started
    return c.items, sim


def word_pool(chars: int, seed: int = 7) -> str:
    return random_text(chars, seed, 4000)


def bodies(items: list[WorkItem], model: str) -> list[bytes]:
    """One streamed completion per item: a prompt of exactly `prompt` tokens at 4 characters
    per token, unique from its first characters, and max_tokens = the trace's output."""
    longest = max(w.prompt for w in items) * CHARS_PER_TOKEN
    pool = word_pool(2 * longest + 1000)
    rng = random.Random(11)
    out = []
    for w in items:
        head = f"request {w.id}: "
        need = w.prompt * CHARS_PER_TOKEN - len(head)
        start = rng.randrange(0, len(pool) - max(need, 0))
        prompt = (head + pool[start : start + max(need, 0)])[: w.prompt * CHARS_PER_TOKEN]
        out.append(completion_body(model, prompt, w.output, True))
    return out


# --- processes ---------------------------------------------------------------------------------


def emulator_cmd(
    d: Any, profile: str, port: int, scale: float, truth: Truth | None = None
) -> list[str]:
    """The planned server's vLLM flags, on an emulator (on the skewed profiles if any)."""
    s = d.server
    flags = ["--variant", s.variant]
    flags += ["--tensor-parallel-size", str(s.tensor_parallel_size)]
    flags += ["--max-model-len", str(s.max_model_len)]
    flags += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    flags += ["--kv-cache-dtype", s.kv_cache_dtype]
    flags += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    flags += ["--max-num-seqs", str(s.max_num_seqs)]
    if truth is not None:
        flags += ["--profiles", str(truth.folder)]
    return emulate_cmd(port, s.gpu_type, profile, s.source, s.model, f"{scale:g}", *flags)


def router_cmd(
    t: Target,
    port: int,
    prom: int,
    fleet: Fleet,
    urls: list[str],
    work: Path,
    args: argparse.Namespace,
) -> tuple[list[str], dict[str, str]]:
    if t.kind == "fleetctl":
        truth: Truth | None = args.truth
        perfect = truth is not None and t.prior == "perfect"
        entries = [
            {
                "url": u,
                "node": d.node,
                "gpu_type": d.server.gpu_type,
                "model": d.server.model,
                "variant": d.server.variant,
                # The planner's figure, or the truth's for the perfect prior (the router also
                # reads every server's real capacity from vllm:cache_config_info).
                "kv_budget_tokens": truth.kv_tokens[d.node]
                if truth and perfect
                else (d.server.kv_budget_tokens),
                "max_num_seqs": d.server.max_num_seqs,
            }
            for u, d in zip(urls, fleet.servers, strict=True)
        ]
        # wrong and calibrated: the bundled profiles; only calibrated corrects them online
        # from each server's /metrics (fleetctl/daemon/live.py), started cold. The perfect
        # prior has nothing to learn.
        cmd = route_serve_cmd(fleet.inventory, entries, port, t.policy, work)
        if truth is not None and perfect:
            cmd += ["--profiles", str(truth.folder)]
        if t.prior in ("wrong", "perfect"):
            cmd += ["--no-online-fit", "--no-calibration"]
        # No access log line per request (vllm-router runs at warn too).
        return cmd, {"FLEETCTL_LOG_LEVEL": "WARNING"}
    peers = Path(args.peers_venv)
    cmd = peer_router_cmd("vllm-router", peers, urls, t.policy, port, prom)
    return [*cmd, "--log-level", "warning"], {}


async def backend_counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Requests finished, prompt tokens and preemptions from an emulator's /metrics."""
    want = {
        "vllm:request_success_total": "requests",
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:num_preemptions_total": "preemptions",
    }
    out = dict.fromkeys(want.values(), 0.0)
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in want:
            out[want[name]] += float(line.rsplit(" ", 1)[1])
    return out


# --- the replay --------------------------------------------------------------------------------


@dataclass
class Sample:
    item: int
    lag: float  # wall s the send was late
    ttft: float  # model s
    e2e: float  # model s
    ok: bool
    error: str = ""


@dataclass
class Outcome:
    target: str
    round: int
    samples: list[Sample]
    wall_s: float
    cpu: dict[str, float]
    backends: dict[str, dict[str, Any]]


async def speed_factors(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """route-serve's fleetctl_backend_speed_factor per backend URL, from its /metrics."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("fleetctl_backend_speed_factor{"):
            backend = line.split('backend="', 1)[1].split('"', 1)[0]
            out[backend] = float(line.rsplit(" ", 1)[1])
    return out


def sample(i: int, due: float, x: Exchange | None, expect: int, scale: float) -> Sample:
    """TTFT is the first SSE token event; complete means every event and [DONE]."""
    if x is None:
        return Sample(i, 0.0, math.nan, math.nan, False, "not finished")
    ok = not x.error and x.status == 200 and x.events == expect and x.done
    error = x.error or ("" if ok else f"HTTP {x.status}, {x.events}/{expect} events")
    ttft = ((x.first_event or x.ended) - x.started) * scale
    return Sample(i, x.started - due, ttft, (x.ended - x.started) * scale, ok, error)


async def replay(
    session: aiohttp.ClientSession,
    url: str,
    items: list[WorkItem],
    payloads: list[bytes],
    scale: float,
    drain_s: float,
) -> list[Sample]:
    arrivals = [w.arrival / scale for w in items]
    sent = await open_loop(session, url + "/v1/completions", payloads, arrivals, drain_s)
    return [sample(w.id, due, x, w.output, scale) for w, (due, x) in zip(items, sent, strict=True)]


async def run_target(
    t: Target,
    rnd: int,
    fleet: Fleet,
    items: list[WorkItem],
    payloads: list[bytes],
    args: argparse.Namespace,
    work: Path,
) -> Outcome:
    slug = f"{t.name.replace(' ', '-')}-r{rnd}"
    tdir = work / slug
    tdir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            ports = free_ports(len(fleet.servers) + 2)
            port, prom = ports.pop(), ports.pop()
            emus = []
            for d, p in zip(fleet.servers, ports, strict=True):
                cmd = emulator_cmd(d, fleet.profile, p, args.time_scale, args.truth)
                emus.append(Proc(f"emu-{d.node}", cmd, tdir))
            procs += emus
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            for u, e in zip(urls, emus, strict=True):
                await wait_ready(session, u + "/health", e, 60)
            cmd, env = router_cmd(t, port, prom, fleet, urls, tdir, args)
            router = Proc("router", cmd, tdir, env)
            procs.append(router)
            rurl = f"http://127.0.0.1:{port}"
            ready = completion_body(fleet.model, "ready?", 1, False)
            await wait_ready(session, rurl + "/v1/completions", router, 60, ready)
            # Not a readiness wait (the router has answered 200): every router gets the same
            # time for its first scrapes and health checks before the replay. Part of the protocol.
            await asyncio.sleep(1.5)
            print(f"  {t.name} (round {rnd + 1}): replaying {len(items)} requests", flush=True)
            c0 = {p.name: tree_cpu_s(p.pid) for p in procs}
            self0 = time.process_time()
            busy0, steal0 = cpu_ticks()
            started = time.perf_counter()
            samples = await replay(session, rurl, items, payloads, args.time_scale, args.drain_s)
            wall = time.perf_counter() - started
            busy1, steal1 = cpu_ticks()
            hz = os.sysconf("SC_CLK_TCK")
            router_cpu = tree_cpu_s(router.pid) - c0["router"]
            emu_cpu = sum(tree_cpu_s(e.pid) - c0[e.name] for e in emus)
            client_cpu = time.process_time() - self0
            machine_cpu = (busy1 - busy0) / hz
            cpu = {
                "router_s": router_cpu,
                "emulators_s": emu_cpu,
                "client_s": client_cpu,
                "machine_s": machine_cpu,
                "others_s": max(0.0, machine_cpu - router_cpu - emu_cpu - client_cpu),
                "steal_s": (steal1 - steal0) / hz,
                "cores": float(os.cpu_count() or 1),
            }
            backends = {}
            for d, u in zip(fleet.servers, urls, strict=True):
                with contextlib.suppress(aiohttp.ClientError, OSError, ValueError):
                    counters = await backend_counters(session, u)
                    backends[d.node] = {**counters, "gpu": d.server.gpu_type}
            if t.kind == "fleetctl":  # what route-serve ended up believing of each backend
                with contextlib.suppress(aiohttp.ClientError, OSError, ValueError):
                    speeds = await speed_factors(session, rurl)
                    for d, u in zip(fleet.servers, urls, strict=True):
                        if d.node in backends and u in speeds:
                            backends[d.node]["speed_factor"] = speeds[u]
            if not router.alive():
                raise RuntimeError(f"router exited: {router.tail()}")
            return Outcome(t.name, rnd, samples, wall, cpu, backends)
    finally:
        for p in procs:
            p.stop()


# --- report ------------------------------------------------------------------------------------


def summarize(o: Outcome, items: list[WorkItem]) -> dict[str, Any]:
    good = [s for s in o.samples if s.ok]
    ttft = [s.ttft for s in good]
    errors: dict[str, int] = {}
    for s in o.samples:
        if not s.ok:
            errors[s.error] = errors.get(s.error, 0) + 1
    a100 = [b for b in o.backends.values() if str(b["gpu"]).startswith("A100")]
    total_req = sum(b["requests"] for b in o.backends.values()) or 1
    total_tok = sum(b["prompt_tokens"] for b in o.backends.values()) or 1
    long_ids = {w.id for w in items if w.prompt + w.output > 4096}
    long_ttft = [s.ttft for s in good if s.item in long_ids]
    short_ttft = [s.ttft for s in good if s.item not in long_ids]
    cpu = o.cpu
    speeds: dict[str, list[float]] = {}
    for b in o.backends.values():
        if "speed_factor" in b:
            speeds.setdefault(str(b["gpu"]), []).append(b["speed_factor"])
    return {
        "requests": len(o.samples),
        "completed": len(good),
        "errors": errors,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else math.nan,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "ttft_p99_s": pct(ttft, 99),
        "ttft_p99_long_s": pct(long_ttft, 99),
        "ttft_p99_short_s": pct(short_ttft, 99),
        "e2e_p99_s": pct([s.e2e for s in good], 99),
        "a100_request_share": sum(b["requests"] for b in a100) / total_req,
        "a100_prompt_share": sum(b["prompt_tokens"] for b in a100) / total_tok,
        "preemptions": sum(b["preemptions"] for b in o.backends.values()),
        # The speed route-serve believed at the end, per GPU type (min, max); {} for others.
        "speed_factor": {gpu: (min(v), max(v)) for gpu, v in speeds.items()},
        "lag_p99_ms": pct([s.lag for s in o.samples if s.lag == s.lag], 99) * 1000,
        "lag_max_ms": max((s.lag for s in o.samples), default=0.0) * 1000,
        "wall_s": o.wall_s,
        "machine_cpu_pct": 100 * cpu["machine_s"] / (o.wall_s * cpu["cores"]),
        "router_cpu_pct": 100 * cpu["router_s"] / o.wall_s,
        "emulators_cpu_pct": 100 * cpu["emulators_s"] / o.wall_s,
        "client_cpu_pct": 100 * cpu["client_s"] / o.wall_s,
        "others_cpu_pct": 100 * cpu["others_s"] / o.wall_s,
    }


def s3(x: float) -> str:
    return "-" if x != x else f"{x:.2f}"


def report(
    targets: list[Target], outcomes: list[Outcome], items: list[WorkItem], sim: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    per: dict[str, list[dict[str, Any]]] = {}
    for o in outcomes:
        per.setdefault(o.target, []).append(summarize(o, items))
    rows: dict[str, dict[str, Any]] = {}
    for t in targets:
        runs = per.get(t.name)
        if not runs:
            continue
        row = dict(runs[0])
        row["prior"] = t.prior
        if len(runs) > 1:
            # Counts add up; each latency figure is the median over rounds.
            for k in row:
                if k == "prior":
                    continue
                if k in ("requests", "completed", "preemptions"):
                    row[k] = sum(r[k] for r in runs)
                elif k == "errors":
                    merged: dict[str, int] = {}
                    for r in runs:
                        for e, n in r["errors"].items():
                            merged[e] = merged.get(e, 0) + n
                    row[k] = merged
                else:
                    row[k] = statistics.median(r[k] for r in runs)
            row["ttft_p99_rounds"] = [r["ttft_p99_s"] for r in runs]
        rows[t.name] = row
    base = next((r for n, r in rows.items() if n.startswith("fleetctl hardware-aware")), None)
    lines = [
        "| router, policy | requests | completed | errors | TTFT mean s | p50 | p90 | p99 "
        "| p99 / fleetctl's | p99 long (>4K) | p99 short | E2E p99 s | A100 share of requests "
        "(of prompt tokens) | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    best = min((r["ttft_p99_s"] for r in rows.values()), default=math.nan)
    for name, r in rows.items():
        ratio = r["ttft_p99_s"] / base["ttft_p99_s"] if base else math.nan
        mark = " **lowest p99**" if r["ttft_p99_s"] == best else ""
        lines.append(
            f"| {name}{mark} | {r['requests']} | {r['completed']} | {sum(r['errors'].values())} "
            f"| {s3(r['ttft_mean_s'])} | {s3(r['ttft_p50_s'])} | {s3(r['ttft_p90_s'])} "
            f"| {s3(r['ttft_p99_s'])} | {ratio:.2f}x | {s3(r['ttft_p99_long_s'])} "
            f"| {s3(r['ttft_p99_short_s'])} | {s3(r['e2e_p99_s'])} "
            f"| {r['a100_request_share']:.0%} ({r['a100_prompt_share']:.0%}) "
            f"| {r['preemptions']:.0f} |"
        )
    lines += [
        "",
        "| router, policy | wall s | send lag p99 / max ms | machine CPU % | router % of a core "
        "| emulators % | load generator % | other tenants % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['wall_s']:.0f} | {r['lag_p99_ms']:.1f} / {r['lag_max_ms']:.0f} "
            f"| {r['machine_cpu_pct']:.0f} | {r['router_cpu_pct']:.0f} "
            f"| {r['emulators_cpu_pct']:.0f} | {r['client_cpu_pct']:.0f} "
            f"| {r['others_cpu_pct']:.0f} |"
        )
    lines += [
        "",
        "Simulated (`fleetctl simulate`'s engine and policies, same requests and load; the "
        "simulator's least-outstanding is what vllm-router's kv_aware falls back to here):",
        "",
        "| policy (simulated) | TTFT mean s | p50 | p90 | p99 | E2E p99 s | preemptions |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in sim["policies"].items():
        lines.append(
            f"| {name} | {s3(s['ttft_mean_s'])} | {s3(s['ttft_p50_s'])} | {s3(s['ttft_p90_s'])} "
            f"| {s3(s['ttft_p99_s'])} | {s3(s['e2e_p99_s'])} | {s['preemptions']} |"
        )
    return "\n".join(lines), rows


def robustness(rows: dict[str, dict[str, Any]], truth: Truth) -> str:
    """Hardware-aware under each prior beside the best baseline (lowest p99 TTFT): what it
    keeps of its p99 advantage when the profiles are wrong."""
    ha = {n: r for n, r in rows.items() if r.get("prior")}
    bases = {n: r for n, r in rows.items() if not r.get("prior")}
    skews = ", ".join(f"{g} speed x{k.speed:g}, KV x{k.kv:g}" for g, k in truth.skews.items())
    lines = [f"Truth apart from the profiles: {skews} (emulators on {truth.folder}).", ""]
    if not ha or not bases:
        return "\n".join(lines)
    best_name = min(bases, key=lambda n: bases[n]["ttft_p99_s"])
    best = bases[best_name]["ttft_p99_s"]
    lines += [
        "| policy | prior | TTFT p50 s | p99 s | p99 / best baseline's |",
        "|---|---|---|---|---|",
    ]
    for name, r in [*ha.items(), *bases.items()]:
        mark = " (best baseline)" if name == best_name else ""
        lines.append(
            f"| {name.split(' (')[0]}{mark} | {r.get('prior') or '- (reads none)'} "
            f"| {s3(r['ttft_p50_s'])} | {s3(r['ttft_p99_s'])} "
            f"| {r['ttft_p99_s'] / best:.2f}x |"
        )
    by_prior = {r["prior"]: r for r in ha.values()}
    adv = {p: best - r["ttft_p99_s"] for p, r in by_prior.items()}
    lines.append("")
    for prior, r in by_prior.items():
        speeds = ", ".join(
            f"{gpu} {lo:.2f}" + (f"-{hi:.2f}" if hi != lo else "")
            for gpu, (lo, hi) in sorted(r.get("speed_factor", {}).items())
        )
        lines.append(f"- {prior} prior: speed factors at the end: {speeds or 'not read'}")
    for prior, a in adv.items():
        lines.append(f"- {prior} prior: p99 advantage over {best_name} {a:+.2f} s")
    perfect = by_prior.get("perfect")
    for prior in (p for p in by_prior if perfect and p != "perfect"):
        r = by_prior[prior]
        assert perfect is not None
        # A share of the advantage only means something when there is one to keep.
        kept = (
            f"keeps {adv[prior] / adv['perfect']:.0%} of the perfect prior's p99 advantage"
            if adv["perfect"] > 0
            else "(no p99 advantage to keep with the perfect prior)"
        )
        lines.append(
            f"- {prior} prior: TTFT p50 x{r['ttft_p50_s'] / perfect['ttft_p50_s']:.2f} and p99 "
            f"x{r['ttft_p99_s'] / perfect['ttft_p99_s']:.2f} of the perfect prior's; {kept}"
        )
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------


async def bench(
    targets: list[Target],
    fleet: Fleet,
    items: list[WorkItem],
    payloads: list[bytes],
    args: argparse.Namespace,
    work: Path,
) -> list[Outcome]:
    outcomes = []
    for rnd in range(args.rounds):
        order = targets[rnd % len(targets) :] + targets[: rnd % len(targets)]
        for t in order:
            try:
                o = await run_target(t, rnd, fleet, items, payloads, args, work)
            except RuntimeError as e:
                print(f"  {t.name}: FAILED: {e}", flush=True)
                continue
            s = summarize(o, items)
            print(
                f"    done in {s['wall_s']:.0f} s: {s['completed']}/{s['requests']} ok, TTFT "
                f"p50/p99 {s3(s['ttft_p50_s'])}/{s3(s['ttft_p99_s'])} s, A100 share "
                f"{s['a100_request_share']:.0%}, lag p99 {s['lag_p99_ms']:.0f} ms, machine CPU "
                f"{s['machine_cpu_pct']:.0f}% (router {s['router_cpu_pct']:.0f}%, emulators "
                f"{s['emulators_cpu_pct']:.0f}%, client {s['client_cpu_pct']:.0f}%)",
                flush=True,
            )
            outcomes.append(o)
    return outcomes


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--trace", default="code", choices=("code", "conv"))
    ap.add_argument("--requests", type=int, default=2000, help="first N rows of the trace")
    ap.add_argument("--skip", type=int, default=0, help="rows of the trace to skip first")
    ap.add_argument("--load", type=float, default=0.8, help="share of the fleet's capacity")
    ap.add_argument("--time-scale", type=float, default=2.0, help="emulators run X times faster")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--targets", default=DEFAULT_TARGETS)
    ap.add_argument("--drain-s", type=float, default=120.0, help="wall s to wait for the last")
    ap.add_argument("--peers-venv", default="/tmp/peers-venv")
    ap.add_argument("--quick", action="store_true", help="300 requests, one round (smoke test)")
    ap.add_argument(
        "--skew",
        default="",
        help="run the emulators slower / smaller than their profiles: GPU=SPEED[/KV],... "
        "(rtx=0.7/0.8: the RTX servers at 70%% speed with 80%% of the KV cache)",
    )
    ap.add_argument(
        "--priors",
        default="wrong,perfect",
        help="with --skew, what hardware-aware is told: wrong (the bundled profiles), perfect "
        "(the emulators' own), calibrated (the bundled ones, learnt online from /metrics)",
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "fleet_replay"))
    args = ap.parse_args()
    if args.quick:
        args.requests, args.rounds = 300, 1
    targets = pick_targets(args.targets)
    vr = peer_version(Path(args.peers_venv) / "bin" / "python", "vllm-router")
    if vr is None and any(t.kind == "vllm-router" for t in targets):
        raise SystemExit(f"vllm-router is not installed in {args.peers_venv}")
    work = out_dir(args.out)
    fleet = planned_fleet()
    args.truth = None
    if args.skew:
        priors = [p.strip() for p in args.priors.split(",") if p.strip()]
        check_priors(priors)
        skews = parse_skew(args.skew, [d.server.gpu_type for d in fleet.servers])
        args.truth = write_truth(fleet, skews, work / "truth-profiles")
        targets = with_priors(targets, priors)
    items, sim = workload(fleet, args)
    payloads = bodies(items, fleet.model)
    span = items[-1].arrival
    print(
        f"{len(items)} requests of the {args.trace} trace over {span:.0f} model s "
        f"({sim['offered_rps']:.1f} req/s = {sim['load']:.0%} of the planner's "
        f"{sim['capacity_rps']:.1f} req/s), {span / args.time_scale:.0f} wall s per target at "
        f"time scale {args.time_scale:g}; simulated in {sim['wall_s']:.1f} s",
        flush=True,
    )
    started = time.monotonic()
    outcomes = asyncio.run(bench(targets, fleet, items, payloads, args, work))
    took = time.monotonic() - started
    table, rows = report(targets, outcomes, items, sim)
    mean_prompt = statistics.fmean(w.prompt for w in items)
    mean_out = statistics.fmean(w.output for w in items)
    print()
    print("\n".join(header(__file__, took)))
    print(f"- vllm-router {vr or '-'}; fleetctl from this checkout")
    print(
        f"- Workload: rows {args.skip}-{args.skip + len(items) - 1} of "
        f"AzureLLMInferenceTrace_{args.trace}.csv, mean prompt {mean_prompt:.0f} / output "
        f"{mean_out:.0f} tokens, {sum(w.prompt + w.output > 4096 for w in items)} requests over "
        f"4,096 tokens; offered {sim['offered_rps']:.2f} req/s ({sim['load']:.0%} of "
        f"{sim['capacity_rps']:.2f}); time scale {args.time_scale:g}; {args.rounds} round(s)"
    )
    print()
    print(table)
    if args.truth is not None:
        print()
        print(robustness(rows, args.truth))
    dump = {
        "args": vars(args),
        "sim": sim,
        "rows": rows,
        "outcomes": [
            {
                "target": o.target,
                "round": o.round,
                "wall_s": o.wall_s,
                "cpu": o.cpu,
                "backends": o.backends,
                "samples": [s.__dict__ for s in o.samples],
            }
            for o in outcomes
        ],
    }
    write_json(work / "fleet_replay.json", dump)


if __name__ == "__main__":
    main()
