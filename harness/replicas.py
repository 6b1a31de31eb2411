"""Router replicas for the tests and benchmarks that share state through Redis: a
redis-server, two stand-in backends of two classes, `fleetctl route-serve` processes, and a
closed-loop driver of multi-turn sessions that records each turn's class."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .procs import Proc, free_port, pinned, tree_cpu_s

MODEL = "llama-3-8b"
INVENTORY = """\
nodes:
  - name: a100-1
    gpus: {type: A100-SXM4-80GB, count: 1}
  - name: rtx-1
    gpus: {type: RTX-4090, count: 1}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
      gptq-int4: {source: x/llama-3-8b-gptq}
    max_context: 8192
    workload: {requests_per_s: 5, mean_prompt_tokens: 500, mean_output_tokens: 64}
router: {request_log: {enabled: false}}
"""
HINTS = ("bf16;strict", "int4;strict")
BODY = json.dumps({"model": MODEL, "prompt": "hello " * 20, "max_tokens": 4}).encode()


def backend_entries(urls: list[str]) -> list[dict[str, str]]:
    """The two stand-ins as two classes: an A100 serving bf16, an RTX 4090 serving int4."""
    return [
        {"url": urls[0], "node": "a100-1", "gpu_type": "A100-SXM4-80GB", "model": MODEL},
        {
            "url": urls[1],
            "node": "rtx-1",
            "gpu_type": "RTX-4090",
            "model": MODEL,
            "variant": "gptq-int4",
        },
    ]


# --- processes: redis-server, stand-in backends, route-serve ---------------------------------


def wait_port(port: int, alive: Callable[[], bool], limit_s: float = 60) -> None:
    """Until 127.0.0.1:port accepts a connection (limit_s only stops a hang)."""
    end = time.monotonic() + limit_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            if not alive() or time.monotonic() > end:
                raise RuntimeError(f"nothing listens on {port}") from None
            time.sleep(0.02)


class Redis:
    """A redis-server on a loopback port, without persistence: killed and started again it
    comes back empty."""

    def __init__(self, work: Path, core: int | None = None, port: int | None = None):
        self.port = port or free_port()
        self.work, self.core = work, core
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: Proc | None = None
        self.start()

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed"
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(self.work)]
        self.proc = Proc(f"redis-{self.port}", pinned(cmd, self.core), self.work, own_group=False)
        wait_port(self.port, self.proc.alive)

    def flush(self) -> None:
        """Forget every key (each measurement starts from an empty store)."""
        import redis

        with redis.Redis.from_url(self.url) as r:
            r.flushall()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.proc.kill()
        self.proc.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def start_backends(work: Path, core: int | None) -> tuple[list[Proc], list[str]]:
    procs, urls = [], []
    for i in range(2):
        port = free_port()
        serve = f"from harness.standin import run_backend; run_backend({port}, 1.0, {MODEL!r})"
        cmd = [sys.executable, "-c", serve]
        procs.append(Proc(f"backend-{i + 1}", pinned(cmd, core), work, own_group=False))
        urls.append(f"http://127.0.0.1:{port}")
    for p, u in zip(procs, urls, strict=True):
        wait_port(int(u.rsplit(":", 1)[1]), p.alive)
    return procs, urls


class RouteServe:
    """One `fleetctl route-serve` (its own process group, so --workers' children stop too)."""

    def __init__(
        self,
        work: Path,
        name: str,
        backends: list[dict[str, str]],
        *extra: str,
        port: int | None = None,
        core: int | None = None,
        level: str = "WARNING",
    ):
        self.work, self.name, self.extra, self.core, self.level = work, name, extra, core, level
        self.port = port or free_port()
        self.inventory = work / f"{name}-inventory.yaml"
        self.inventory.write_text(INVENTORY)
        self.backends = work / f"{name}-backends.yaml"
        self.backends.write_text(json.dumps({"backends": backends}))
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Proc | None = None
        self.logs: list[str] = []
        self.start()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(self.inventory)]
        cmd += ["--backends", str(self.backends), "--listen", f"127.0.0.1:{self.port}"]
        cmd += ["--state-dir", str(self.work / f"{self.name}-state"), *self.extra]
        env = {"FLEETCTL_LOG_LEVEL": self.level}
        n = len(self.logs)
        self.proc = Proc(f"{self.name}-{n}", pinned(cmd, self.core), self.work, env=env)
        self.logs.append(str(self.proc.log))
        self.wait_ready()

    def wait_ready(self, limit_s: float = 60) -> None:
        """Until /health answers 200 (a backend is up), not merely the port."""
        assert self.proc is not None
        end = time.monotonic() + limit_s
        while True:
            try:
                if self.health(timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            if not self.proc.alive() or time.monotonic() > end:
                raise RuntimeError(f"{self.name} did not start: {self.proc.tail(30)}")
            time.sleep(0.05)

    def get(self, path: str, timeout: float = 5) -> tuple[int, bytes]:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def health(self, timeout: float = 5) -> tuple[int, dict[str, Any]]:
        status, body = self.get("/health", timeout)
        return status, json.loads(body)

    def metric(self, name: str) -> float | None:
        _, body = self.get("/metrics")
        for line in body.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return None

    def log_text(self) -> str:
        return "".join(Path(p).read_text(errors="replace") for p in self.logs)

    def kill(self) -> None:
        """SIGKILL, the whole group: a crash, nothing flushed."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.proc.wait()

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid) if self.proc is not None else 0.0

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


# --- the session load generator ---------------------------------------------------------------


@dataclass
class Turn:
    session: int
    turn: int
    replica: int  # the index of the URL that answered (after failovers)
    sent: float  # time.monotonic()
    ended: float
    status: int  # 0: no answer from any replica
    node_class: str
    failovers: int = 0  # replicas that refused the connection first (as a balancer retries)
    error: str = ""


@dataclass
class Drive:
    """Sessions of `turns` turns over `urls`, `conc` requests at once, until `total` turns were
    sent or `stop` is set; turn t of session s goes to replica (s + t) mod len(urls)."""

    urls: list[str]
    conc: int = 32
    total: int = 48_000
    turns: int = 4
    tag: str = "s"
    turns_done: list[Turn] = field(default_factory=list)
    stop: bool = False
    _next: int = 0
    _sent: int = 0

    async def run(self, client: aiohttp.ClientSession) -> list[Turn]:
        await asyncio.gather(*(self._worker(client) for _ in range(self.conc)))
        return self.turns_done

    async def _worker(self, client: aiohttp.ClientSession) -> None:
        while not self.stop and self._sent < self.total:
            s = self._next
            self._next += 1
            for t in range(self.turns):
                if self.stop or self._sent >= self.total:
                    return
                self._sent += 1
                self.turns_done.append(await self.turn(client, s, t))

    async def turn(self, client: aiohttp.ClientSession, s: int, t: int) -> Turn:
        headers = {"Content-Type": "application/json", "X-Session-ID": f"{self.tag}-{s}"}
        if t == 0:
            headers["X-Fleet-Precision"] = HINTS[s % 2]
        sent = time.monotonic()
        failovers, error = 0, ""
        for k in range(len(self.urls)):
            i = (s + t + k) % len(self.urls)
            try:
                async with client.post(
                    self.urls[i] + "/v1/completions", data=BODY, headers=headers
                ) as r:
                    await r.read()
                    cls = r.headers.get("X-Fleet-Class", "")
                    return Turn(s, t, i, sent, time.monotonic(), r.status, cls, failovers)
            except (aiohttp.ClientConnectionError, OSError) as e:
                # A replica that is away: the next one, as a load balancer would.
                failovers += 1
                error = type(e).__name__
            except TimeoutError:
                error = "TimeoutError"
                break
        return Turn(s, t, -1, sent, time.monotonic(), 0, "", failovers, error)


def changed(turns: list[Turn], keep: Callable[[Turn], bool] = lambda t: True) -> tuple[int, int]:
    """(turns whose class differs from their session's previous answered turn, turns
    compared), over the later turns `keep` selects."""
    by: dict[int, list[Turn]] = {}
    for t in turns:
        if t.status == 200:
            by.setdefault(t.session, []).append(t)
    moved = seen = 0
    for ts in by.values():
        ts.sort(key=lambda t: t.turn)
        for prev, t in itertools.pairwise(ts):
            if keep(t) and keep(prev):
                seen += 1
                moved += t.node_class != prev.node_class
    return moved, seen


def client_session(conc: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0)
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=60, sock_connect=10)
    )


# --- the phases ---------------------------------------------------------------------------------


def store_status(rs: RouteServe) -> str:
    with contextlib.suppress(OSError, ValueError):
        return str(rs.health()[1].get("session_store", {}).get("status"))
    return "?"
