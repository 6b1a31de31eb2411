"""A lean HTTP/1.1 client for the router's POSTs to its backends: keep-alive pool, idle expiry,
answers framed by llhttp (httptools), no extras."""

from __future__ import annotations

import asyncio
import base64
import collections
import re
import ssl
from typing import Any
from urllib.parse import unquote, urlsplit

import httptools
from multidict import CIMultiDict

MAX_HEAD = 64 * 1024  # status line and headers (interim answers included)
MAX_INTERIM = 8  # 1xx answers before the final one
MAX_HEADERS = 100  # header lines in an answer (as Python's http.client), trailers apart
MAX_BODY = 128 * 2**20  # an answer read whole (not streamed): the router holds it in memory
HIGH_WATER = 256 * 1024  # unread body bytes before the socket stops being read
# A pooled connection idle this long is closed, not reused: below the backend's keep-alive
# timeout (uvicorn's, so vLLM's, is 5 s), so that a request never races the backend's close.
IDLE_TIMEOUT = 4.0

# llhttp checks the framing (status line, header names, Content-Length digits, one length and
# never beside chunked, hex chunk sizes); values are also kept free of control characters, so
# that they can be written into the client's answer as they are.
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # controls but HTAB: CR and LF included


class UpstreamError(Exception):
    """The backend broke the exchange: it closed early or answered something not HTTP/1.x.
    Every way an answer can be malformed ends here, never in another exception."""


class ServerDisconnected(UpstreamError):
    pass


class BadResponse(UpstreamError):
    pass


class _Conn(asyncio.Protocol):
    """One connection; llhttp parses as bytes arrive and the callbacks keep what it found."""

    def __init__(self, pool: collections.deque[_Conn]):
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.waiter: asyncio.Future[None] | None = None
        self.closed = self.idle = self.paused = self.reset = False
        self.idle_since = 0.0
        self.received = 0
        self._begin()

    def _begin(self) -> None:
        self.head: tuple[int, CIMultiDict[str], bool] | None = None
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.head_bytes = 0
        self.interim = 0
        self.trailers = 0
        self.body = bytearray()
        self.complete = False
        self.error: UpstreamError | None = None

    # --- llhttp's callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head is not None:  # a trailer of a chunked body: counted, not kept
            self.trailers += 1
            if self.trailers > MAX_HEADERS:
                raise BadResponse(f"over {MAX_HEADERS} trailer lines")
            return
        if len(self.headers) >= MAX_HEADERS:
            raise BadResponse(f"over {MAX_HEADERS} header lines")
        text = value.decode("latin-1").strip(" \t")
        if _BAD_VALUE.search(text):
            raise BadResponse("control character in a header")
        self.headers.add(name.decode("latin-1"), text)

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if not 100 <= status <= 599:
            raise BadResponse(f"status {status} out of range")
        if status < 200:  # an interim answer (100 Continue, 103 hints): the final one follows
            self.interim += 1
            if self.interim > MAX_INTERIM:
                raise BadResponse(f"over {MAX_INTERIM} interim (1xx) answers")
            self.headers = CIMultiDict()
            return
        keep = self.parser.should_keep_alive()
        self.head = (status, self.headers, keep)

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        if self.head is not None:
            self.complete = True

    # --- the transport's -----------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.idle:
            self.abort()
            return
        self.received += len(data)
        if self.head is None:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except UpstreamError as e:
            self._fail(e)
        except httptools.HttpParserError as e:
            # A callback's own error comes back wrapped: keep its message.
            cause = e.__context__ if isinstance(e.__context__, UpstreamError) else None
            self._fail(cause or BadResponse(str(e).split("\n", 1)[0] or type(e).__name__))
        if self.head is None and self.head_bytes > MAX_HEAD:
            self._fail(BadResponse(f"response head over {MAX_HEAD} bytes"))
        if len(self.body) > HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def _fail(self, e: UpstreamError) -> None:
        if self.error is None:
            self.error = e
        if self.transport is not None:
            self.transport.pause_reading()

    def eof_received(self) -> None:
        self._lost()

    def connection_lost(self, exc: Exception | None) -> None:
        self.reset = self.reset or exc is not None
        self._lost()

    def _lost(self) -> None:
        self.closed = True
        if self.idle:
            self.idle = False
            self.pool.remove(self)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        if self.closed:
            raise ServerDisconnected("the backend closed the connection")
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        timer = loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class Response:
    """Status and headers of an answer; the body is read whole or piece by piece as it comes."""

    def __init__(self, conn: _Conn, upstream: Upstream):
        assert conn.head is not None
        self._conn, self._upstream = conn, upstream
        self.status, self.headers, self._reusable = conn.head
        te = ",".join(self.headers.getall("Transfer-Encoding", ())).rstrip(" \t,").lower()
        # No length and no final chunked coding: the body runs to the close (RFC 9112 6.3).
        self._until_close = "Content-Length" not in self.headers and not te.endswith("chunked")
        self.done = False

    async def read(self) -> bytes:
        """The whole body, at most `Upstream.max_body` bytes."""
        parts, size = [], 0
        limit = self._upstream.max_body
        length = self.headers.get("Content-Length")
        if length is not None and length.isascii() and length.isdigit() and int(length) > limit:
            raise BadResponse(f"answer of {length} bytes, over {limit}")
        while chunk := await self.read_chunk():
            size += len(chunk)
            if size > limit:
                raise BadResponse(f"answer over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def read_chunk(self) -> bytes:
        """The body bytes that have arrived (waiting for some if none have); b"" at the end.
        Good data that came before a framing error is handed out first; the next read raises."""
        conn = self._conn
        while not self.done:
            if conn.body:
                data = bytes(conn.body)
                conn.body.clear()
                return data
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                self.done = True
                break
            if conn.closed:
                # A reset is no end of a body read to the close: the answer is cut short.
                if self._until_close and not conn.reset:
                    self.done = True
                    break
                raise ServerDisconnected("the backend closed the connection mid-answer")
            await conn.wait(self._upstream.read_timeout)
        return b""

    def close(self) -> None:
        """Back to the pool when the answer was read to its end; otherwise the connection is
        dropped, which tells a vLLM server to abort the request."""
        conn = self._conn
        if self.done and self._reusable and not conn.closed and conn.error is None:
            conn._begin()  # llhttp itself is ready for the next answer
            self._upstream._release(conn)
        else:
            conn.abort()

    def __enter__(self) -> Response:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Upstream:
    """POSTs to backends over kept-alive HTTP/1.1 connections, at most `max_idle` idle each."""

    def __init__(
        self,
        connect_timeout: float,
        read_timeout: float,
        max_idle: int = 256,
        max_body: int = MAX_BODY,
        idle_timeout: float = IDLE_TIMEOUT,
    ):
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.max_idle, self.max_body, self.idle_timeout = max_idle, max_body, idle_timeout
        self._pools: dict[tuple[str, int, bool], collections.deque[_Conn]] = {}
        self._targets: dict[str, tuple[tuple[str, int, bool], str, str, str]] = {}
        self._ssl: ssl.SSLContext | None = None

    def _target(self, url: str) -> tuple[tuple[str, int, bool], str, str, str]:
        """(host, port, tls), request line and Host header, server name, Basic auth: parsed
        once per URL."""
        got = self._targets.get(url)
        if got is None:
            u = urlsplit(url)
            tls = u.scheme == "https"
            host = u.hostname or ""
            head = f"POST {u.path or '/'} HTTP/1.1\r\nHost: {u.netloc.rpartition('@')[2]}\r\n"
            auth = ""
            if u.username is not None:  # credentials in the URL: Basic auth, as aiohttp does
                cred = f"{unquote(u.username)}:{unquote(u.password or '')}".encode()
                auth = f"Authorization: Basic {base64.b64encode(cred).decode()}\r\n"
            key = (host, u.port or (443 if tls else 80), tls)
            got = self._targets[url] = (key, head, host, auth)
        return got

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send; return once the status and headers are in. A kept-alive connection that the
        server closed before answering anything gets the request again on a fresh one: it
        cannot have been processed."""
        key, head, host, auth = self._target(url)
        text = [head, f"Content-Length: {len(body)}\r\n"]
        for k, v in headers.items():
            if "\n" in v or "\r" in v:  # would split the request: never send it
                raise ValueError(f"header {k} holds a line break")
            text.append(f"{k}: {v}\r\n")
        if auth and "Authorization" not in headers:
            text.append(auth)
        # aiohttp decoded the client's header bytes as UTF-8 (surrogateescape): the same bytes
        # go on; latin-1 would fail on any character past U+00FF.
        data = "".join(text).encode("utf-8", "surrogateescape") + b"\r\n" + body
        pool = self._pools.setdefault(key, collections.deque())
        if pool:
            # The oldest sit on the left: close those idle too long, then take the most
            # recently used, the least likely to be near the backend's keep-alive timeout.
            stale = asyncio.get_running_loop().time() - self.idle_timeout
            while pool and pool[0].idle_since < stale:
                old = pool.popleft()
                old.idle = False
                old.abort()
        if pool:
            conn = pool.pop()
            conn.idle = False
        else:
            conn = await self._connect(key, host, pool)
        while True:
            reused = conn.received > 0
            conn.received = 0
            try:
                assert conn.transport is not None
                conn.transport.write(data)
                return await self._head(conn)
            except ServerDisconnected:
                conn.abort()
                if not reused or conn.received:
                    raise
            except BaseException:  # timeout, bad answer, cancelled: the connection is unusable
                conn.abort()
                raise
            conn = await self._connect(key, host, pool)

    async def _connect(self, key: tuple[str, int, bool], sni: str, pool: Any) -> _Conn:
        loop = asyncio.get_running_loop()
        if key[2] and self._ssl is None:
            self._ssl = ssl.create_default_context()
        # Not asyncio.wait_for: on Python 3.11 a cancellation (the client left) that lands as
        # the connection completes is dropped, and the request then went on to the backend.
        async with asyncio.timeout(self.connect_timeout):
            _, conn = await loop.create_connection(
                lambda: _Conn(pool),
                key[0],
                key[1],
                ssl=self._ssl if key[2] else None,
                server_hostname=sni if key[2] else None,
            )
        return conn

    async def _head(self, conn: _Conn) -> Response:
        """Wait for the final answer's status and headers (llhttp skips interim 1xx ones)."""
        while conn.head is None:
            if conn.error is not None:
                raise conn.error
            await conn.wait(self.read_timeout)
        if conn.error is not None and not conn.body:
            raise conn.error
        return Response(conn, self)

    def _release(self, conn: _Conn) -> None:
        if len(conn.pool) < self.max_idle:
            conn.idle = True
            conn.idle_since = asyncio.get_running_loop().time()
            conn.pool.append(conn)
        else:
            conn.abort()

    def idle_connections(self) -> int:
        """Connections in the pool (open, waiting for a request)."""
        return sum(len(pool) for pool in self._pools.values())

    def close(self) -> None:
        for pool in self._pools.values():
            while pool:
                conn = pool.pop()
                conn.idle = False
                conn.abort()
