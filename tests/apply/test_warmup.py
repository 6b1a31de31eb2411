"""Warm-up as a cost: vLLM's start-up log read into phases, start-ups kept in the calibration,
the estimate without one, and a plan's disruption by the steps apply really takes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from fleetctl.apply.warmup import (
    DISK_READ_BYTES_S,
    STARTUP_FIXED_S,
    Warmup,
    disruption,
    parse_startup_log,
    replacement_minutes,
    stay_bonus,
    warmup_for,
    warmup_seconds,
)
from fleetctl.fleet.plan import Deployment
from fleetctl.model.calibration import (
    Calibration,
    CalibrationError,
    Entry,
    Key,
    find_startup,
    record_startup,
)
from tests.apply.test_apply_steps import dep
from tests.conftest import DATA, REPO

KEY = Key("A100-SXM4-80GB", "llama-3-8b", "bf16", 1)


# --- the log -----------------------------------------------------------------------------------


def test_phases_from_a_real_vllm_startup_log():
    # Captured from a real vLLM 0.32.0 (CPU build) serving tiny-llama: tests/data's README.
    text = (DATA / "vllm-0.32.0-cpu-startup.log").read_text()
    assert parse_startup_log(text) == {
        "model_init_s": 1.304817,
        "weights_s": 0.27,
        "engine_init_s": 0.94,
    }


def test_weight_loads_from_real_public_gpu_startup_logs():
    # benchmarks/accuracy/kv_points.yaml quotes real vLLM GPU start-up logs (each row names
    # its source): both forms of the line, "GiB and" (0.10) and "GiB memory and" (0.19).
    import yaml

    rows = yaml.safe_load((REPO / "benchmarks/accuracy/kv_points.yaml").read_text())
    rows = rows["points"] if isinstance(rows, dict) else rows
    loads = {}
    for r in rows:
        line = next((x for x in (r.get("quote") or "").splitlines() if "Model loading" in x), "")
        if line.rstrip().endswith("seconds"):
            loads[r["id"]] = parse_startup_log(line).get("model_load_s")
    assert len(loads) == 34 and None not in loads.values()
    assert loads["llmd-llama31-8b-bf16-tp1-mml8k"] == 14.42968  # "... and 14.429680 seconds"
    assert loads["dl-qwen2-7b-bf16-tp1-u025-a100-80"] == 4.422213  # "GiB and 4.422213 seconds"


def test_phases_of_the_gpu_runner_from_vllms_format_strings():
    # Not captured (no GPU here): vLLM's own format strings filled in, with its log prefix.
    # Each rank of a TP group logs its load; the first counts (they load in parallel).
    lines = [
        "(Worker_TP0 pid=7) INFO 12-01 10:00:05 [gpu_model_runner.py:2653] Model loading took "
        "14.99 GiB memory and 5.437712 seconds",
        "(Worker_TP1 pid=8) INFO 12-01 10:00:06 [gpu_model_runner.py:2653] Model loading took "
        "14.99 GiB memory and 6.100000 seconds",
        "(EngineCore_DP0 pid=6) INFO 12-01 10:00:31 [monitor.py:34] torch.compile takes 21.35 s "
        "in total",
        "(EngineCore_DP0 pid=6) INFO 12-01 10:00:52 [gpu_model_runner.py:3480] Graph capturing "
        "finished in 12 secs, took 0.52 GiB",
        "(EngineCore_DP0 pid=6) INFO 12-01 10:00:52 [core.py:210] init engine (profile, create "
        "kv cache, warmup model) took 44.81 seconds",
    ]
    assert parse_startup_log("\n".join(lines)) == {
        "model_load_s": 5.437712,
        "compile_s": 21.35,
        "graphs_s": 12.0,
        "engine_init_s": 44.81,
    }
    assert parse_startup_log("nothing took place\n") == {}


# --- the store ---------------------------------------------------------------------------------


def test_startups_are_kept_beside_the_entries_and_survive_a_refresh(tmp_path):
    cal = Calibration()
    for s in (30.0, 90.0, 32.0):  # the 90 s start read its weights from a cold disk
        cal = record_startup(cal, KEY, s, "2026-12-01T10:00:00+00:00", {"weights_s": 4.5}, "n1")
    (found,) = cal.startups
    assert found.seconds == (30.0, 90.0, 32.0) and found.median_s == 32.0
    assert found.servers == ("n1",) and dict(found.phases) == {"weights_s": 4.5}
    back = Calibration.from_json(json.loads(json.dumps(cal.to_json())))
    assert back == cal
    # A metrics refresh merges entries and keeps the start-ups.
    entry = Entry(KEY, "2026-12-01T11:00:00+00:00")
    assert cal.merged([entry]).startups == cal.startups
    # A file written before start-ups were kept still reads.
    old = {"format": 1, "entries": [entry.to_json()]}
    assert Calibration.from_json(old).startups == ()
    with pytest.raises(CalibrationError, match=r"startups\[0\].seconds"):
        bad = {**cal.to_json()}
        bad["startups"] = [{**bad["startups"][0], "seconds": [-1]}]
        Calibration.from_json(bad)
    assert find_startup(cal, "A100-SXM4-80GB", "llama-3-8b", "bf16", 2) is None


def test_measured_startup_wins_over_the_estimate():
    weights = 16_060_000_000
    est = warmup_for(None, "A100-SXM4-80GB", "llama-3-8b", "bf16", 1, weights)
    assert est.seconds == pytest.approx(weights / DISK_READ_BYTES_S + STARTUP_FIXED_S)
    assert not est.measured and est.source.startswith("estimate: 16.1 GB at 1 GB/s + 60 s")
    cal = record_startup(Calibration(), KEY, 41.5, "2026-12-01T10:00:00+00:00")
    got = warmup_for(cal, "A100-SXM4-80GB", "llama-3-8b", "bf16", 1, weights)
    assert got.measured and got.seconds == 41.5
    assert got.source == "measured by apply over 1 start, 2026-12-01 10:00"
    assert warmup_seconds(cal, "A100-SXM4-80GB", "llama-3-8b", "bf16", 1, weights) == 41.5
    # Another format is another class: estimated.
    assert not warmup_for(cal, "A100-SXM4-80GB", "llama-3-8b", "fp8", 1, weights).measured


def test_what_a_replica_that_stays_spares():
    # At the default 92% of GPU memory a replacement stops the old server first: its slot is
    # empty for the warm-up, so a change costs twice the warm-up in server-minutes.
    assert replacement_minutes(90, 0.92) == 3.0
    assert replacement_minutes(90, 0.45) == 1.5  # start before stop: warm-up only
    # An 8B BF16 server by the estimate (16 GB: 76 s): a change must gain 5% on its model.
    assert stay_bonus(76.0, 0.92) == pytest.approx(0.02 * 76 / 60 * 2)


# --- a plan's disruption -----------------------------------------------------------------------


def flat(w: float):
    return lambda d: Warmup(w, "test")


def test_nothing_changes_nothing_is_disrupted():
    now = [dep((0,)), dep((1,))]
    got = disruption(now, now, flat(60))
    assert (got.servers_started, got.servers_stopped, got.warmup_s) == (0, 0, 0)
    assert got.line() == ""


def test_a_first_apply_warms_every_server_up_and_misses_nothing():
    got = disruption([dep((0,)), dep((1,))], [], flat(90))
    assert got.to_json() | {"servers": []} == {
        "warmup_server_minutes": 3.0,
        "capacity_missing_server_minutes": 0.0,
        "servers_started": 2,
        "servers_stopped": 0,
        "servers": [],
    }


def test_a_replacement_that_fits_beside_the_old_server_misses_no_capacity():
    # Two servers of 45% fit on one GPU together: apply starts the new one on the surge port,
    # waits for it, then stops the old one (apply/steps.py).
    old, new = dep((0,), util=0.45), dep((0,), util=0.45, max_len=4096)
    got = disruption([new], [old], flat(120))
    assert (got.servers_started, got.servers_stopped) == (1, 1)
    assert got.warmup_server_minutes == 2.0 and got.capacity_missing_s == 0.0
    (s,) = got.started
    assert s.surge and s.kind == "replace" and s.stopped_first == 0
    assert "1 replacement starts beside the old server" in got.line()


def test_a_replacement_that_does_not_fit_leaves_its_slot_empty_while_it_warms_up():
    old, new = dep((0,), util=0.92), dep((0,), util=0.92, max_len=4096)
    got = disruption([new], [old], flat(120))
    assert got.warmup_server_minutes == 2.0 and got.capacity_missing_server_minutes == 2.0
    assert not got.started[0].surge and got.started[0].stopped_first == 1
    # Two TP=1 servers replaced by one TP=2: both are out while it warms up.
    got = disruption([dep((0, 1))], [dep((0,)), dep((1,))], flat(60))
    assert got.servers_started == 1 and got.servers_stopped == 2
    assert got.capacity_missing_server_minutes == 2.0


def test_a_server_moved_to_another_node_is_missing_until_its_replacement_is_up():
    here = dep((0,))
    there = Deployment("n2", "10.0.0.2", (0,), 8000, here.server)
    got = disruption([there], [here], flat(90))
    # n1 has nothing to start: it stops at once, while n2's server warms up for 90 s.
    assert (got.servers_started, got.servers_stopped) == (1, 1)
    assert got.capacity_missing_s == 90.0
    # A model that only shrinks loses what the plan drops, by design: nothing is "missing".
    got = disruption([dep((0,))], [dep((0,)), dep((1,))], flat(90))
    assert (got.servers_started, got.servers_stopped, got.capacity_missing_s) == (0, 1, 0.0)


def test_the_warmup_follows_each_servers_weights():
    big = dep((0,), util=0.92, max_len=4096)
    big = dataclasses.replace(big, server=dataclasses.replace(big.server, weights_bytes=int(40e9)))
    got = disruption(
        [big], [dep((0,))], lambda d: warmup_for(None, "g", "m", "f", 1, d.server.weights_bytes)
    )
    assert got.warmup_s == pytest.approx(40 + STARTUP_FIXED_S)


# --- route-serve: a joining server gets no traffic until healthy, then warm-up first ---------


class Loading:
    """A real HTTP server that answers /health 503 until the test calls `ready()` (as vLLM's
    API server does while its engine is not up), serves /v1/models and /metrics all along, and
    counts the completions it gets: warm-ups (route-serve's own) and the clients'."""

    def __init__(self) -> None:
        import threading

        from aiohttp import web

        from tests.procs import free_port

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.is_ready = False
        self.log: list[tuple[bool, str]] = []  # (ready then, prompt) per completion
        self.bodies: list[dict] = []  # each completion's body
        self.most = 0  # the most completions it held at once
        self.health_reads = 0
        self.metrics_reads = 0
        # While `hold` is set, each completion waits for one `let_one_go()` (30 s at most).
        self.hold = False
        self._go = threading.Semaphore(0)
        held = 0

        async def health(_: web.Request) -> web.Response:
            self.health_reads += 1
            return web.Response(status=200 if self.is_ready else 503)

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": NAME, "object": "model"}]})

        async def metrics(_: web.Request) -> web.Response:
            self.metrics_reads += 1
            return web.Response(text="# no series yet\n")

        async def complete(request: web.Request) -> web.Response:
            nonlocal held
            body = await request.json()
            self.log.append((self.is_ready, str(body.get("prompt"))))
            self.bodies.append(body)
            held += 1
            self.most = max(self.most, held)
            try:
                if self.hold:
                    loop = asyncio.get_running_loop()
                    await loop.run_in_executor(None, self._go.acquire, True, 30)
            finally:
                held -= 1
            return web.json_response(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "model": NAME,
                    "choices": [{"index": 0, "text": " hi", "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", complete)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.runner = web.AppRunner(app)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", self.port)
            self.loop.run_until_complete(site.start())
            started.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        assert started.wait(10)

    def ready(self) -> None:
        self.is_ready = True

    def let_one_go(self) -> None:
        self._go.release()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


NAME = "llama-3-8b"


def _route_serve_health(port: int) -> dict:
    from tests.procs import http_request

    return json.loads(http_request(port, "GET", "/health", timeout=5)[2])


def _until(check, proc, log: Path, timeout: float = 60) -> None:
    import time

    end = time.monotonic() + timeout  # only stops a hang
    while not check():
        assert proc.poll() is None and time.monotonic() < end, log.read_text()
        time.sleep(0.05)


def test_route_serve_sends_a_joining_server_nothing_until_healthy_then_warms_it(tmp_path):
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.procs import Emulator, free_port, http_request, stop_process

    emu = Emulator(tmp_path)
    loading = Loading()
    proc = None
    try:
        emu.wait_healthy()
        inv = tmp_path / "inventory.yaml"
        inv.write_text(
            "nodes:\n  - name: rtx-[1:2]\n    gpus: {type: RTX-4090, count: 1}\n"
            "models:\n  - name: llama-3-8b\n    profile: llama-3-8b\n"
            "    variants:\n      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}\n"
            "    max_context: 8192\n"
            "router: {warmup_requests: 2}\n"
        )
        entry = {"node": "rtx-1", "gpu_type": "RTX-4090", "model": NAME}
        backends = tmp_path / "backends.yaml"
        backends.write_text(json.dumps({"backends": [{**entry, "url": emu.base}]}))
        port = free_port()
        log = tmp_path / "router.log"
        cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv)]
        cmd += ["--backends", str(backends), "--listen", f"127.0.0.1:{port}"]
        cmd += ["--state-dir", str(tmp_path / "state"), "--policy", "round-robin"]
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

        def healthy(n: int) -> bool:
            try:
                return _route_serve_health(port).get("healthy") == n
            except OSError:
                return False

        _until(lambda: healthy(1), proc, log)
        # apply started a server on rtx-2 (it loads: /health 503) and route-serve reloads.
        entries = [{**entry, "url": emu.base}, {**entry, "node": "rtx-2", "url": loading.base}]
        backends.write_text(json.dumps({"backends": entries}))
        proc.send_signal(signal.SIGHUP)
        where = f"rtx-2:{loading.port}"
        _until(
            lambda: "/health answered 503" in _route_serve_health(port)["unhealthy"].get(where, ""),
            proc,
            log,
        )
        body = {"model": NAME, "prompt": "client", "max_tokens": 2}
        for _ in range(6):  # round-robin would send half of them to rtx-2
            status, headers, _ = http_request(port, "POST", "/v1/completions", body)
            assert status == 200 and headers["X-Fleet-Backend"] == "rtx-1"
        assert loading.log == []
        # Ready now: route-serve sends two short completions of its own (prompt `Hello`, 8
        # tokens, the model's name), one at a time, and /health says how far it is.
        loading.hold = True
        loading.ready()

        def listed(text: str) -> bool:
            return _route_serve_health(port)["unhealthy"].get(where, "") == text

        for n in range(2):
            _until(lambda n=n: len(loading.bodies) == n + 1, proc, log)
            _until(lambda n=n: listed(f"warming up: {n} of 2 warm-up requests"), proc, log)
            assert len(loading.bodies) == n + 1  # the next waits for this one's answer
            loading.let_one_go()
        loading.hold = False
        _until(lambda: healthy(2), proc, log)
        assert loading.log == [(True, "Hello"), (True, "Hello")]
        for warm in loading.bodies:
            assert (warm["model"], warm["prompt"], warm["max_tokens"]) == (NAME, "Hello", 8)
        assert loading.most == 1
        sent = [http_request(port, "POST", "/v1/completions", body)[1] for _ in range(4)]
        assert {h["X-Fleet-Backend"] for h in sent} == {"rtx-1", "rtx-2"}
        assert loading.log[2:] == [(True, "client")] * 2
        text = log.read_text()
        assert f"admitted {where}: /health answered 200 and it served 2 warm-up requests" in text
    finally:
        if proc is not None:
            stop_process(proc)
        loading.stop()
        emu.stop()


def test_route_serve_routes_its_starting_servers_at_once_without_reading_their_health(tmp_path):
    """README: the servers route-serve starts with are routed at once; route-serve reads no
    backend's /health otherwise. A server whose /health answers 503 is in the backends file at
    start: once route-serve has scraped it twice, a client's request is served there, and its
    /health was never read."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.procs import free_port, http_request, stop_process

    loading = Loading()
    proc = None
    try:
        inv = tmp_path / "inventory.yaml"
        inv.write_text(
            "nodes:\n  - name: rtx-1\n    gpus: {type: RTX-4090, count: 1}\n"
            "models:\n  - name: llama-3-8b\n    profile: llama-3-8b\n"
            "    variants:\n      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}\n"
            "    max_context: 8192\n"
            "router: {warmup_requests: 2}\n"
        )
        entry = {"node": "rtx-1", "gpu_type": "RTX-4090", "model": NAME, "url": loading.base}
        backends = tmp_path / "backends.yaml"
        backends.write_text(json.dumps({"backends": [entry]}))
        port = free_port()
        log = tmp_path / "router.log"
        cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv)]
        cmd += ["--backends", str(backends), "--listen", f"127.0.0.1:{port}"]
        cmd += ["--state-dir", str(tmp_path / "state"), "--no-request-log"]
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        _until(lambda: loading.metrics_reads >= 2, proc, log)
        assert _route_serve_health(port)["healthy"] == 1
        body = {"model": NAME, "prompt": "client", "max_tokens": 2}
        status, headers, answer = http_request(port, "POST", "/v1/completions", body)
        assert status == 200 and headers["X-Fleet-Backend"] == "rtx-1", answer
        assert loading.log == [(False, "client")]  # no warm-up for a server it started with
        assert loading.health_reads == 0
    finally:
        if proc is not None:
            stop_process(proc)
        loading.stop()
