"""A split plan on one inventory, end to end over real SSH: `apply` starts prefill and decode
servers with vLLM's KV-transfer flags and NIXL's side channel, records their roles, and
route-serve, from that state alone, sends a request through a prefill server and a decode
server (the test hosts' `vllm` is the emulator, as in test_apply.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness.procs import Proc, free_port
from harness.ready import first_answer, http_request
from harness.sshhosts import TestHosts, require
from tests.apply.test_apply import GPU, SECRET, get, servers_running, shim, wait_until

NAMES = ["a100-1", "rtx-1", "rtx-2"]


@pytest.fixture(scope="module")
def hosts():
    require()
    with TestHosts(len(NAMES), names=NAMES) as hs:
        yield hs


def inventory(hosts: TestHosts, tmp: Path) -> Path:
    lines = [
        f"ssh: {{user: root, identity_file: {hosts.client_key}, connect_timeout_s: 30}}",
        "nodes:",
    ]
    for h in hosts:
        gpu, count = GPU[h.name.split("-")[0]]
        lines += [
            f"  - name: {h.name}",
            f"    host: {h.address}",
            f"    gpus: {{type: {gpu}, count: {count}}}",
            "    network: {gbps: 100, rdma: true}",
        ]
    lines += [
        "models:",
        "  - name: llama-3-8b",
        "    profile: llama-3-8b",
        "    variants: {bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}}",
        "    max_context: 8192",
        "    slo: {ttft_p99_s: 2.0, tpot_p99_ms: 50}",
        "    disaggregation: on",
        "apply: {health_timeout_s: 60, stop_timeout_s: 5, secrets: [HF_TOKEN]}",
    ]
    path = tmp / "inventory.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_split_plan_is_applied_and_routed_end_to_end(cli, hosts, tmp_path, monkeypatch):
    for i, name in enumerate(NAMES):
        hosts.install(i, "vllm", shim(GPU[name.split("-")[0]][0]))
    monkeypatch.setenv("HF_TOKEN", SECRET)
    inv = inventory(hosts, tmp_path)
    known = ["--known-hosts", str(hosts.known_hosts)]
    router: Proc | None = None
    try:
        r = cli("apply", inv, "--yes", "--json", *known)
        assert r.code == 0, r.out + r.err
        state = json.loads((tmp_path / ".fleetctl" / "state.json").read_text())
        roles = {d["role"] for d in state["deployments"]}
        assert roles == {"prefill", "decode"}, state["deployments"]

        # Each server runs with its role's flags and NIXL's side channel on its own port.
        for d in state["deployments"]:
            h = hosts[NAMES.index(d["node"])]
            folder = next((h.dir / "home" / ".fleetctl" / "servers").glob(f"{d['port']}-*"))
            pid = int((folder / "pid").read_text())
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
            want = "kv_producer" if d["role"] == "prefill" else "kv_consumer"
            assert config["kv_connector"] == "NixlConnector" and config["kv_role"] == want
            env = (folder / "env").read_text()
            assert f"VLLM_NIXL_SIDE_CHANNEL_PORT='{d['port'] + 6000}'" in env, env
            assert get(f"http://{h.address}:{d['port']}/health")[0] == 200

        # route-serve from the state alone: prefill on one server, decode on another.
        port = free_port()
        serve = [sys.executable, "-m", "fleetctl", "route-serve", str(inv)]
        router = Proc(
            "route-serve",
            [*serve, "--listen", f"127.0.0.1:{port}"],
            tmp_path,
            cwd=tmp_path,
        )
        first_answer(port, "/health", router, deadline_s=120)
        total = len(state["deployments"])
        wait_until(lambda: json.loads(http_request(port, "GET", "/health")[2])["healthy"] == total)
        status, headers, body = http_request(
            port,
            "POST",
            "/v1/completions",
            {"model": "llama-3-8b", "prompt": "hello " * 300, "max_tokens": 8},
            timeout=60,
        )
        assert status == 200, body
        by_url = {f"{d['host']}:{d['port']}": d["role"] for d in state["deployments"]}
        assert by_url[headers["X-Fleet-Prefill-Backend"]] == "prefill", headers
        # X-Fleet-Backend names the decode server's node (as for any request).
        decoding = {d["node"] for d in state["deployments"] if d["role"] == "decode"}
        assert headers["X-Fleet-Backend"] in decoding, headers
        assert json.loads(body)["usage"]["completion_tokens"] == 8
    finally:
        if router is not None:
            router.stop()
        assert cli("destroy", inv, "--yes", *known).code == 0
        assert servers_running(hosts) == []
