"""`fleetctl apply` of a plan with LoRA adapters onto real vLLM (the CPU build) over real SSH:
adapter files copied from `copy_from` onto the node, the server started with the plan's LoRA
flags, each adapter it preloads served by name, and an adapter no server has loaded at runtime
by route-serve's choice (vLLM's runtime endpoint open because the plan set the variable for
it), each request answered by the adapter it named."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from harness.procs import Proc, free_port
from harness.ready import http_request, wait_status
from harness.sshhosts import STD_PATH, TestHosts, require
from harness.vllm_server import MODEL_SUBDIR, ensure_env, server_env
from tests.apply.test_apply import servers_running
from tests.apply.test_apply_vllm_real import API_KEY, PROFILES, SERVER_ENV_KEYS
from tests.model.test_lora_vllm_real import BUILDER

pytestmark = pytest.mark.vllm_real

MODEL = "tiny-llama"


def _call(url: str, body: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode() if body is not None else None)
    req.add_header("Authorization", f"Bearer {API_KEY}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_apply_starts_lora_servers_that_serve_each_adapter(cli, tmp_path, monkeypatch):
    require()
    env_dir = ensure_env()
    full = server_env(env_dir)
    env = {k: full[k] for k in SERVER_ENV_KEYS}
    env["PATH"] = f"{env_dir / 'bin'}:{STD_PATH}"
    adapters = tmp_path / "adapters"
    names = ("tiny-support", "tiny-legal", "tiny-sql")
    subprocess.run(
        [str(env_dir / "bin" / "python"), str(BUILDER), str(env_dir / MODEL_SUBDIR),
         str(adapters), "8", *names],
        check=True, capture_output=True,
    )  # fmt: skip
    # Two adapters the node gets from apply (copy_from): one loaded at start, one at runtime.
    on_node = tmp_path / "node-adapters"
    monkeypatch.setenv("VLLM_API_KEY", API_KEY)
    monkeypatch.setenv("FLEETCTL_PROFILES", str(PROFILES))
    with TestHosts(1, names=["cpu-1"]) as hosts:
        inv = tmp_path / "inventory.yaml"
        inv.write_text(
            f"ssh: {{user: root, identity_file: {hosts.client_key}, connect_timeout_s: 30}}\n"
            "nodes:\n"
            f"  - {{name: cpu-1, host: {hosts[0].address}, gpus: {{type: CPU-TEST, count: 1}}}}\n"
            "models:\n"
            f"  - name: {MODEL}\n"
            f"    profile: {MODEL}\n"
            f"    variants: {{bf16: {{source: {env_dir / MODEL_SUBDIR}}}}}\n"
            "    max_context: 512\n"
            f"    env: {json.dumps(env)}\n"
            "    max_loras: 2\n"
            "    adapters_runtime: true\n"
            "    adapters:\n"
            f"      - {{name: tiny-support, source: {adapters / 'tiny-support'}, rank: 8,\n"
            "         workload: {requests_per_s: 3, mean_prompt_tokens: 8, mean_output_tokens: 4}}\n"
            f"      - {{name: tiny-legal, source: {on_node / 'tiny-legal'}, rank: 8,\n"
            f"         copy_from: {adapters / 'tiny-legal'},\n"
            "         workload: {requests_per_s: 2, mean_prompt_tokens: 8, mean_output_tokens: 4}}\n"
            f"      - {{name: tiny-sql, source: {on_node / 'tiny-sql'}, rank: 8,\n"
            f"         copy_from: {adapters / 'tiny-sql'}}}\n"
            "planner: {enforce_eager: true}\n"
            "apply:\n"
            f"  vllm_command: {env_dir / 'bin' / 'vllm'}\n"
            "  health_timeout_s: 600\n"
            "  stop_timeout_s: 20\n"
            "  secrets: [VLLM_API_KEY]\n"
        )
        known = ["--known-hosts", str(hosts.known_hosts)]
        assert not on_node.exists()
        r = cli("apply", inv, "--yes", "--json", *known)
        assert r.code == 0, r.out + r.err
        try:
            for name in ("tiny-legal", "tiny-sql"):
                for f in (adapters / name).iterdir():
                    assert (on_node / name / f.name).read_bytes() == f.read_bytes()
            [d] = json.loads((tmp_path / ".fleetctl" / "state.json").read_text())["deployments"]
            assert d["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
            url = f"http://{d['host']}:{d['port']}"
            # The two most requested load at start; the third waits for a runtime load.
            status, body = _call(url + "/v1/models")
            assert status == 200, body
            served = sorted(m["id"] for m in json.loads(body)["data"])
            assert served == sorted([MODEL, "tiny-support", "tiny-legal"])
            for name in ("tiny-support", "tiny-legal"):
                req = {"model": name, "prompt": "The fleet", "max_tokens": 4}
                status, body = _call(url + "/v1/completions", req)
                assert status == 200 and json.loads(body)["model"] == name, body
            # The third no server has: route-serve, over the applied state, loads it where it
            # chooses (the variable the plan set opened vLLM's runtime endpoint) and the
            # request is answered by it.
            key_file = tmp_path / "backend.key"
            key_file.write_text(API_KEY + "\n")
            key_file.chmod(0o600)
            port = free_port()
            cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv)]
            cmd += ["--listen", f"127.0.0.1:{port}", "--backend-api-key-file", str(key_file)]
            router = Proc("route-serve", cmd, tmp_path, own_group=False)
            try:
                wait_status(port, "/health", router, 200)
                for name in ("tiny-sql", "tiny-support", "tiny-legal", "tiny-sql"):
                    req = {"model": name, "prompt": "The fleet", "max_tokens": 4}
                    status, _, body = http_request(port, "POST", "/v1/completions", req, None, 300)
                    assert status == 200, body
                    assert json.loads(body)["model"] == name, body
            finally:
                router.stop()
            status, body = _call(url + "/v1/models")
            served = sorted(m["id"] for m in json.loads(body)["data"])
            assert served == sorted([MODEL, *names]), body
        finally:
            r = cli("destroy", inv, "--yes", "--json", *known)
        assert r.code == 0, r.out + r.err
        assert servers_running(hosts) == []
