"""Listening and stopping, for route-serve and the emulator alike.

The port is bound before anything is printed, so a port already in use is one line and exit
code 2, not a banner followed by an internal error. On SIGTERM or SIGINT the server stops
accepting, closes idle keep-alive connections at once, lets requests in flight finish for
up to `drain_s`, and then cuts what is left; a second signal cuts them at once. aiohttp's own
shutdown waits up to its shutdown_timeout twice over (for the handler, then again after
cancelling the request's payload only) before it cancels a handler: 60 s by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from fleetctl.base import names
from fleetctl.base.errors import UserError

BACKLOG = 4096  # the default 128 overflowed at 1,000 concurrent streams (measured)
# After the drain, how long a handler that was cancelled may take to unwind (twice: aiohttp
# waits for it, cancels its request, waits again, then cancels its task).
CUT_S = 0.05
# How often the drain looks whether the connections still serving a request have finished:
# only while stopping, so it costs nothing while serving.
DRAIN_POLL_S = 0.01


def bind(host: str, port: int, reuse_port: bool, fix: str) -> list[socket.socket]:
    """Listening sockets on every address `host` names (as aiohttp's TCPSite binds), or a
    UserError that says why, with `fix`."""
    where = names.host_port(host, port)
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise UserError(f"cannot listen on {where}: {e.strerror}", None, fix) from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(found):
            socks.append(_listen(family, kind, proto, addr, reuse_port))
    except OSError as e:
        for s in socks:
            s.close()
        raise UserError(f"cannot listen on {where}: {_reason(e)}", None, fix) from None
    return socks


def _listen(family: int, kind: int, proto: int, addr: Any, reuse_port: bool) -> socket.socket:
    s = socket.socket(family, kind, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio: past TIME_WAIT
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:  # as asyncio: "::" is IPv6 only, 0.0.0.0 is separate
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind(addr)
        s.listen(BACKLOG)
        s.setblocking(False)
    except OSError:
        s.close()
        raise
    return s


def _reason(e: OSError) -> str:
    """`address already in use`, not uvloop's or asyncio's longer wording of it."""
    if e.errno is None:
        return str(e)
    if e.errno == errno.EACCES:
        return "permission denied (ports below 1024 need root)"
    return os.strerror(e.errno).lower()


def stop_signals(on_first: asyncio.Event, on_second: asyncio.Event) -> None:
    """SIGTERM or SIGINT sets `on_first`; another after it sets `on_second`."""
    loop = asyncio.get_running_loop()

    def signalled() -> None:
        (on_second if on_first.is_set() else on_first).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled)


async def start(
    app: web.Application,
    socks: list[socket.socket],
    runner_class: type[web.AppRunner] = web.AppRunner,
    **runner_options: Any,
) -> web.AppRunner:
    """`app` served on `socks` (its on_startup hooks run before the first request)."""
    runner = runner_class(app, handle_signals=False, shutdown_timeout=CUT_S, **runner_options)
    await runner.setup()
    for s in socks:
        await web.SockSite(runner, s, backlog=BACKLOG).start()
    return runner


async def stop(
    runner: web.AppRunner,
    drain_s: float,
    cut: asyncio.Event,
    on_cut: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Stop accepting, close idle connections, wait up to `drain_s` (or until `cut` is set)
    for requests in flight, then cut the rest (`on_cut` first, which may end them in words
    their clients understand) and run the app's cleanup."""
    for site in list(runner.sites):
        await site.stop()
    server = runner.server
    if server is not None:
        server.pre_shutdown()  # idle keep-alive connections close now; busy ones after
        await _drained(server, drain_s, cut)
        if on_cut is not None and busy(server):
            await on_cut()
    await runner.cleanup()


async def _drained(server: web.Server, drain_s: float, cut: asyncio.Event) -> None:
    """Until no connection is serving a request, `drain_s` has passed, or `cut` is set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(drain_s):
            while busy(server) and not cut.is_set():
                await asyncio.sleep(DRAIN_POLL_S)


def busy(server: web.Server) -> int:
    """Connections serving a request. Idle ones stay listed after pre_shutdown() until
    shutdown() closes them; aiohttp says which are busy only in a private field (if it goes,
    this reads 0 and the drain cuts at once rather than waiting for idle connections)."""
    return sum(bool(getattr(c, "_request_in_progress", False)) for c in server.connections)
