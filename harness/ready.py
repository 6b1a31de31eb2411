"""Readiness: wait until a started server answers, on the event itself, never a fixed sleep.

Each wait ends at its event (the port accepts a connection, the answer has the wanted
status) or when the process dies; the deadline only stops one that would hang, and is long
because a loaded machine may take many seconds to start Python. Between two tries of a port
that refused, a short pause (tens of ms) keeps the wait from spinning a core.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time

import aiohttp

from .procs import Proc

JSON_HEADERS = {"Content-Type": "application/json"}


class NotReady(RuntimeError):
    """The process died, or did not answer as wanted before the deadline (its log's tail)."""


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
        conn.request(method, path, data, {**JSON_HEADERS, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def first_answer(port: int, path: str, proc: Proc, deadline_s: float = 60) -> int:
    """Status of the first answer to GET `path`, once the port accepts connections."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not proc.alive():
            raise NotReady(f"{proc.name} exited: {proc.tail(40)}")
        try:
            return http_request(port, "GET", path, timeout=2)[0]
        except OSError:
            time.sleep(0.02)
    raise NotReady(f"{proc.name} did not listen within {deadline_s:.0f} s: {proc.tail(40)}")


def wait_status(port: int, path: str, proc: Proc, want: int = 200, deadline_s: float = 60) -> None:
    """Until GET `path` answers `want` (a server that listens before it is ready says 503)."""
    end = time.monotonic() + deadline_s
    while (got := first_answer(port, path, proc, deadline_s)) != want:
        if time.monotonic() >= end:
            raise NotReady(f"{proc.name} answered {got}, not {want}: {proc.tail(40)}")
        time.sleep(0.05)


async def wait_ready(
    session: aiohttp.ClientSession,
    url: str,
    proc: Proc,
    limit_s: float,
    body: bytes | None = None,
) -> None:
    """Until `url` answers 200: a GET, or a POST of `body` (a small completion through a
    router, which only then has a backend it can reach)."""
    end = time.monotonic() + limit_s
    last = "no answer"
    while time.monotonic() < end:
        if not proc.alive():
            raise NotReady(f"{proc.name} exited: {proc.tail()}")
        try:
            attempt = aiohttp.ClientTimeout(total=5)
            if body is None:
                req = session.get(url, timeout=attempt)
            else:
                req = session.post(url, data=body, headers=JSON_HEADERS, timeout=attempt)
            async with req as r:
                await r.read()
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            last = type(e).__name__
        await asyncio.sleep(0.1)
    raise NotReady(f"{proc.name} not ready after {limit_s:.0f} s ({last}): {proc.tail()}")
