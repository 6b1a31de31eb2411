"""The seam between the proxy and its backends: what a transport offers, and picking one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, Self

from fleetctl.daemon.upstream import IDLE_TIMEOUT, MAX_BODY, Upstream

TRANSPORTS = ("fast", "reference")


class Answer(Protocol):
    """A backend's answer: status and headers are in; the body is read whole or as it comes.
    Leaving it (close, or the `with` block) before the end drops the connection, which tells
    vLLM to abort the request."""

    status: int

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def read(self) -> bytes: ...

    async def read_chunk(self) -> bytes: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


class Transport(Protocol):
    """POSTs to backends over kept-alive connections. Every malformed or cut-short answer ends
    in UpstreamError (fleetctl.daemon.upstream); a silence longer than the read timeout in
    TimeoutError; a failed connect in OSError. A pooled connection idle longer than
    `idle_timeout` is never used again: it sits below the backend's own keep-alive timeout
    (uvicorn's 5 s), so a request is never sent on a connection the backend is closing."""

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Answer: ...

    def idle_connections(self) -> int: ...

    def close(self) -> None: ...


def make_transport(
    name: str,
    connect_timeout: float,
    read_timeout: float,
    *,
    max_idle: int = 256,
    max_body: int = MAX_BODY,
    idle_timeout: float = IDLE_TIMEOUT,
) -> Transport:
    """`fast`: fleetctl's own HTTP/1.1 client (upstream.py, llhttp framing), the cheapest per
    request;
    `reference`: aiohttp's client, a maintained implementation to compare it with."""
    if name == "fast":
        return Upstream(connect_timeout, read_timeout, max_idle, max_body, idle_timeout)
    if name == "reference":
        from fleetctl.daemon.upstream_aiohttp import AiohttpUpstream

        return AiohttpUpstream(connect_timeout, read_timeout, max_idle, max_body, idle_timeout)
    raise ValueError(f"unknown upstream client {name!r}; choose from {', '.join(TRANSPORTS)}")
