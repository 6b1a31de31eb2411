"""The autopilot live: emulators, route-serve and `fleetctl autopilot` over a compressed day,
against the simulator's prediction of the same run.

Run (from the repository root, in the dev venv, with PYTHONPATH=.):

    python benchmarks/autopilot_live.py [--minutes 10] [--interval 15] [--down-after 2]
        [--floor 1] [--seed 1] [--out benchmarks/out/autopilot_live]

The fleet: three RTX 4090s serving Llama-3 8B and three L4s serving Mistral 7B, one GPU per
node, each node on its own loopback address (127.0.0.1-6, one port), each model pinned to its
class (`placement.gpu_types`), so that the only moves the autopilot has are sleeps and wakes of
the servers already there (no start or stop: the live command carries those out over SSH,
which a loopback fleet has not). Every server is a `fleetctl emulate` at time scale 1 (real
time: the autopilot's interval, the requests and the wakes share one clock), started with the
planner's flags, `--enable-sleep-mode` and VLLM_SERVER_DEV_MODE=1, all awake at the start; a
wake takes the seconds `model/startup.wake_seconds` gives its class, as in the simulator. The
state folder's state.json records the inventory's plan and its SLO (stated in the inventory,
so the live judge and the simulator's are the same). route-serve runs over that folder, writing
its request log and reading the autopilot's audit log; `fleetctl autopilot` runs its loop with
--interval/--down-after/--floor on it.

The traffic (sim/scenario.py): a day compressed into --minutes, each model's rate following a
daily curve that peaks 8x its trough, Llama-3 8B at noon (mean 1.3 req/s) and Mistral 7B at
midnight (mean 0.6 req/s), starting at midnight, so one falls while the other rises, and
back; Poisson arrivals; shapes drawn from 500 seeded (prompt 500-2,500, output 100-500) token
pairs. A load generator (harness/load.py open_loop) sends each request at its time through
route-serve, streamed, with a prompt of exactly its tokens (4 characters a token, unique text)
and max_tokens its output. The simulator first decides `interval` s into the traffic; the
autopilot is started so that its first decision falls there too: as long before that mark as a
dry run of it (`--once --dry-run`, its own audit file) took from start to decision. Started
with the traffic, it would decide on an empty first interval, and sleep servers one interval
early.

The prediction: the same rows, inventory, plan and settings through `run_autopilot`
(autopilot/simulated.py), in process, with the default costs (the same wake seconds as the
emulators).

Measured live:
- GPU-hours: route-serve's `fleetctl_backend_state` sampled every second from the traffic's
  start to its last arrival (the simulator's span), a GPU counted while its server is in any
  state but asleep (waking and draining count, as in the simulator). Why this one: it is the
  state the router routes by and the dashboard shows, and it is read on its own clock; the
  audit log times decisions, not when a sleep or a wake ended.
- Attainment per model: route-serve's request log, each row judged by the SLO state.json
  records (autopilot/traffic.py `verdict`: the same judge the autopilot reads).
- Actions by kind: the audit log's changes carried out (`done`), faults apart; the router's own
  wakes (`fleetctl_backend_wakes_total{trigger="router"}`) beside them.
Printed: a table of both runs and the ratios live/sim; the run's JSON goes to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fleetctl.autopilot.decide import Settings
from fleetctl.autopilot.simulated import FleetDay, run_autopilot
from fleetctl.autopilot.traffic import verdict
from fleetctl.fleet.inventory import Inventory, load_inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from fleetctl.sim.scenario import ModelTraffic, generate
from fleetctl.sim.workload import WorkItem
from harness.commands import emulate_cmd
from harness.load import completion_body, open_loop, random_text
from harness.procs import REPO, Proc, free_port
from harness.ready import http_request, wait_status
from harness.results import header, out_dir, write_json

CHARS_PER_TOKEN = 4  # the emulator's and route-serve's count
HOSTS = [f"127.0.0.{i}" for i in range(1, 7)]
INVENTORY = """\
nodes:
  - name: g4090-[1:3]
    host: 127.0.0.[1:3]
    gpus: {{type: RTX-4090, count: 1}}
  - name: l4-[1:3]
    host: 127.0.0.[4:6]
    gpus: {{type: L4, count: 1}}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants: {{bf16: {{source: meta-llama/Meta-Llama-3-8B-Instruct}}}}
    max_context: 8192
    workload: {{requests_per_s: 1.3, mean_prompt_tokens: 1500, mean_output_tokens: 300}}
    slo: {{ttft_p99_s: 2.5, tpot_p99_ms: 55}}
    placement: {{gpu_types: [RTX-4090]}}
  - name: mistral-7b
    profile: mistral-7b
    variants: {{bf16: {{source: mistralai/Mistral-7B-Instruct-v0.3}}}}
    max_context: 8192
    workload: {{requests_per_s: 0.6, mean_prompt_tokens: 1500, mean_output_tokens: 300}}
    slo: {{ttft_p99_s: 3, tpot_p99_ms: 170}}
    placement: {{gpu_types: [L4]}}
planner: {{sleep_mode: true, port_base: {port}}}
"""
MODELS = (("llama-3-8b", 1.3, 12.0), ("mistral-7b", 0.6, 0.0))  # name, mean req/s, peak hour
SWING = 8.0


def scenario(minutes: float, seed: int) -> list[dict[str, object]]:
    """The compressed day's rows (sim/scenario.py), in arrival order."""
    rng = random.Random(seed)
    shapes = [(rng.randint(500, 2500), rng.randint(100, 500)) for _ in range(500)]
    models = [ModelTraffic(m, shapes, rps, peak_hour=h, swing=SWING) for m, rps, h in MODELS]
    return generate(models, minutes / 60, seed=seed, day_hours=minutes / 60)


def traffic_of(rows: list[dict[str, object]]) -> dict[str, list[WorkItem]]:
    out: dict[str, list[WorkItem]] = {}
    for r in rows:
        model = str(r["model"])
        ms, prompt, output = r["timestamp"], r["input_length"], r["output_length"]
        assert isinstance(ms, int) and isinstance(prompt, int) and isinstance(output, int)
        mine = out.setdefault(model, [])
        mine.append(WorkItem(len(mine), ms / 1000, prompt, output, model))
    return out


def port_on_all() -> int:
    """A port free on every loopback address of the fleet."""
    while True:
        port = free_port()
        try:
            for host in HOSTS[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue


def emulator_cmd(d: Deployment, profile: str) -> list[str]:
    """The planned server's vLLM flags on an emulator at time scale 1, with sleep mode."""
    s = d.server
    flags = ["--variant", s.variant, "--max-model-len", str(s.max_model_len)]
    flags += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    flags += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    flags += ["--max-num-seqs", str(s.max_num_seqs), "--host", d.host, "--enable-sleep-mode"]
    return emulate_cmd(d.port, s.gpu_type, profile, s.source, s.model, "1", *flags)


def wait_up(host: str, port: int, proc: Proc, limit_s: float = 120) -> None:
    end = time.monotonic() + limit_s  # only stops a hang
    while True:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if not proc.alive() or time.monotonic() > end:
            raise SystemExit(f"{proc.name} never came up:\n{proc.tail()}")
        time.sleep(0.2)


def payloads(rows: list[dict[str, object]], seed: int) -> list[bytes]:
    """Each row as a streamed completion: a unique head, then text to its prompt's tokens."""
    pool = random_text(2600 * CHARS_PER_TOKEN, seed, 2000)
    out = []
    for i, r in enumerate(rows):
        prompt, output = int(str(r["input_length"])), int(str(r["output_length"]))
        head = f"request {i}: "
        text = (head + pool)[: prompt * CHARS_PER_TOKEN]
        out.append(completion_body(str(r["model"]), text, output, True))
    return out


class Sampler(threading.Thread):
    """route-serve's /metrics every second: each backend's state, and the router's wakes."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port = port
        self.samples: list[tuple[float, dict[str, str]]] = []
        self.router_wakes = 0.0
        self.halt = threading.Event()

    def read(self) -> tuple[dict[str, str], float]:
        _, _, body = http_request(self.port, "GET", "/metrics", None, None, 5)
        states: dict[str, str] = {}
        wakes = 0.0
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                if s.name == "fleetctl_backend_state" and s.value == 1:
                    states[s.labels["backend"]] = s.labels["state"]
                elif s.name == "fleetctl_backend_wakes_total" and s.labels.get("trigger") == (
                    "router"
                ):
                    wakes += s.value
        return states, wakes

    def run(self) -> None:
        while not self.halt.is_set():
            at = time.time()
            try:
                states, self.router_wakes = self.read()
                self.samples.append((at, states))
            except OSError:
                pass
            self.halt.wait(max(0.0, 1.0 - (time.time() - at)))

    def gpu_hours(self, start: float, end: float, gpus: dict[str, int]) -> float:
        """GPU-seconds not asleep between `start` and `end`, each sample holding until the
        next, in hours."""
        total = 0.0
        for (at, states), (nxt, _) in zip(self.samples, self.samples[1:], strict=False):
            a, b = max(at, start), min(nxt, end)
            if b > a:
                total += (b - a) * sum(gpus.get(k, 1) for k, v in states.items() if v != "asleep")
        return total / 3600


class LiveRun:
    """The emulated fleet, route-serve and the autopilot, started in a work folder."""

    def __init__(self, work: Path, args: argparse.Namespace):
        self.work, self.args = work, args
        self.procs: list[Proc] = []
        port = port_on_all()
        self.inv_path = work / "fleet.yaml"
        self.inv_path.write_text(INVENTORY.format(port=port))
        self.inv: Inventory = load_inventory(self.inv_path, load_catalog())
        plan = plan_fleet(self.inv)
        self.deployments = list(plan.deployments)
        hosts = sorted(d.host for d in self.deployments)
        if hosts != HOSTS:
            raise SystemExit(f"the plan is not one server a node: {hosts}")
        self.sdir = StateDir(work / "state")
        self.sdir.save_state(State(1, tuple(self.deployments), slo=plan.slos))
        self.slos = dict(self.sdir.load_state().slo)
        self.audit = work / "autopilot.jsonl"

    def start(self) -> None:
        dev = {"VLLM_SERVER_DEV_MODE": "1"}
        for d in self.deployments:
            profile = self.inv.model(d.model).profile.name
            self.procs.append(Proc(f"emulator-{d.node}", emulator_cmd(d, profile), self.work, dev))
        for d, p in zip(self.deployments, self.procs, strict=True):
            wait_up(d.host, d.port, p)
        self.router_port = free_port()
        cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(self.inv_path)]
        cmd += ["--state-dir", str(self.sdir.root), "--listen", f"127.0.0.1:{self.router_port}"]
        cmd += ["--autopilot-log", str(self.audit)]
        router = Proc("route-serve", cmd, self.work)
        self.procs.append(router)
        wait_status(self.router_port, "/health", router, 200)

    def autopilot_cmd(self, audit: Path, *extra: str) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "fleetctl", "autopilot", str(self.inv_path)]
        cmd += ["--state-dir", str(self.sdir.root)]
        cmd += ["--router", f"http://127.0.0.1:{self.router_port}"]
        cmd += ["--request-log", str(self.sdir.requests_path), "--audit-log", str(audit)]
        cmd += ["--interval", f"{a.interval:g}", "--down-after", str(a.down_after)]
        return [*cmd, "--floor", str(a.floor), *extra]

    def lead_s(self) -> float:
        """Seconds from starting the autopilot to its first decision written: a dry run once
        on the empty log (its own audit file; it changes nothing)."""
        audit = self.work / "lead-dry-run.jsonl"
        began = time.time()
        done = subprocess.run(
            self.autopilot_cmd(audit, "--once", "--dry-run"), capture_output=True, cwd=REPO
        )
        if done.returncode != 0:
            raise SystemExit(f"the autopilot's dry run failed: {done.stderr.decode()[-2000:]}")
        return audit.stat().st_mtime - began

    def autopilot(self) -> Proc:
        p = Proc("autopilot", self.autopilot_cmd(self.audit), self.work)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


async def replay(url: str, bodies: list[bytes], arrivals: list[float], drain_s: float) -> float:
    """Each body at its arrival (open loop); the wall time the arrivals count from."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.time() + 0.2  # open_loop's lead
        await open_loop(session, url, bodies, arrivals, drain_s)
    return start


def log_rows(folder: Path) -> list[dict[str, Any]]:
    rows = []
    for f in sorted(folder.glob("*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return rows


def live_figures(run: LiveRun, sampler: Sampler, t0: float, span_s: float) -> dict[str, Any]:
    """GPU-hours, attainment per model and actions, measured as the docstring says."""
    gpus = {f"http://{d.host}:{d.port}": d.server.tensor_parallel_size for d in run.deployments}
    models: dict[str, dict[str, Any]] = {}
    for row in log_rows(run.sdir.requests_path):
        m = str(row.get("model"))
        if row.get("timestamp", 0) < (t0 - 1) * 1000:
            continue  # not this run's
        v = verdict(row, run.slos.get(m))
        mine = models.setdefault(m, {"requests": 0, "judged": 0, "met": 0})
        mine["requests"] += 1
        if v is not None:
            mine["judged"] += 1
            mine["met"] += v
    for v in models.values():
        v["slo_attainment"] = round(v["met"] / v["judged"], 4) if v["judged"] else None
    actions: dict[str, int] = {}
    faults: dict[str, int] = {}
    ticks = []
    for line in run.audit.read_text().splitlines():
        rec = json.loads(line)
        ticks.append(dt.datetime.fromisoformat(rec["at"]).timestamp())
        for r in rec.get("carried_out", []):
            into = actions if r["result"] == "done" else faults
            key = r["kind"] if r["result"] == "done" else f"{r['kind']} {r['result']}"
            into[key] = into.get(key, 0) + 1
    return {
        "gpu_hours": round(sampler.gpu_hours(t0, t0 + span_s, gpus), 4),
        "models": dict(sorted(models.items())),
        "actions": dict(sorted(actions.items())),
        "not_done": dict(sorted(faults.items())),
        "router_wakes": sampler.router_wakes,
        "decisions": len(ticks),
        # When the autopilot decided, from the traffic's start (its log keeps whole seconds),
        # and how far apart: a tick waits `interval` after the last one's changes are done.
        "first_decision_s": round(ticks[0] - t0, 1) if ticks else None,
        "decision_spacing_s": (
            round((ticks[-1] - ticks[0]) / (len(ticks) - 1), 1) if len(ticks) > 1 else None
        ),
        "samples": len(sampler.samples),
    }


def sim_figures(day: FleetDay) -> dict[str, Any]:
    j = day.to_json()
    return {
        "gpu_hours": j["fleet"]["gpu_hours"],
        "slo_minutes": j["fleet"]["slo_minutes"],
        "models": {
            m: {"requests": v["requests"], "slo_attainment": v["slo_attainment"]}
            for m, v in j["models"].items()
        },
        "actions": j["fleet"]["actions"],
        "decisions": [
            {"at": d.at, "changes": [f"{c.kind} {c.deployment.node}" for c in d.changes]}
            for d in day.decisions
            if d.changes
        ],
    }


def ratio(a: float | None, b: float | None) -> str:
    if a is None or not b:
        return "n/a"
    return f"{a / b:.3f}"


def table(live: dict[str, Any], sim: dict[str, Any]) -> list[str]:
    out = ["| figure | live | sim | live/sim |", "|---|---|---|---|"]
    lg, sg = live["gpu_hours"], sim["gpu_hours"]
    out.append(f"| GPU-hours | {lg:.4f} | {sg:.4f} | {ratio(lg, sg)} |")
    for m in sorted(set(live["models"]) | set(sim["models"])):
        la = live["models"].get(m, {}).get("slo_attainment")
        sa = sim["models"].get(m, {}).get("slo_attainment")
        ls = "n/a" if la is None else f"{la:.1%}"
        ss = "n/a" if sa is None else f"{sa:.1%}"
        out.append(f"| attainment {m} | {ls} | {ss} | {ratio(la, sa)} |")
        lr = live["models"].get(m, {}).get("requests", 0)
        sr = sim["models"].get(m, {}).get("requests", 0)
        out.append(f"| requests {m} | {lr} | {sr} | {ratio(lr, sr)} |")
    for k in sorted(set(live["actions"]) | set(sim["actions"])):
        la, sa = live["actions"].get(k, 0), sim["actions"].get(k, 0)
        out.append(f"| actions: {k} | {la} | {sa} | {ratio(la, sa)} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="the compressed day's length")
    p.add_argument("--interval", type=float, default=15.0)
    p.add_argument("--down-after", type=int, default=2)
    p.add_argument("--floor", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--drain", type=float, default=120.0, help="seconds to wait for answers")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "autopilot_live"))
    args = p.parse_args(argv)
    began = time.time()
    work = out_dir(args.out)
    rows = scenario(args.minutes, args.seed)
    traffic = traffic_of(rows)
    arrivals = [int(str(r["timestamp"])) / 1000 for r in rows]
    span_s = max(arrivals)
    run = LiveRun(work, args)
    settings = Settings(interval_s=args.interval, down_after=args.down_after, floor=args.floor)
    sim_t = time.time()
    day = run_autopilot(run.inv, traffic, settings)
    sim = sim_figures(day)
    sim["wall_s"] = round(time.time() - sim_t, 1)
    print(f"{len(rows)} requests over {span_s:.0f} s: "
          + ", ".join(f"{m} {len(v)}" for m, v in traffic.items()), flush=True)  # fmt: skip
    sampler = Sampler(0)
    try:
        run.start()
        sampler.port = run.router_port
        sampler.start()
        # The simulator decides first at `interval` s into the traffic: the autopilot is
        # started so that its first decision falls there too (an earlier one would count an
        # empty interval).
        lead = run.lead_s()
        url = f"http://127.0.0.1:{run.router_port}/v1/completions"
        start_at: list[float] = []

        def launch() -> None:
            start_at.append(time.time())
            pilots.append(run.autopilot())

        pilots: list[Proc] = []
        bodies = payloads(rows, args.seed)
        timer = threading.Timer(max(0.0, args.interval - lead) + 0.2, launch)
        timer.start()
        t0 = asyncio.run(replay(url, bodies, arrivals, args.drain))
        timer.join()
        pilot = pilots[0]
        time.sleep(2.5)  # route-serve flushes its request log each second
        pilot.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            pilot.proc.wait(timeout=60)
        sampler.halt.set()
        sampler.join()
        live = live_figures(run, sampler, t0, span_s)
        live["lead_s"] = round(lead, 2)
    finally:
        sampler.halt.set()
        run.stop()
    lines = [
        *header(__file__, time.time() - began),
        f"- Scenario: {len(rows)} requests over {span_s:.0f} s ("
        + ", ".join(f"{m} {len(v)}" for m, v in traffic.items())
        + f"); interval {args.interval:g} s, down-after {args.down_after}, floor {args.floor}",
        "- SLO (state.json): " + "; ".join(f"{m} {s.text()}" for m, s in sorted(run.slos.items())),
        f"- Live: {live['decisions']} decisions, the first {live['first_decision_s']} s into the "
        f"traffic, {live['decision_spacing_s']} s apart on average (the autopilot's start to its "
        f"first decision: {live['lead_s']} s); {live['samples']} samples of route-serve's "
        f"/metrics; the router's own wakes {live['router_wakes']:g}; changes not done: "
        f"{live['not_done'] or 'none'}",
        f"- Sim: decisions with changes {sim['decisions']}",
        "",
        *table(live, sim),
    ]
    print("\n".join(lines))
    write_json(work / "result.json", {"live": live, "sim": sim, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
