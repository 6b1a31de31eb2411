"""Processes the integration tests start: emulated vLLM servers on free loopback ports."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO

SCALE = "20"
NAME = "llama-3-8b"
SOURCE = "meta-llama/Meta-Llama-3-8B-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_request(
    port: int,
    method: str,
    path: str,
    body: object = None,
    headers: dict | None = None,
    timeout: float = 10,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request to 127.0.0.1:port; a dict or list body is sent as JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 5 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Emulator:
    """One `python -m fleetctl emulate` subprocess."""

    def __init__(self, log_dir: Path, *args: str, gpu: str = "RTX-4090", model: str = NAME):
        self.port = free_port()
        self.log = log_dir / f"emulator-{self.port}.log"
        cmd = [sys.executable, "-m", "fleetctl", "emulate", "--gpu", gpu, "--model", model]
        cmd += [SOURCE, "--served-model-name", NAME, "--port", str(self.port)]
        cmd += ["--time-scale", SCALE, *args]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        self.base = f"http://127.0.0.1:{self.port}"

    def request(
        self,
        method: str,
        path: str,
        body: object = None,
        headers: dict | None = None,
        timeout: float = 10,
    ) -> tuple[int, bytes]:
        status, _, answer = http_request(self.port, method, path, body, headers, timeout)
        return status, answer

    # Deadlines below only stop a test that would hang: each wait ends at its event (the port
    # answers, /health says 200), and a loaded machine may take many seconds to start Python.
    def first_answer(self, deadline_s: float = 60) -> int:
        """Status of the first /health answer once the port accepts connections."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                return self.request("GET", "/health", timeout=2)[0]
            except OSError:
                time.sleep(0.02)
        raise AssertionError(f"emulator did not listen: {self.log.read_text()}")

    def wait_healthy(self, deadline_s: float = 60) -> None:
        end = time.monotonic() + deadline_s
        while self.first_answer(deadline_s) != 200:
            assert time.monotonic() < end, "emulator never became healthy"
            time.sleep(0.05)

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0, timeout=30)

    def metrics(self) -> dict[str, object]:
        status, body = self.request("GET", "/metrics")
        assert status == 200
        return {f.name: f for f in text_string_to_metric_families(body.decode())}

    def stop(self) -> None:
        stop_process(self.proc)
