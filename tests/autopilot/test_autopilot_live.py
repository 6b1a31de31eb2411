"""`fleetctl autopilot` on a live fleet: emulated vLLM servers with sleep mode, a real
route-serve over the state folder writing its request log, and the autopilot run one interval
at a time (`--once`): it sleeps what the traffic no longer needs, wakes what it needs again,
changes nothing in a dry run, and keeps going past a wake that fails for memory."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.state import Sleeper, State
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from harness.commands import emulate_cmd
from harness.procs import Proc
from harness.ready import http_request, wait_status
from tests.conftest import REPO
from tests.procs import NAME, SOURCE, free_port

DEV = {"VLLM_SERVER_DEV_MODE": "1"}
# Four times faster than life: short requests and wakes take a moment, a long answer streams
# long enough to be in flight while the autopilot drains its server.
SCALE = "4"
# Two one-GPU nodes on two loopback addresses, one port: each server's slot is its own.
# Long requests in the workload make one server carry a fraction of a request a second, so a
# handful of requests in an interval asks for both.
INVENTORY = """\
nodes:
  - name: box-[1:2]
    host: 127.0.0.[1:2]
    gpus: {{type: RTX-4090, count: 1}}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {{source: meta-llama/Meta-Llama-3-8B-Instruct}}
    max_context: 8192
    workload: {{requests_per_s: 1, mean_prompt_tokens: 2000, mean_output_tokens: 1000}}
planner: {{sleep_mode: true, port_base: {port}}}
"""


def _port_on_both() -> int:
    """A port free on 127.0.0.1 and 127.0.0.2."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.2", port))
                return port
            except OSError:
                continue


class Fleet:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.port = _port_on_both()
        self.inv = tmp / "inv.yaml"
        self.inv.write_text(INVENTORY.format(port=self.port))
        self.ledger = tmp / "gpu-box-2"
        self.sdir = StateDir(tmp / "state")
        plan = plan_fleet(load_inventory(self.inv, load_catalog()))
        self.deployments = plan.deployments
        assert [d.host for d in self.deployments] == ["127.0.0.1", "127.0.0.2"]
        self.emus = [
            self._emulator("127.0.0.1", "box-1"),
            self._emulator("127.0.0.2", "box-2", "--gpu-ledger", str(self.ledger)),
        ]
        self.procs: list[Proc] = list(self.emus)
        for host in ("127.0.0.1", "127.0.0.2"):
            self.wait(host, "/health")
        self.sdir.save_state(State(1, self.deployments))
        self.router_port = free_port()
        cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(self.inv)]
        cmd += ["--state-dir", str(self.sdir.root), "--listen", f"127.0.0.1:{self.router_port}"]
        self.audit = tmp / "audit.jsonl"  # the autopilot's audit log route-serve shows
        cmd += ["--autopilot-log", str(self.audit)]
        self.router = Proc("route-serve", cmd, tmp, own_group=False)
        self.procs.append(self.router)
        wait_status(self.router_port, "/health", self.router, 200)
        self.router_url = f"http://127.0.0.1:{self.router_port}"

    def _emulator(self, host: str, name: str, *extra: str) -> Proc:
        cmd = emulate_cmd(self.port, "RTX-4090", NAME, SOURCE, NAME, SCALE, "--host", host)
        cmd += ["--enable-sleep-mode", *extra]
        return Proc(f"emulator-{name}", cmd, self.tmp, DEV, own_group=False)

    def call(self, host: str, method: str, path: str) -> tuple[int, dict]:
        # harness.ready.http_request speaks to 127.0.0.1 only; box-2 is on 127.0.0.2.
        conn = http.client.HTTPConnection(host, self.port, timeout=30)
        try:
            conn.request(method, path, body=b"" if method == "POST" else None)
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"{}")
        finally:
            conn.close()

    def wait(self, host: str, path: str) -> None:
        end = time.monotonic() + 60  # only stops a hang
        while True:
            try:
                if self.call(host, "GET", path)[0] == 200:
                    return
            except OSError:
                pass
            assert time.monotonic() < end, f"{host} did not answer {path}"
            time.sleep(0.05)

    def sleeping(self, host: str) -> bool:
        return bool(self.call(host, "GET", "/is_sleeping")[1]["is_sleeping"])

    def reset(self, asleep: bool = False) -> None:
        """Both servers awake in state.json and on their ports; or box-2 asleep at level 1."""
        for host in ("127.0.0.1", "127.0.0.2"):
            if self.sleeping(host):
                assert self.call(host, "POST", "/wake_up")[0] == 200
        one, two = self.deployments
        if asleep:
            assert self.call("127.0.0.2", "POST", "/sleep?level=1")[0] == 200
            self.sdir.save_state(State(1, (one,), asleep=(Sleeper(two, 1),)))
            self.wait_backends(1)
        else:
            self.sdir.save_state(State(1, (one, two)))
            self.wait_backends(2)

    def wait_backends(self, n: int) -> None:
        """Until route-serve routes to `n` awake servers (a sleeper stays a backend, asleep)."""
        end = time.monotonic() + 60
        while True:
            _, _, body = http_request(self.router_port, "GET", "/health")
            if json.loads(body).get("states", {}).get("awake") == n:
                return
            assert time.monotonic() < end, f"route-serve never listed {n} awake backends"
            time.sleep(0.05)

    def log_lines(self) -> int:
        folder = self.sdir.requests_path
        if not folder.is_dir():
            return 0
        return sum(len(p.read_bytes().splitlines()) for p in folder.glob("*.jsonl"))

    def traffic(self, n: int) -> None:
        """`n` requests through route-serve, once its request log holds them (it flushes each
        second)."""
        before = self.log_lines()
        body = {"model": NAME, "prompt": "hello there", "max_tokens": 4}

        def one(_: int) -> int:
            return http_request(self.router_port, "POST", "/v1/completions", body, None, 60)[0]

        with ThreadPoolExecutor(4) as pool:
            assert set(pool.map(one, range(n))) == {200}
        end = time.monotonic() + 30
        while self.log_lines() < before + n:
            assert time.monotonic() < end, "the request log never held the requests"
            time.sleep(0.05)

    def autopilot(
        self, audit: Path, *args: str, inv: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "fleetctl", "autopilot", str(inv or self.inv), "--once"]
        cmd += ["--state-dir", str(self.sdir.root), "--router", self.router_url]
        cmd += ["--request-log", str(self.sdir.requests_path), "--audit-log", str(audit)]
        return subprocess.run(
            [*cmd, "--down-after", "1", "--floor", "1", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
        )

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("autopilot-live"))
    try:
        yield f
    finally:
        f.stop()


def _audit(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_low_traffic_sleeps_a_server(fleet, tmp_path):
    """Quiet traffic on a model with two awake servers: one interval drains one and puts it to
    sleep; state.json lists it asleep, the server says it sleeps, the audit log has why."""
    fleet.reset()
    fleet.traffic(2)
    audit = tmp_path / "audit.jsonl"
    # Two requests a minute, whenever the autopilot starts after them (the first interval
    # counts what arrived in the last --interval seconds: a 2 s one may or may not hold them).
    run = fleet.autopilot(audit, "--interval", "60")
    assert run.returncode == 0, run.stderr
    state = fleet.sdir.load_state()
    said = run.stdout + run.stderr + (audit.read_text() if audit.exists() else "")
    assert len(state.deployments) == 1 and len(state.asleep) == 1, said
    assert not state.draining, said
    slept = state.asleep[0].deployment
    assert fleet.sleeping(slept.host) and not fleet.sleeping(state.deployments[0].host)
    [line] = _audit(audit)
    assert line["outcome"] == "moved"
    assert [c["kind"] for c in line["changes"]] == ["sleep"]
    assert line["carried_out"][0]["result"] == "done"
    assert line["carried_out"][0]["server"] == f"{slept.node}:{slept.port}"
    assert audit.stat().st_mode & 0o777 == 0o600
    fleet.wait_backends(1)  # route-serve followed state.json


def test_a_dry_run_changes_nothing_and_says_what_it_would_do(fleet, tmp_path):
    fleet.reset()
    before = fleet.sdir.state_path.read_bytes()
    audit = tmp_path / "audit.jsonl"
    run = fleet.autopilot(audit, "--interval", "60", "--dry-run")
    assert run.returncode == 0, run.stderr
    assert "would sleep llama-3-8b on box-" in run.stdout, run.stdout
    assert fleet.sdir.state_path.read_bytes() == before
    assert not fleet.sleeping("127.0.0.1") and not fleet.sleeping("127.0.0.2")
    [line] = _audit(audit)
    assert line["outcome"] == "dry_run"
    assert line["carried_out"][0]["result"] == "dry_run"


def test_rising_traffic_wakes_the_sleeper(fleet, tmp_path):
    """box-2 asleep; more requests than one server carries: the interval wakes it, and it is
    back in state.json's deployments."""
    fleet.reset(asleep=True)
    fleet.traffic(12)
    audit = tmp_path / "audit.jsonl"
    run = fleet.autopilot(audit, "--interval", "30")
    assert run.returncode == 0, run.stderr
    [line] = _audit(audit)
    assert [c["kind"] for c in line["changes"]] == ["wake"], line
    assert line["carried_out"][0]["result"] == "done", line
    state = fleet.sdir.load_state()
    assert len(state.deployments) == 2 and not state.asleep
    assert not fleet.sleeping("127.0.0.2")
    fleet.wait_backends(2)


def test_a_sleeper_route_serve_woke_is_taken_as_awake(fleet, tmp_path):
    """box-2 asleep in state.json, then woken behind the autopilot's back (route-serve asks
    /wake_up itself when a request finds no awake server): the next interval finds it
    awake, says so in the audit log, and state.json agrees with the servers again."""
    fleet.reset(asleep=True)
    assert fleet.call("127.0.0.2", "POST", "/wake_up")[0] == 200
    audit = tmp_path / "audit.jsonl"
    run = fleet.autopilot(audit, "--interval", "60")
    assert run.returncode == 0, run.stderr
    [line] = _audit(audit)
    two = fleet.deployments[1]
    assert line["woken_by_router"] == [f"{two.node}:{two.port}"], line
    state = fleet.sdir.load_state()
    for d in state.deployments:
        assert not fleet.sleeping(d.host), line
    for s in state.asleep:
        assert fleet.sleeping(s.deployment.host), line


def test_a_wake_refused_for_memory_is_that_change_s_fault(fleet, tmp_path):
    """Another process took box-2's GPU memory while it slept (vLLM's wake fails out of
    memory then): the wake is a fault in the audit log, box-2 stays asleep in state.json, and
    the autopilot exits cleanly."""
    fleet.reset(asleep=True)
    squatter_port = free_port()
    cmd = emulate_cmd(squatter_port, "RTX-4090", NAME, SOURCE, NAME, SCALE, "--host", "127.0.0.2")
    cmd += ["--gpu-ledger", str(fleet.ledger), "--gpu-memory-utilization", "0.8"]
    squatter = Proc("squatter", cmd, fleet.tmp, own_group=False)
    try:
        wait_status_on(squatter, "127.0.0.2", squatter_port)
        fleet.traffic(12)
        audit = tmp_path / "audit.jsonl"
        run = fleet.autopilot(audit, "--interval", "30")
        assert run.returncode == 0, run.stderr
        [line] = _audit(audit)
        [result] = line["carried_out"]
        assert result["kind"] == "wake" and result["result"] == "fault", line
        assert line["outcome"] == "held"  # nothing moved
        assert "out of memory" in result["detail"], result
        state = fleet.sdir.load_state()
        assert len(state.asleep) == 1 and len(state.deployments) == 1
        assert fleet.sleeping("127.0.0.2")
        assert "wake llama-3-8b on box-2" in run.stdout and "fault" in run.stdout
    finally:
        squatter.stop()


def _dcgm_from_ledger(ledger: Path, total: int) -> ThreadingHTTPServer:
    """A dcgm-exporter stand-in on 127.0.0.2 whose GPU 0 has free what the emulators sharing
    `ledger` leave of `total` bytes (its port: server_address[1])."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            held = 0
            for path in ledger.glob("*.json"):
                entry = json.loads(path.read_text())
                try:
                    os.kill(int(entry["pid"]), 0)
                except OSError:
                    continue
                held += int(entry["bytes"])
            free_mib = (total - held) // 2**20
            body = f'DCGM_FI_DEV_FB_FREE{{gpu="0",device="nvidia0"}} {free_mib}\n'.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.2", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_wake_is_refused_before_it_is_tried_where_dcgm_shows_the_memory_taken(fleet, tmp_path):
    """With a dcgm-exporter port in the inventory, the autopilot reads the node's free GPU
    memory before a wake: taken by another process, the wake is not tried (a fault naming the
    free and the needed GiB, not vLLM's out-of-memory answer); once it is free, it wakes."""
    from fleetctl.model.catalog import load_catalog

    fleet.reset(asleep=True)
    total = load_catalog().gpu("RTX-4090").memory_bytes
    dcgm = _dcgm_from_ledger(fleet.ledger, total)
    inv = tmp_path / "inv-dcgm.yaml"
    port = dcgm.server_address[1]
    inv.write_text(INVENTORY.format(port=fleet.port) + f"router: {{dcgm_exporter_port: {port}}}\n")
    squatter_port = free_port()
    cmd = emulate_cmd(squatter_port, "RTX-4090", NAME, SOURCE, NAME, SCALE, "--host", "127.0.0.2")
    cmd += ["--gpu-ledger", str(fleet.ledger), "--gpu-memory-utilization", "0.8"]
    squatter = Proc("squatter-dcgm", cmd, fleet.tmp, own_group=False)
    try:
        wait_status_on(squatter, "127.0.0.2", squatter_port)
        fleet.traffic(12)
        audit = tmp_path / "audit.jsonl"
        run = fleet.autopilot(audit, "--interval", "30", inv=inv)
        assert run.returncode == 0, run.stderr
        [result] = _audit(audit)[-1]["carried_out"]
        assert result["kind"] == "wake" and result["result"] == "fault", result
        assert "not woken: GPU 0 of box-2 has" in result["detail"], result
        assert "CUDA out of memory" not in result["detail"]
        assert fleet.sleeping("127.0.0.2")
        squatter.stop()
        fleet.traffic(12)
        run = fleet.autopilot(audit, "--interval", "30", inv=inv)
        assert run.returncode == 0, run.stderr
        [result] = _audit(audit)[-1]["carried_out"]
        assert (result["kind"], result["result"]) == ("wake", "done"), result
        assert not fleet.sleeping("127.0.0.2")
    finally:
        squatter.stop()
        dcgm.shutdown()


def wait_status_on(proc: Proc, host: str, port: int) -> None:
    end = time.monotonic() + 60
    while True:
        try:
            conn = http.client.HTTPConnection(host, port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        assert proc.alive(), proc.tail()
        assert time.monotonic() < end, proc.tail()
        time.sleep(0.05)


def _metric(fleet: Fleet, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    _, _, body = http_request(fleet.router_port, "GET", "/metrics")
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def _metric_reaches(fleet: Fleet, name: str, value: float, **labels: str) -> None:
    """Until route-serve's /metrics shows `value` (it follows the audit log as it grows)."""
    end = time.monotonic() + 30
    while _metric(fleet, name, **labels) != value:
        assert time.monotonic() < end, f"{name}{labels} never reached {value}"
        time.sleep(0.05)


def test_route_serve_shows_the_autopilots_decisions_from_its_audit_log(fleet):
    """route-serve --autopilot-log: each decision, each action carried out, the forecast and
    the time of the last decision are on its /metrics, by the names the dashboard reads."""
    fleet.reset()
    assert _metric(fleet, "fleetctl_autopilot_decisions_total", outcome="dry_run") == 0
    assert _metric(fleet, "fleetctl_autopilot_last_decision_timestamp_seconds") == 0
    before = time.time()
    # A short interval: the earlier tests' traffic is older than it, so the fleet is quiet.
    run = fleet.autopilot(fleet.audit, "--interval", "2", "--dry-run")
    assert run.returncode == 0, run.stderr
    _metric_reaches(fleet, "fleetctl_autopilot_decisions_total", 1, outcome="dry_run")
    assert _metric(fleet, "fleetctl_autopilot_actions_total", kind="sleep") == 0
    forecast = _metric(fleet, "fleetctl_autopilot_forecast_requests", model=NAME)
    assert forecast is not None and forecast >= 0
    last = _metric(fleet, "fleetctl_autopilot_last_decision_timestamp_seconds")
    assert last is not None and last >= int(before)
    run = fleet.autopilot(fleet.audit, "--interval", "2")
    assert run.returncode == 0, run.stderr
    _metric_reaches(fleet, "fleetctl_autopilot_decisions_total", 1, outcome="moved")
    assert _metric(fleet, "fleetctl_autopilot_actions_total", kind="sleep") == 1


def _in_flight(fleet: Fleet) -> socket.socket:
    """A long streamed answer through route-serve, once its first bytes arrived; closing the
    socket ends it."""
    body = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 4000, "stream": True})
    sock = socket.create_connection(("127.0.0.1", fleet.router_port), timeout=60)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    )
    sock.sendall(head.encode())
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    return sock


def test_a_stop_while_draining_abandons_the_sleep_and_leaves_the_server_awake(fleet, tmp_path):
    """The loop (no --once) drains a server that still has answers in flight; SIGTERM then
    ends the drain: the server stays awake and is no longer draining, the audit log says the
    change was abandoned, and the process exits 0 at once."""
    fleet.reset()
    socks = []
    try:
        while not all(
            _metric(fleet, "fleetctl_backend_outstanding_requests", backend=b)
            for b in (f"http://{d.host}:{d.port}" for d in fleet.deployments)
        ):
            assert len(socks) < 16, "route-serve never spread the answers over both servers"
            socks.append(_in_flight(fleet))
        audit = tmp_path / "audit.jsonl"
        cmd = [sys.executable, "-m", "fleetctl", "autopilot", str(fleet.inv), "--interval", "2"]
        cmd += ["--state-dir", str(fleet.sdir.root), "--router", fleet.router_url]
        cmd += ["--audit-log", str(audit), "--down-after", "1", "--drain-timeout", "300"]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
        )
        try:
            end = time.monotonic() + 120  # only stops a hang
            while not fleet.sdir.load_state().draining:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < end, "the autopilot never drained a server"
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err
        assert "stopped; every server is left as it is" in out
        state = fleet.sdir.load_state()
        assert len(state.deployments) == 2 and not state.asleep and not state.draining
        assert not fleet.sleeping("127.0.0.1") and not fleet.sleeping("127.0.0.2")
        [line] = _audit(audit)
        assert [r["result"] for r in line["carried_out"]] == ["abandoned"], line
        assert line["outcome"] == "held"
    finally:
        for s in socks:
            s.close()  # the last test on the fleet: its servers may finish these at leisure


@pytest.mark.parametrize(
    "args, what",
    [
        (["--router", "http://127.0.0.1:1", "--request-log", "{tmp}/nowhere"], "no request log"),
        (["--router", "ftp://x", "--request-log", "{tmp}"], "is not an http(s) URL"),
        (["--router", "127.0.0.1:8080", "--request-log", "{tmp}"], "is not an http(s) URL"),
        (["--router", "http://h:1", "--request-log", "{tmp}", "--interval", "0"], "--interval"),
    ],
)
def test_bad_input_is_one_line_exit_2(cli, tmp_path, args, what):
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY.format(port=8000))
    r = cli("autopilot", str(inv), *(a.format(tmp=tmp_path) for a in args))
    assert r.code == 2, r.out + r.err
    assert what in r.err and len(r.err.strip().splitlines()) == 1, r.err
