"""Processes the integration tests start: emulated vLLM servers on free loopback ports.

Ports, process start and stop, readiness waits and the emulator's command line live in
harness/, shared with the benchmarks; this module keeps the tests' names for them.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import openai
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from fleetctl.daemon.intake import JsonErrorRunner
from harness.commands import emulate_cmd
from harness.procs import Proc, free_port, stop_process
from harness.ready import first_answer, http_request, wait_status

__all__ = [
    "NAME",
    "SCALE",
    "SOURCE",
    "Emulator",
    "RouterThread",
    "free_port",
    "http_request",
    "stop_process",
]

SCALE = "20"
NAME = "llama-3-8b"
SOURCE = "meta-llama/Meta-Llama-3-8B-Instruct"


class RouterThread:
    """A daemon Router's app served on 127.0.0.1 in a thread of its own (its event loop),
    with serve.py's limits; `runner_options` adds to the AppRunner's (e.g. an access log)."""

    def __init__(self, router: Any, **runner_options: Any) -> None:
        from fleetctl.daemon.serve import server_options

        self.router = router
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._options = {**server_options(router.config), **runner_options}
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = JsonErrorRunner(self.router.app(), **self._options)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        ready.set()
        self.loop.run_forever()
        self.loop.close()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


class Emulator:
    """One `python -m fleetctl emulate` subprocess."""

    def __init__(
        self,
        log_dir: Path,
        *args: str,
        gpu: str = "RTX-4090",
        model: str = NAME,
        side_channel: bool = False,
        env: dict[str, str] | None = None,
    ):
        self.port = free_port()
        cmd = emulate_cmd(self.port, gpu, model, SOURCE, NAME, SCALE, *args)
        # side_channel: its NIXL side channel is its own port, where decode servers tell it
        # they are done with its blocks (fleetctl/emulator/kv_transfer.py).
        if side_channel:
            env = (env or {}) | {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.port),
            }
        # In the test's process group, as a plain Popen would be: a Ctrl-C reaches it too.
        self.process = Proc(f"emulator-{self.port}", cmd, log_dir, env, own_group=False)
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
