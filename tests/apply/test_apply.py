"""`fleetctl apply`, `status` and `destroy` over real SSH to test hosts whose `vllm` is a shim
that runs `fleetctl emulate` (the emulator stands in for GPUs; everything else is real:
sshd, the node-side scripts, setsid supervision, ports, HTTP health waits, state files)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.sshhosts import TestHosts, require
from tests.conftest import DATA, TESTS

PY = sys.executable
GATE_PY = TESTS / "gate.py"
NAMES = ["a100-1", "rtx-1", "rtx-2"]
GPU = {"a100": ("A100-SXM4-80GB", 2), "rtx": ("RTX-4090", 1)}
SECRET = "hf_test_SECRET_c0ffee"  # must never leave the env file on the node


def shim(gpu: str, extra: str = "", before: str = "", gate: Path | None = None) -> str:
    """The node's `vllm`: forwards `vllm serve ...` to the emulator, 50x faster than life.

    With `gate`, the server does not even listen until the test creates that file: it stays
    "loading" for exactly as long as the test needs, however fast or slow the machine is."""
    wait = f"{PY} {GATE_PY} {gate} -- " if gate is not None else ""
    return (
        "#!/bin/sh\n"
        f"{before}\n"
        '[ "$1" = serve ] && shift\n'
        f"exec {wait}{PY} -m fleetctl emulate --gpu {gpu} --model llama-3-8b --time-scale 50 "
        f'"$@" {extra}\n'
    )


@pytest.fixture(scope="module")
def hosts():
    require()
    with TestHosts(len(NAMES), names=NAMES) as hs:
        yield hs


@pytest.fixture
def fleet(hosts, tmp_path, monkeypatch):
    """Fresh shims, an inventory, and afterwards no server left on any host and every host's
    sshd up again (a test that stops one and fails before it restarts it breaks no other)."""
    for i, name in enumerate(NAMES):
        hosts.install(i, "vllm", shim(GPU[name.split("-")[0]][0]))
    monkeypatch.setenv("HF_TOKEN", SECRET)
    yield Fleet(hosts, tmp_path)
    for i in range(len(hosts)):
        hosts.start(i)  # a no-op for a host whose sshd runs
    leftovers = servers_running(hosts)
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    for h in hosts:
        subprocess.run(["rm", "-rf", str(h.dir / "home" / ".fleetctl")], check=False)
    assert not leftovers, f"the test left servers running: {leftovers}"


class Fleet:
    def __init__(self, hosts: TestHosts, tmp: Path):
        self.hosts, self.tmp = hosts, tmp
        self.inv = self.inventory()

    def inventory(
        self,
        extra: str = "",
        max_context: int = 8192,
        util: float = 0.92,
        sleep: bool = False,
        replicas: int | None = None,
        workload: str = "",
        budget: int | None = None,
    ) -> Path:
        lines = [
            f"ssh: {{user: root, identity_file: {self.hosts.client_key}, connect_timeout_s: 30}}",
            "nodes:",
        ]
        for h in self.hosts:
            gpu, count = GPU[h.name.split("-")[0]]
            lines += [
                f"  - name: {h.name}",
                f"    host: {h.address}",
                f"    gpus: {{type: {gpu}, count: {count}}}",
            ]
        lines += [
            "models:",
            "  - name: llama-3-8b",
            "    profile: llama-3-8b",
            "    variants: {bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}}",
            f"    max_context: {max_context}",
            # At 0.92, four servers (two TP=1 on the A100 pair): the apply tests count on
            # them, and by goodput at its derived SLO the planner alone would make the pair
            # one TP=2 server, as it does at 0.45 (where the replacement tests want that).
            f"    min_replicas: {replicas or (4 if util > 0.5 else 1)}",
            *([f"    workload: {workload}"] if workload else []),
            "    env: {VLLM_LOGGING_LEVEL: INFO}",
            f"planner: {{gpu_memory_utilization: {util}, sleep_mode: {str(sleep).lower()}"
            + (f", max_num_batched_tokens: {budget}}}" if budget else "}"),
            # health_timeout_s only bounds a server that never becomes healthy (a healthy one
            # ends the wait at once): wide, for a loaded machine starting four at once.
            "apply: {health_timeout_s: 60, stop_timeout_s: 5, secrets: [HF_TOKEN]}",
            extra,
        ]
        path = self.tmp / "inventory.yaml"
        path.write_text("\n".join(lines) + "\n")
        return path

    @property
    def gate(self) -> Path:
        """Servers started from `shim(..., gate=fleet.gate)` wait until this file exists."""
        return self.tmp / "gate"

    def open_gate(self) -> None:
        self.gate.touch()

    def args(self, *more: object) -> list[str]:
        return [*map(str, more), "--known-hosts", str(self.hosts.known_hosts)]

    def state(self) -> dict:
        return json.loads((self.tmp / ".fleetctl" / "state.json").read_text())

    def home(self, name: str) -> Path:
        return self.hosts[NAMES.index(name)].dir / "home"

    def manifests(self, name: str) -> list[dict]:
        root = self.home(name) / ".fleetctl" / "servers"
        return [json.loads(p.read_text()) for p in sorted(root.glob("*/manifest.json"))]

    def pid(self, name: str, port: int) -> int:
        root = self.home(name) / ".fleetctl" / "servers"
        return int(next(root.glob(f"{port}-*/pid")).read_text())

    def url(self, name: str, port: int) -> str:
        return f"http://{self.hosts[NAMES.index(name)].address}:{port}"


def servers_running(hosts: TestHosts) -> list[int]:
    """Live processes in the hosts' namespaces that carry a fleetctl server token."""
    out = []
    for pid in hosts._namespace_pids(list(hosts)):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"FLEETCTL_SERVER_TOKEN=" in env and state != "Z":
            out.append(pid)
    return out


def squat(host, port: int) -> subprocess.Popen:
    """Something else listening on a port of a test host, as a stray process would."""
    cmd = ["ip", "netns", "exec", host.namespace, PY, "-m", "http.server", str(port)]
    p = subprocess.Popen(
        [*cmd, "--bind", host.address], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_until(lambda: get(f"http://{host.address}:{port}/")[0] in (200, 404))
    return p


def get(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def wait_until(check, timeout: float = 60) -> None:
    """Wait for a condition; the timeout only stops a test that would hang, it decides nothing."""
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.1)


def outcomes(r) -> list[dict]:
    return json.loads(r.out)["outcomes"]


# --- the normal flow ---------------------------------------------------------------------------


def test_apply_status_reapply_destroy(cli, fleet):
    r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
    assert r.code == 0, r.out + r.err
    done = outcomes(r)
    assert sorted((o["node"], o["gpus"][0], o["action"]) for o in done) == [
        ("a100-1", 0, "start"),
        ("a100-1", 1, "start"),
        ("rtx-1", 0, "start"),
        ("rtx-2", 0, "start"),
    ]
    state = fleet.state()
    assert len(state["deployments"]) == 4 and state["serial"] > 0
    # Each server runs with the planned flags, pinned GPUs and the secret, in its 0600 files.
    for m in fleet.manifests("a100-1"):
        status, body = get(fleet.url("a100-1", m["port"]) + "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "llama-3-8b"
        pid = fleet.pid("a100-1", m["port"])
        env = dict(
            kv.split("=", 1)
            for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
            if "=" in kv
        )
        assert env["CUDA_VISIBLE_DEVICES"] == str(m["gpu_indices"][0])
        assert env["HF_TOKEN"] == SECRET and env["VLLM_LOGGING_LEVEL"] == "INFO"
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        assert "--max-model-len" in cmdline and "8192" in cmdline
        folder = fleet.home("a100-1") / ".fleetctl" / "servers" / m["sid"]
        assert (folder / "env").stat().st_mode & 0o777 == 0o600
    # The secret is nowhere but the node's env file and the server's environment.
    seen = r.out + r.err + json.dumps(state)
    for h in NAMES:
        for m in fleet.manifests(h):
            seen += json.dumps(m)
            seen += (fleet.home(h) / ".fleetctl" / "servers" / m["sid"] / "log").read_text()
            pid = fleet.pid(h, m["port"])
            seen += Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    assert SECRET not in seen

    pids = {(h, m["port"]): fleet.pid(h, m["port"]) for h in NAMES for m in fleet.manifests(h)}
    # A probe names the servers' processes, so `health` tells them from foreign GPU users.
    r = cli("probe", *fleet.args(fleet.inv, "--json"))
    probed = json.loads(r.out)["nodes"]
    for (h, _), pid in pids.items():
        assert pid in probed[h]["fleetctl_pids"]
    r = cli("status", *fleet.args(fleet.inv, "--json"))
    assert r.code == 0, r.out
    assert {s["condition"] for s in json.loads(r.out)["servers"]} == {"running"}

    # A second apply changes nothing: every server kept, no process restarted.
    r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
    assert r.code == 0 and {o["action"] for o in outcomes(r)} == {"keep"}
    assert pids == {
        (h, m["port"]): fleet.pid(h, m["port"]) for h in NAMES for m in fleet.manifests(h)
    }

    r = cli("destroy", *fleet.args(fleet.inv, "--yes", "--json"))
    assert r.code == 0, r.out
    assert servers_running(fleet.hosts) == []
    assert not any((fleet.home(h) / ".fleetctl").exists() for h in NAMES)
    assert fleet.state()["deployments"] == []


def test_confirmation_is_required_without_yes(cli, fleet):
    r = cli("apply", *fleet.args(fleet.inv))  # stdin is not a terminal under pytest
    assert r.code == 2 and "pass --yes" in r.err
    assert not (fleet.tmp / ".fleetctl" / "state.json").exists()


def test_missing_secret_is_a_clear_error(cli, fleet, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    r = cli("apply", *fleet.args(fleet.inv, "--yes"))
    assert r.code == 2
    assert "apply.secrets: the secret HF_TOKEN has no value" in r.err
    # A secrets file works instead, but only when no one else can read it.
    f = fleet.tmp / "secrets.env"
    f.write_text(f"HF_TOKEN={SECRET}\n")
    f.chmod(0o644)
    r = cli("apply", *fleet.args(fleet.inv, "--yes", "--secrets-file", f))
    assert r.code == 2 and f"chmod 600 {f}" in r.err


# --- plans saved to a file ---------------------------------------------------------------------


def test_saved_plan_applies_exactly_and_goes_stale(cli, fleet):
    plan = fleet.tmp / "plan.json"
    assert cli("plan", fleet.inv, "-o", plan).code == 0
    r = cli("apply", *fleet.args(plan, "--yes", "--json"))
    assert r.code == 0, r.out + r.err
    assert len(fleet.state()["deployments"]) == 4
    # The state has moved on since the plan was made: refused, nothing touched.
    r = cli("apply", *fleet.args(plan, "--yes"))
    assert r.code == 2 and "the state changed since this plan was made" in r.err
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


def test_route_serve_judges_by_the_slo_the_applied_plan_printed(cli, fleet):
    """The SLO `plan` prints is the one route-serve counts attainment by once that plan is
    applied: `apply` keeps it in state.json, also where a new plan (from a trace: its p99
    prompt) changes the SLO and no server; route-serve, started from the state, exports and
    logs it (before, route-serve derived one of its own from the inventory, with no
    workload: 4x a 1,000-token default prompt)."""
    from harness.procs import Proc, free_port
    from harness.ready import http_request, wait_status

    first = json.loads(cli("plan", fleet.inv, "--json").out)["slo"]["llama-3-8b"]
    r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
    router = None
    try:
        assert r.code == 0, r.out + r.err
        assert fleet.state()["slo"] == {"llama-3-8b": first}
        trace = DATA / "azure_conv_slice.csv"
        plan = fleet.tmp / "plan.json"
        r = cli("plan", fleet.inv, "--workload-from", trace, "--json", "-o", plan)
        assert r.code == 0, r.err
        assert {a["op"] for a in json.loads(r.out)["actions"]} == {"keep"}
        planned = json.loads(r.out)["slo"]["llama-3-8b"]
        assert "prefill of 4,088 tokens" in planned["basis"] and planned != first
        text = cli("plan", fleet.inv, "--workload-from", trace).out
        said = f"TTFT <= {planned['ttft_p99_s']:g} s and TPOT <= {planned['tpot_p99_ms']:g} ms"
        assert f"SLO of llama-3-8b: 99% within {said} (derived: " in text
        r = cli("apply", *fleet.args(plan, "--yes", "--json"))
        assert r.code == 0, r.out + r.err
        assert fleet.state()["slo"] == {"llama-3-8b": planned}
        port = free_port()
        cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(fleet.inv)]
        cmd += ["--listen", f"127.0.0.1:{port}"]
        router = Proc("router", cmd, fleet.tmp, own_group=False)
        wait_status(port, "/metrics", router)
        metrics = http_request(port, "GET", "/metrics")[2].decode()
        seconds = {}
        for labels, value in re.findall(
            r"fleetctl_slo_objective_seconds\{([^}]*)\} (\S+)", metrics
        ):
            tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if tags["model"] == "llama-3-8b":
                seconds[tags["objective"], tags["source"]] = float(value)
        assert seconds == {
            ("ttft_p99", "planned"): planned["ttft_p99_s"],
            ("tpot_p99", "planned"): planned["tpot_p99_ms"] / 1000,
        }, metrics
        line = f"SLO of llama-3-8b: 99% within {said} (derived, as the applied plan"
        assert line in router.tail(50)
    finally:
        if router is not None:
            router.stop()
        assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


# --- replacements ------------------------------------------------------------------------------


@pytest.mark.parametrize("util", [0.45, 0.92])
def test_replace_start_before_stop_when_both_fit(cli, fleet, util):
    fleet.inventory(util=util)
    assert cli("apply", *fleet.args(fleet.inv, "--yes")).code == 0
    old_pid = fleet.pid("a100-1", 8000)
    fleet.inventory(util=util, max_context=4096)
    r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
    assert r.code == 0, r.out + r.err
    a100 = [o for o in outcomes(r) if o["node"] == "a100-1"]
    assert a100 and {o["action"] for o in a100} == {"replace"}, json.dumps(outcomes(r))
    if util == 0.45:  # two servers of 45% fit on the same GPUs: the new one starts first
        assert [(o["gpus"], o["port"]) for o in a100] == [([0, 1], 9000)]  # one TP=2 server
        assert a100[0]["detail"].startswith("start before stop")
    else:
        assert [(o["gpus"], o["port"]) for o in a100] == [([0], 8000), ([1], 8001)]
        assert all(
            o["detail"].startswith("stop then start: the new server needs the old one's GPU memory")
            for o in a100
        )
    manifests = fleet.manifests("a100-1")
    assert sorted(m["port"] for m in manifests) == sorted(o["port"] for o in a100)
    assert all("4096" in m["argv"] for m in manifests)
    assert not _alive(old_pid)  # the old server is gone
    # The next plan keeps the slot where it now runs: nothing to do.
    r = cli("plan", fleet.inv, "--json")
    assert {a["op"] for a in json.loads(r.out)["actions"]} == {"keep"}
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


@pytest.mark.parametrize("util", [0.45, 0.92])
def test_the_old_server_serves_while_its_replacement_loads_only_when_both_fit(cli, fleet, util):
    """While the new server loads (held at the gate), the old one still runs where both fit
    in GPU memory (start before stop: 0.45 + 0.45), and is already stopped where they do not
    (0.92 + 0.92: stop first). The test above sees only each outcome's words: it passed with
    every old server stopped first."""
    fleet.inventory(util=util)
    assert cli("apply", *fleet.args(fleet.inv, "--yes")).code == 0
    old_pid = fleet.pid("a100-1", 8000)
    fleet.hosts.install(NAMES.index("a100-1"), "vllm", shim(GPU["a100"][0], gate=fleet.gate))
    fleet.inventory(util=util, max_context=4096)
    p = _apply_process(fleet)
    try:
        lines = _read_until(p, "a100-1: replace: ")
        assert "a100-1: replace: " in lines[-1], "".join(lines)
        assert _alive(old_pid) == (util == 0.45), "".join(lines)
        fleet.open_gate()
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, "".join(lines) + out
    finally:
        _stop(p)
    assert not _alive(old_pid)
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


def test_failed_replacement_keeps_the_old_server_when_it_started_first(cli, fleet):
    fleet.inventory(util=0.45)
    assert cli("apply", *fleet.args(fleet.inv, "--yes")).code == 0
    old_pid = fleet.pid("a100-1", 8000)
    fleet.hosts.install(
        NAMES.index("a100-1"),
        "vllm",
        "#!/bin/sh\necho 'RuntimeError: CUDA out of memory' >&2\nexit 1\n",
    )
    fleet.inventory(util=0.45, max_context=4096)
    r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
    assert r.code == 1
    failed = [o for o in outcomes(r) if o["status"] == "failed"]
    assert [(o["node"], o["gpus"], o["port"]) for o in failed] == [("a100-1", [0, 1], 9000)]
    assert all("CUDA out of memory" in o["log_tail"] for o in failed)
    assert _alive(old_pid)  # still serving
    kept = [d for d in fleet.state()["deployments"] if d["node"] == "a100-1"]
    assert [(d["port"], d["max_model_len"]) for d in kept] == [(8000, 8192)]
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


# --- faults ------------------------------------------------------------------------------------


def test_faults_are_per_server_and_the_rest_go_on(cli, fleet):
    # rtx-1's vLLM fails to start; a100-1's GPU 0 port is taken by something else (the first
    # of its two servers: the second must still start); rtx-2 is slow.
    fleet.hosts.install(
        NAMES.index("rtx-1"),
        "vllm",
        "#!/bin/sh\necho 'loading weights...'\necho 'torch.OutOfMemoryError: CUDA out of memory' >&2\nexit 1\n",
    )
    fleet.hosts.install(NAMES.index("rtx-2"), "vllm", shim("RTX-4090", "--startup-delay 3"))
    a100 = fleet.hosts[NAMES.index("a100-1")]
    squatter = squat(a100, 8000)
    try:
        r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
        assert r.code == 1
        by = {(o["node"], o["gpus"][0]): o for o in outcomes(r)}
        assert by[("rtx-1", 0)]["status"] == "failed"
        assert "exited before it was healthy" in by[("rtx-1", 0)]["detail"]
        assert "CUDA out of memory" in by[("rtx-1", 0)]["log_tail"]
        assert by[("a100-1", 0)]["status"] == "failed"
        assert re.search(
            r"port-taken: port 8000 is already taken by: \d+ .*http\.server",
            by[("a100-1", 0)]["detail"],
        )
        assert by[("a100-1", 1)]["status"] == "ok" and by[("rtx-2", 0)]["status"] == "ok"
        recorded = {(d["node"], d["gpu_indices"][0]) for d in fleet.state()["deployments"]}
        assert recorded == {("a100-1", 1), ("rtx-2", 0)}
        assert fleet.manifests("rtx-1") == []  # the failed server left nothing running
    finally:
        squatter.kill()
        squatter.wait()
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


def test_slow_server_times_out_with_its_log(cli, fleet):
    marker = "echo 'test-shim: loading weights for a long time' >&2"
    fleet.hosts.install(
        NAMES.index("rtx-2"), "vllm", shim("RTX-4090", "--startup-delay 60", before=marker)
    )
    inv = fleet.inv
    # The emulator must be listening (and answering 503) before the timeout ends: it takes
    # about 1 s to start on a loaded 2-core machine, so 10 s leaves a wide margin.
    inv.write_text(inv.read_text().replace("health_timeout_s: 60", "health_timeout_s: 10"))
    r = cli("apply", *fleet.args(inv, "--yes"))
    assert r.code == 1
    assert re.search(
        r"failed rtx-2 llama-3-8b GPUs 0: not healthy after 10 s \(last: /health answered 503\)",
        r.out,
    )
    assert "    test-shim: loading weights for a long time" in r.out  # the log's tail
    assert fleet.manifests("rtx-2") == []
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


def test_drift_is_seen_by_status_and_fixed_by_apply(cli, fleet):
    fleet.hosts.install(NAMES.index("rtx-2"), "vllm", shim("RTX-4090", "--crash-after 1"))
    assert cli("apply", *fleet.args(fleet.inv, "--yes")).code == 0
    # rtx-1: killed; rtx-2: dies after serving a request; a100-1 GPU 1: restarted by hand.
    os.kill(fleet.pid("rtx-1", 8000), signal.SIGKILL)
    import urllib.request

    body = json.dumps({"model": "llama-3-8b", "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(
        fleet.url("rtx-2", 8000) + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    urllib.request.urlopen(req, timeout=10).read()
    a100 = fleet.hosts[NAMES.index("a100-1")]
    pid = fleet.pid("a100-1", 8001)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: get(fleet.url("a100-1", 8001) + "/health")[0] == 0 or not _alive(pid))
    argv[argv.index("--max-model-len") + 1] = "2048"
    by_hand = subprocess.Popen(
        ["ip", "netns", "exec", a100.namespace, *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: get(fleet.url("a100-1", 8001) + "/health")[0] == 200)
        wait_until(lambda: not _alive(fleet.pid("rtx-2", 8000)))
        r = cli("status", *fleet.args(fleet.inv, "--json"))
        assert r.code == 1
        cond = {(s["node"], s["gpus"][0]): s for s in json.loads(r.out)["servers"]}
        assert cond[("rtx-1", 0)]["condition"] == "dead"
        assert cond[("rtx-2", 0)]["condition"] == "dead"
        assert cond[("a100-1", 0)]["condition"] == "running"
        assert cond[("a100-1", 1)]["condition"] == "restarted-by-hand"
        assert "--max-model-len 8192 -> 2048" in cond[("a100-1", 1)]["detail"]
        # apply restarts the dead ones; the hand-started server keeps its port: named, not killed.
        r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
        assert r.code == 1
        by = {(o["node"], o["gpus"][0]): o for o in outcomes(r)}
        assert by[("rtx-1", 0)]["action"] == "restart" and by[("rtx-1", 0)]["status"] == "ok"
        assert by[("rtx-2", 0)]["action"] == "restart" and by[("rtx-2", 0)]["status"] == "ok"
        assert (
            by[("a100-1", 1)]["status"] == "failed" and "port-taken" in by[("a100-1", 1)]["detail"]
        )
        assert by_hand.poll() is None
    finally:
        by_hand.kill()
        by_hand.wait()
    # With the port free again, apply converges.
    r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
    assert r.code == 0, r.out
    assert cli("status", *fleet.args(fleet.inv)).code == 0
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# --- interruptions and concurrency -------------------------------------------------------------


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _apply_process(fleet: Fleet, *more: str) -> subprocess.Popen:
    # A shell without job control starts background jobs (`pytest ... &`, nohup, CI runners)
    # with SIGINT ignored, and Python then keeps ignoring it: Ctrl-C must reach this apply.
    return subprocess.Popen(
        [PY, "-m", "fleetctl", "apply", *fleet.args(fleet.inv, "--yes", *more)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        preexec_fn=_default_sigint,
    )


def _read_until(p: subprocess.Popen, marker: str, count: int = 1) -> list[str]:
    """apply's output lines up to the `count`-th that holds `marker` (or to its end)."""
    assert p.stdout is not None
    lines, seen = [], 0
    for line in p.stdout:
        lines.append(line)
        seen += marker in line
        if seen == count:
            break
    return lines


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait()


def _gated_fleet(fleet: Fleet) -> None:
    """Every server started from now on waits at the gate before it even listens."""
    for i, name in enumerate(NAMES):
        fleet.hosts.install(i, "vllm", shim(GPU[name.split("-")[0]][0], gate=fleet.gate))


def test_apply_killed_midway_then_rerun_converges(cli, fleet):
    # Servers that cannot become healthy until the test says so: the apply is surely killed
    # after starting them and before recording them, the worst moment.
    _gated_fleet(fleet)
    p = _apply_process(fleet)
    try:
        started = _read_until(p, ": start: ", 4)
        assert sum(": start: " in line for line in started) == 4, "".join(started)
        p.send_signal(signal.SIGKILL)
    finally:
        _stop(p)
    state_file = fleet.tmp / ".fleetctl" / "state.json"
    recorded = json.loads(state_file.read_text())["deployments"] if state_file.exists() else []
    assert recorded == []  # killed before it recorded any (none could be healthy)
    wait_until(lambda: len(servers_running(fleet.hosts)) == 4)
    pids = sorted(servers_running(fleet.hosts))
    fleet.open_gate()
    r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
    assert r.code == 0, r.out
    assert [o["action"] for o in outcomes(r)] == ["adopt"] * 4
    assert len(fleet.state()["deployments"]) == 4
    assert sorted(servers_running(fleet.hosts)) == pids  # adopted, not started twice
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


def test_two_applies_at_once_and_a_stale_lock(cli, fleet):
    # rtx-1's server waits at the gate, so the first apply surely holds the lock meanwhile.
    fleet.hosts.install(NAMES.index("rtx-1"), "vllm", shim("RTX-4090", gate=fleet.gate))
    first = _apply_process(fleet)
    try:
        lock = fleet.tmp / ".fleetctl" / "state.lock"
        started = _read_until(first, "rtx-1: start: ")
        assert "rtx-1: start: " in started[-1], "".join(started)
        holder = json.loads(lock.read_text())
        r = cli("apply", *fleet.args(fleet.inv, "--yes"))
        assert r.code == 1
        assert f"`fleetctl apply` (pid {first.pid} on" in r.err and "holds the state lock" in r.err
        fleet.open_gate()
        out, _ = first.communicate(timeout=120)
        assert first.returncode == 0, "".join(started) + out
    finally:
        _stop(first)
    assert holder["pid"] == first.pid
    # A holder that died without releasing the lock: taken over, with a warning.
    lock.write_text(json.dumps({**holder, "pid": 999999}))
    r = cli("apply", *fleet.args(fleet.inv, "--yes"))
    assert r.code == 0, r.out + r.err
    assert "took over a stale state lock: `fleetctl apply` (pid 999999" in r.out
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


def test_unreachable_node_fails_alone_and_keeps_its_record(cli, fleet):
    assert cli("apply", *fleet.args(fleet.inv, "--yes")).code == 0
    before = [d for d in fleet.state()["deployments"] if d["node"] == "rtx-2"]
    fleet.inventory(max_context=4096)  # every server must be replaced
    i = NAMES.index("rtx-2")
    fleet.hosts.stop(i)
    try:
        r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
        assert r.code == 1
        by = {o["node"]: o for o in outcomes(r)}
        assert by["rtx-2"]["status"] == "failed" and by["rtx-2"]["detail"].startswith("unreachable")
        assert by["rtx-1"]["status"] == "ok" and by["rtx-1"]["action"] == "replace"
        # What runs on the node it could not reach is still what state says.
        assert [d for d in fleet.state()["deployments"] if d["node"] == "rtx-2"] == before
        r = cli("destroy", *fleet.args(fleet.inv, "--yes", "--json"))
        assert r.code == 1 and [d["node"] for d in fleet.state()["deployments"]] == ["rtx-2"]
    finally:
        fleet.hosts.start(i)
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0
    assert fleet.state()["deployments"] == []


# Bound on how long apply may take to return after Ctrl-C. The servers wait at the gate, so
# an apply that kept waiting for them would only return at its health timeout (60 s).
INTERRUPT_BOUND_S = 15


def test_ctrl_c_stops_waiting_at_once_and_rerun_adopts(cli, fleet):
    _gated_fleet(fleet)  # no server can become healthy before the interrupt, however slow
    p = _apply_process(fleet)
    try:
        started = _read_until(p, ": start: ", 4)
        assert sum(": start: " in line for line in started) == 4, "".join(started)
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        p.wait(timeout=60)
        waited = time.monotonic() - t0
        assert p.stdout is not None
        rest = p.stdout.read()  # what the loop above had not read yet
    finally:
        _stop(p)
    assert p.returncode == 130, rest
    assert waited < INTERRUPT_BOUND_S, rest  # not held until the health timeout
    assert "interrupted: servers that were starting keep running" in rest
    assert "healthy: " not in rest
    state_file = fleet.tmp / ".fleetctl" / "state.json"
    recorded = json.loads(state_file.read_text())["deployments"] if state_file.exists() else []
    assert recorded == []  # left running, unrecorded
    wait_until(lambda: len(servers_running(fleet.hosts)) == 4)
    fleet.open_gate()
    r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
    assert r.code == 0, r.out
    assert [o["action"] for o in outcomes(r)] == ["adopt"] * 4
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


# Moments at which an apply is SIGKILLed, each with the plan it carries out (8192 tokens: the
# first servers; 4096: every server replaced). Each moment is an event in apply's own output,
# not a delay, so each run of the test kills at the same points of the protocol.
# Each marker surely comes: the servers the one before left running need stopping, starting
# or adopting under the other plan.
KILL_MOMENTS = [
    (8192, ": start: ", 1),  # one server started, none healthy or recorded
    (4096, "stopping ", 1),  # replacing: an old server stopped first, its record dropped
    (8192, "healthy: ", 1),  # back again: one server healthy, not recorded yet
    (4096, "healthy: ", 1),  # replacing again: the same moment, from the other side
]


def test_killed_at_several_moments_then_one_apply_converges(cli, fleet):
    """SIGKILL the apply at different moments, alternating between two plans (create, then
    replace every server): one more apply always ends with exactly the plan running."""
    for i, name in enumerate(NAMES):
        fleet.hosts.install(i, "vllm", shim(GPU[name.split("-")[0]][0], "--startup-delay 2"))
    for max_context, marker, count in KILL_MOMENTS:
        fleet.inventory(max_context=max_context)
        p = _apply_process(fleet)
        try:
            lines = _read_until(p, marker, count)
            assert sum(marker in line for line in lines) == count, "".join(lines)
        finally:
            _stop(p)
    r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
    assert r.code == 0, r.out + r.err
    state = fleet.state()["deployments"]
    assert all(d["max_model_len"] == 4096 for d in state)
    live = {(h, m["port"]) for h in NAMES for m in fleet.manifests(h)}
    assert live == {(d["node"], d["port"]) for d in state}  # nothing extra, nothing missing
    assert len(servers_running(fleet.hosts)) == len(state)
    assert cli("status", *fleet.args(fleet.inv)).code == 0
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


def test_replacement_refused_its_port_keeps_the_old_server(cli, fleet):
    fleet.inventory(util=0.45)
    assert cli("apply", *fleet.args(fleet.inv, "--yes")).code == 0
    old_pid = fleet.pid("a100-1", 8000)
    a100 = fleet.hosts[NAMES.index("a100-1")]
    squatter = squat(a100, 9000)
    try:
        fleet.inventory(util=0.45, max_context=4096)
        r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
        assert r.code == 1
        [o] = [o for o in outcomes(r) if o["node"] == "a100-1"]
        assert o["status"] == "failed" and o["detail"].startswith("port-taken: port 9000")
        assert _alive(old_pid)  # the surge port was taken: the old server goes on
        kept = [d for d in fleet.state()["deployments"] if d["node"] == "a100-1"]
        assert [(d["port"], d["max_model_len"]) for d in kept] == [(8000, 8192)]
    finally:
        squatter.kill()
        squatter.wait()
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


# --- warm-up: start-ups timed and kept ----------------------------------------------------------

STARTUP_LOG = DATA / "vllm-0.32.0-cpu-startup.log"


def test_apply_times_each_start_up_and_keeps_it_in_the_calibration(cli, fleet):
    # Each server prints a real vLLM start-up log (captured from vLLM 0.32.0, tests/data) and
    # then waits at the gate: it is "loading" until the test opens it, HOLD_S after all four
    # were started. apply must measure at least that, per server, and read the log's phases.
    hold_s = 1.5
    for i, name in enumerate(NAMES):
        gpu = GPU[name.split("-")[0]][0]
        fleet.hosts.install(i, "vllm", shim(gpu, before=f"cat {STARTUP_LOG}", gate=fleet.gate))
    import threading

    result: list = []
    t = threading.Thread(
        target=lambda: result.append(cli("apply", *fleet.args(fleet.inv, "--yes", "--json")))
    )
    t.start()
    try:
        wait_until(lambda: len(servers_running(fleet.hosts)) == 4)
        time.sleep(hold_s)  # the start-up being measured, not a wait for something to happen
    finally:
        fleet.open_gate()
        t.join()
    (r,) = result
    assert r.code == 0, r.out + r.err
    # Before it ran, nothing was measured: its own disruption was an estimate.
    before = json.loads(r.out)["disruption"]
    assert before["servers_started"] == 4 and before["capacity_missing_server_minutes"] == 0
    assert all(s["warmup_source"].startswith("estimate: ") for s in before["servers"])
    done = outcomes(r)
    assert len(done) == 4 and all(o["startup_s"] >= hold_s for o in done), done
    phases = {"model_init_s": 1.304817, "weights_s": 0.27, "engine_init_s": 0.94}
    assert all(o["phases"] == phases for o in done)
    cal = json.loads((fleet.tmp / ".fleetctl" / "calibration.json").read_text())
    startups = {(s["key"]["gpu"], s["key"]["tp"]): s for s in cal["startups"]}
    assert sorted(startups) == [("A100-SXM4-80GB", 1), ("RTX-4090", 1)]
    assert len(startups[("A100-SXM4-80GB", 1)]["seconds"]) == 2  # a100-1's two servers
    assert sorted(startups[("RTX-4090", 1)]["servers"]) == sorted(
        f"{n}:8000" for n in ("rtx-1", "rtx-2")
    )
    # The next plan's disruption uses them: a shorter context replaces every server, and at
    # 92% of GPU memory each old server stops first, its slot empty while the new one warms.
    fleet.inventory(max_context=4096)
    r = cli("plan", fleet.inv, "--json")
    d = json.loads(r.out)["disruption"]
    assert d["servers_started"] == 4 and d["servers_stopped"] == 4
    assert all(s["warmup_source"].startswith("measured by apply over") for s in d["servers"])
    assert d["capacity_missing_server_minutes"] == d["warmup_server_minutes"] > 0
    r = cli("plan", fleet.inv)
    assert "Disruption: 4 servers start" in r.out and "4 replacements stop the old" in r.out
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


# --- the autopilot's sleepers ------------------------------------------------------------------


def _put_to_sleep(fleet: Fleet, node: str) -> int:
    """Sleep `node`'s server as the autopilot does: `POST /sleep`, then state.json lists it
    asleep. Its port."""
    import dataclasses
    import urllib.request

    from fleetctl.fleet.state import Sleeper
    from fleetctl.fleet.statedir import StateDir

    sdir = StateDir(fleet.tmp / ".fleetctl")
    state = sdir.load_state()
    [d] = [d for d in state.deployments if d.node == node]
    req = urllib.request.Request(fleet.url(node, d.port) + "/sleep?level=1", b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
    awake = tuple(x for x in state.deployments if x is not d)
    sdir.save_state(dataclasses.replace(state, deployments=awake, asleep=(Sleeper(d, 1),)))
    return d.port


def _sleeping(fleet: Fleet, node: str, port: int) -> bool:
    status, body = get(fleet.url(node, port) + "/is_sleeping")
    assert status == 200, body
    return bool(json.loads(body)["is_sleeping"])


def test_apply_wakes_a_sleeper_it_wants_and_stops_one_whose_gpus_it_gives_away(cli, fleet):
    """A server the autopilot put to sleep is the plan's business too: a plan that wants it
    wakes it (the same process, no cold start) and records it awake; a plan that gives its
    GPUs to another server stops it first and drops it from state.json's sleepers."""
    inv = fleet.inventory(sleep=True)
    r = cli("apply", *fleet.args(inv, "--yes", "--json"))
    assert r.code == 0, r.out + r.err
    port = _put_to_sleep(fleet, "rtx-1")
    pid = fleet.pid("rtx-1", port)

    r = cli("apply", *fleet.args(inv, "--yes", "--json"))
    assert r.code == 0, r.out + r.err
    assert not _sleeping(fleet, "rtx-1", port)
    assert fleet.pid("rtx-1", port) == pid  # woken, not started again
    state = fleet.state()
    assert len(state["deployments"]) == 4 and "asleep" not in state
    assert ("rtx-1", "start") not in {(o["node"], o["action"]) for o in outcomes(r)}

    port = _put_to_sleep(fleet, "rtx-1")
    r = cli("apply", *fleet.args(fleet.inventory(max_context=4096, sleep=True), "--yes", "--json"))
    assert r.code == 0, r.out + r.err
    stops = [o for o in outcomes(r) if o["node"] == "rtx-1" and o["action"] == "stop"]
    assert stops and "asleep" in stops[0]["detail"], outcomes(r)
    state = fleet.state()
    assert len(state["deployments"]) == 4 and "asleep" not in state
    assert fleet.pid("rtx-1", port) != pid
    assert not _sleeping(fleet, "rtx-1", port)
    cli("destroy", *fleet.args(inv, "--yes"))


def test_the_autopilot_stops_and_starts_servers_through_apply(cli, fleet):
    """Live, with servers started without sleep mode: a quiet interval stops the servers the
    forecast does not need, through apply's code over SSH (state.json and the nodes agree),
    and a busy one starts a bigger server cold, the small one stopping once it is healthy."""
    from harness.procs import Proc, free_port
    from harness.ready import http_request, wait_status

    work = "{requests_per_s: 0.3, mean_prompt_tokens: 2000, mean_output_tokens: 1000}"
    # vLLM's step budget pinned: the planner's own choice moves with the calibration that
    # apply refreshes from the emulators, and this test is about apply's stops and starts.
    inv = fleet.inventory(replicas=1, workload=work, budget=2048)
    r = cli("apply", *fleet.args(inv, "--yes", "--json"))
    assert r.code == 0, r.out + r.err
    assert len(fleet.state()["deployments"]) == 3  # the A100 pair as one server, each RTX
    sdir = fleet.tmp / ".fleetctl"
    port = free_port()
    cmd = [PY, "-m", "fleetctl", "route-serve", str(inv), "--listen", f"127.0.0.1:{port}"]
    router = Proc("route-serve", cmd, fleet.tmp, own_group=False)
    try:
        wait_status(port, "/health", router, 200)
        audit = fleet.tmp / "audit.jsonl"

        def autopilot() -> dict:
            before = len(audit.read_text().splitlines()) if audit.exists() else 0
            cmd = [PY, "-m", "fleetctl", "autopilot", str(inv), "--once", "--interval", "30"]
            cmd += ["--router", f"http://127.0.0.1:{port}", "--down-after", "1"]
            cmd += ["--audit-log", str(audit), "--known-hosts", str(fleet.hosts.known_hosts)]
            run = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert run.returncode == 0, run.stdout + run.stderr
            lines = audit.read_text().splitlines()
            assert len(lines) == before + 1
            return json.loads(lines[-1])

        quiet = autopilot()
        results = {(c["kind"], c["server"], c["result"]) for c in quiet["carried_out"]}
        assert results == {("stop", "a100-1:8000", "done"), ("stop", "rtx-2:8000", "done")}, quiet
        state = fleet.state()
        assert [(d["node"], d["port"]) for d in state["deployments"]] == [("rtx-1", 8000)]
        assert len(servers_running(fleet.hosts)) == 1

        body = {"model": "llama-3-8b", "prompt": "hello there", "max_tokens": 4}
        for _ in range(24):
            assert http_request(port, "POST", "/v1/completions", body, None, 60)[0] == 200
        logs = sdir / "requests"
        wait_until(lambda: sum(len(p.read_text().splitlines()) for p in logs.glob("*.jsonl")) >= 24)
        busy = autopilot()
        kinds = [(c["kind"], c["result"]) for c in busy["carried_out"]]
        assert ("start", "done") in kinds and ("stop", "done") in kinds, busy
        state = fleet.state()
        assert [(d["node"], d["gpu_indices"]) for d in state["deployments"]] == [("a100-1", [0])]
        assert len(servers_running(fleet.hosts)) == 1
    finally:
        router.stop()
        cli("destroy", *fleet.args(inv, "--yes"))
