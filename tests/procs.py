"""Processes the integration tests start: emulated vLLM servers on free loopback ports.

Ports, process start and stop, readiness waits and the emulator's command line live in
benchmarks/harness/, shared with the benchmarks; this module keeps the tests' names for them.
"""

from __future__ import annotations

from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness.commands import emulate_cmd
from benchmarks.harness.procs import Proc, free_port, stop_process
from benchmarks.harness.ready import first_answer, http_request, wait_status

__all__ = ["NAME", "SCALE", "SOURCE", "Emulator", "free_port", "http_request", "stop_process"]

SCALE = "20"
NAME = "llama-3-8b"
SOURCE = "meta-llama/Meta-Llama-3-8B-Instruct"


class Emulator:
    """One `python -m fleetctl emulate` subprocess."""

    def __init__(self, log_dir: Path, *args: str, gpu: str = "RTX-4090", model: str = NAME):
        self.port = free_port()
        cmd = emulate_cmd(self.port, gpu, model, SOURCE, NAME, SCALE, *args)
        # In the test's process group, as a plain Popen would be: a Ctrl-C reaches it too.
        self.process = Proc(f"emulator-{self.port}", cmd, log_dir, own_group=False)
        self.proc, self.log = self.process.proc, self.process.log
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

    def first_answer(self, deadline_s: float = 60) -> int:
        """Status of the first /health answer once the port accepts connections."""
        return first_answer(self.port, "/health", self.process, deadline_s)

    def wait_healthy(self, deadline_s: float = 60) -> None:
        wait_status(self.port, "/health", self.process, 200, deadline_s)

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0, timeout=30)

    def metrics(self) -> dict[str, object]:
        status, body = self.request("GET", "/metrics")
        assert status == 200
        return {f.name: f for f in text_string_to_metric_families(body.decode())}

    def stop(self) -> None:
        self.process.stop()
