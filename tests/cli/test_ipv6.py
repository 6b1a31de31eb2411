"""IPv6 end to end: a node whose host is an IPv6 address goes through plan, apply, route-serve,
health, status and destroy, each a real `python -m fleetctl` process.

The node is a real sshd in a network namespace with fd00:f1ee:0:x::N on its veth (reached over
IPv6 only: the inventory names no IPv4 address), and its `vllm` is the emulator, as in
test_apply.py. Every place that writes host:port (SSH target, server URLs, the router's
backends) must bracket the address, or one of these steps fails.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.sshhosts import TestHosts, require
from tests.apply.test_apply import get, servers_running, shim, wait_until
from tests.conftest import REPO
from tests.fleet.test_probe import RTX_QUERY, fake_smi
from tests.procs import free_port, http_request, stop_process

NODE = "rtx-v6"
MODEL = "llama-3-8b"


@pytest.fixture(scope="module")
def hosts():
    require()
    with TestHosts(1, names=[NODE], ipv6=True) as hs:
        hs.install(0, "vllm", shim("RTX-4090"))
        hs.install(
            0,
            "nvidia-smi",
            fake_smi(
                RTX_QUERY.format(driver="580.65.06"),
                "smi-rtx4090-x1-driver580.txt",
                "topo-rtx4090-x8-sys-tabs.txt",
            ),
        )
        yield hs


def fleetctl(*args: object, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "fleetctl", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def inventory(tmp: Path, hosts: TestHosts, host: str | None = None) -> Path:
    path = tmp / "inventory.yaml"
    path.write_text(
        f"ssh: {{user: root, identity_file: {hosts.client_key}, connect_timeout_s: 30, "
        f"port: {hosts.port}}}\n"
        "nodes:\n"
        f"  - {{name: {NODE}, host: '{host or hosts[0].address6}', "
        "gpus: {type: RTX-4090, count: 1}}\n"
        "models:\n"
        f"  - name: {MODEL}\n"
        f"    profile: {MODEL}\n"
        "    variants: {bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}}\n"
        "    max_context: 8192\n"
        "apply: {health_timeout_s: 60, stop_timeout_s: 5}\n"
    )
    return path


def test_the_helpers_bracket_ipv6_only():
    from fleetctl.base.names import host_port, http_url

    assert host_port("fd00::11", 22) == "[fd00::11]:22"
    assert host_port("10.0.1.11", 22) == "10.0.1.11:22"
    assert host_port("gpu-1.example.internal", 2222) == "gpu-1.example.internal:2222"
    assert http_url("fd00::11", 8000, "/health") == "http://[fd00::11]:8000/health"


def test_the_test_host_answers_ssh_over_ipv6(hosts):
    h = hosts[0]
    r = subprocess.run(
        hosts.ssh_argv(0, "hostname", address=h.address6),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (r.returncode, r.stdout) == (0, f"{NODE}\n"), r.stderr


def test_plan_apply_route_serve_health_status_destroy_over_ipv6(hosts, tmp_path):
    h = hosts[0]
    inv = inventory(tmp_path, hosts)
    known = ("--known-hosts", hosts.known_hosts)

    r = fleetctl("plan", inv, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    [planned] = json.loads(r.stdout)["deployments"]
    assert (planned["node"], planned["host"]) == (NODE, h.address6)
    assert planned["vllm_args"][planned["vllm_args"].index("--host") + 1] == h.address6

    r = fleetctl("apply", inv, "--yes", "--json", *known)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        [done] = json.loads(r.stdout)["outcomes"]
        assert (done["node"], done["action"], done["status"]) == (NODE, "start", "ok"), done
        [d] = json.loads((tmp_path / ".fleetctl" / "state.json").read_text())["deployments"]
        # The server listens on the node's IPv6 address, and only there.
        url = f"http://[{h.address6}]:{d['port']}"
        assert get(url + "/health")[0] == 200
        assert get(f"http://{h.address}:{d['port']}/health")[0] == 0  # refused on its IPv4
        assert servers_running(hosts)

        # route-serve reads the applied state and sends a completion to [fd00:...]:port.
        port = free_port()
        log = tmp_path / "router.log"
        cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv)]
        with log.open("w") as out:
            router = subprocess.Popen(
                [*cmd, "--listen", f"127.0.0.1:{port}"],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        try:

            def listening() -> bool:
                assert router.poll() is None, log.read_text()
                try:
                    return http_request(port, "GET", "/health", timeout=2)[0] == 200
                except OSError:
                    return False

            wait_until(listening)
            body = {"model": MODEL, "prompt": "hello " * 20, "max_tokens": 8}
            status, headers, answer = http_request(port, "POST", "/v1/completions", body)
            assert status == 200, (answer, log.read_text())
            assert headers["X-Fleet-Backend"] == NODE
            assert json.loads(answer)["choices"][0]["text"]

            def scraped() -> bool:  # the router's /metrics scrapes reach [fd00:...]:port too
                text = http_request(port, "GET", "/metrics")[2].decode()
                return any(
                    s.name == "fleetctl_backend_metrics_age_seconds" and math.isfinite(s.value)
                    for f in text_string_to_metric_families(text)
                    for s in f.samples
                )

            wait_until(scraped)
        finally:
            stop_process(router)

        # health probes the node over SSH and asks the server over HTTP, both over IPv6.
        r = fleetctl("health", inv, "--json", *known)
        assert r.returncode == 0, r.stdout + r.stderr
        checks = json.loads(r.stdout)["checks"]
        by = {(c["check"], c["node"]): c for c in checks}
        assert by[("reachable", NODE)]["status"] == "ok", checks
        server = by[("server", NODE)]
        assert server["status"] == "ok" and url in server["detail"], server

        r = fleetctl("status", inv, "--json", *known)
        assert r.returncode == 0, r.stdout + r.stderr
        assert [s["condition"] for s in json.loads(r.stdout)["servers"]] == ["running"]
    finally:
        r = fleetctl("destroy", inv, "--yes", "--json", *known)
        left = servers_running(hosts)
        subprocess.run(["rm", "-rf", str(h.dir / "home" / ".fleetctl")], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert left == []


def test_an_unreachable_ipv6_node_is_named_with_brackets(hosts, tmp_path):
    """The operator's line names the node's SSH address as [addr]:port."""
    h = hosts[0]
    inv = inventory(tmp_path, hosts)
    hosts.stop(0)
    try:
        r = fleetctl("probe", inv, "--json", "--known-hosts", hosts.known_hosts)
    finally:
        hosts.start(0)
    line = json.loads(r.stdout)["nodes"][NODE]["error"]["line"]
    assert line.startswith(f"{NODE} ([{h.address6}]:22): connection refused"), line


def test_a_changed_key_on_another_port_names_its_known_hosts_entry(hosts):
    """known_hosts names a host on a port other than 22 `[addr]:port` (IPv6 or not): the
    fix the operator is given must remove that entry, quoted for the shell."""
    import paramiko

    from fleetctl.fleet.ssh import SshOptions, Target, describe

    h = hosts[0]
    key = paramiko.Ed25519Key(filename=str(h.dir / "host_ed25519"))
    recorded = paramiko.Ed25519Key(filename=str(hosts.client_key))
    e = paramiko.BadHostKeyException(f"[{h.address6}]:2222", key, recorded)
    line = describe(e, Target(NODE, h.address6, 2222), SshOptions()).line()
    assert line.startswith(f"{NODE} ([{h.address6}]:2222): host key CHANGED"), line
    assert f"ssh-keygen -R '[{h.address6}]:2222'" in line, line


def test_a_zoned_link_local_host_is_refused_at_the_door(hosts, tmp_path):
    """fe80::1%eth0 names an interface of this machine, not of the node (where vLLM binds)."""
    inv = inventory(tmp_path, hosts, host="fe80::1%eth0")
    r = fleetctl("plan", inv)
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(
        f"error: {inv}:3: nodes[0].host: host 'fe80::1%eth0' has an IPv6 zone"
    ), line
    assert line.endswith("(write a global or unique-local address such as fd00::11, or a hostname)")


def test_accept_new_records_an_ipv6_host_on_another_port_as_openssh_reads_it(tmp_path):
    """On a port other than 22, known_hosts names the host [addr]:port: what fleetctl records
    with --accept-new-host-keys, the real ssh client and ssh-keygen -F must find."""
    require()
    with TestHosts(1, names=[NODE], ipv6=True, port=2222) as hosts:
        h = hosts[0]
        inv = inventory(tmp_path, hosts)
        hosts.known_hosts.write_text("")
        known = ("--known-hosts", hosts.known_hosts)
        r = fleetctl("probe", inv, "--json", *known)
        line = json.loads(r.stdout)["nodes"][NODE]["error"]["line"]
        assert line.startswith(f"{NODE} ([{h.address6}]:2222): host key unknown"), line
        assert f"ssh-keyscan -p 2222 {h.address6} >>" in line, line

        r = fleetctl("probe", inv, "--json", *known, "--accept-new-host-keys")
        assert "error" not in json.loads(r.stdout)["nodes"][NODE], r.stdout
        assert hosts.known_hosts.read_text() == f"[{h.address6}]:2222 {h.host_key}\n"
        found = subprocess.run(
            ["ssh-keygen", "-F", f"[{h.address6}]:2222", "-f", str(hosts.known_hosts)],
            capture_output=True,
            text=True,
        )
        assert found.returncode == 0 and h.host_key in found.stdout, found
        ssh = subprocess.run(
            hosts.ssh_argv(0, "hostname", address=h.address6),  # StrictHostKeyChecking=yes
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert (ssh.returncode, ssh.stdout) == (0, f"{NODE}\n"), ssh.stderr
        # And fleetctl reads back what it wrote: no new host key prompt, no second line.
        r = fleetctl("probe", inv, "--json", *known)
        assert "error" not in json.loads(r.stdout)["nodes"][NODE], r.stdout
        assert len(hosts.known_hosts.read_text().splitlines()) == 1


def test_a_port_taken_on_the_ipv6_address_is_refused_and_named(hosts, tmp_path):
    """The node's port check reads /proc/net/tcp6 too: a stray listener on [addr]:8000 is found
    before the server would fail to bind, and named."""
    h = hosts[0]
    inv = inventory(tmp_path, hosts)
    cmd = ["ip", "netns", "exec", h.namespace, sys.executable, "-m", "http.server", "8000"]
    squatter = subprocess.Popen(
        [*cmd, "--bind", h.address6], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_until(lambda: get(f"http://[{h.address6}]:8000/")[0] in (200, 404))
        r = fleetctl("apply", inv, "--yes", "--json", "--known-hosts", hosts.known_hosts)
        assert r.returncode == 1, r.stdout + r.stderr
        [o] = json.loads(r.stdout)["outcomes"]
        assert o["status"] == "failed", o
        assert o["detail"].startswith(f"port-taken: port 8000 is already taken by: {squatter.pid}")
    finally:
        squatter.kill()
        squatter.wait()
        subprocess.run(["rm", "-rf", str(h.dir / "home" / ".fleetctl")], check=False)
    assert servers_running(hosts) == []
