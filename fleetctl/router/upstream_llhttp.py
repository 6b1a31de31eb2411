"""The fast transport with llhttp (httptools) framing the answers instead of hand parsing."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import httptools
from multidict import CIMultiDict

from fleetctl.router.upstream import (
    _BAD_VALUE,
    HIGH_WATER,
    IDLE_TIMEOUT,
    MAX_BODY,
    MAX_HEAD,
    MAX_HEADERS,
    MAX_INTERIM,
    BadResponse,
    ServerDisconnected,
    Upstream,
    UpstreamError,
)


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
        self.body = bytearray()
        self.complete = False
        self.error: UpstreamError | None = None

    # --- llhttp's callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
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
    def __init__(self, conn: _Conn, upstream: LlhttpUpstream):
        assert conn.head is not None
        self._conn, self._upstream = conn, upstream
        self.status, self.headers, self._reusable = conn.head
        te = ",".join(self.headers.getall("Transfer-Encoding", ())).rstrip(" \t,").lower()
        # No length and no final chunked coding: the body runs to the close (RFC 9112 6.3).
        self._until_close = "Content-Length" not in self.headers and not te.endswith("chunked")
        self.done = False

    async def read(self) -> bytes:
        parts, size = [], 0
        limit = self._upstream.max_body
        length = self.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise BadResponse(f"answer of {length} bytes, over {limit}")
        while chunk := await self.read_chunk():
            size += len(chunk)
            if size > limit:
                raise BadResponse(f"answer over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def read_chunk(self) -> bytes:
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
                if self._until_close and not conn.reset:
                    self.done = True
                    break
                raise ServerDisconnected("the backend closed the connection mid-answer")
            await conn.wait(self._upstream.read_timeout)
        return b""

    def close(self) -> None:
        conn = self._conn
        if self.done and self._reusable and not conn.closed and conn.error is None:
            conn._begin()
            self._upstream._release(conn)  # type: ignore[arg-type]  # the same pool protocol
        else:
            conn.abort()

    def __enter__(self) -> Response:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LlhttpUpstream(Upstream):
    """The fast Upstream's pool, request writing and retry, with llhttp's framing."""

    def __init__(
        self,
        connect_timeout: float,
        read_timeout: float,
        max_idle: int = 256,
        max_body: int = MAX_BODY,
        idle_timeout: float = IDLE_TIMEOUT,
    ):
        super().__init__(connect_timeout, read_timeout, max_idle, max_body, idle_timeout)
        self._conn_class = _Conn

    async def _head(self, conn: Any) -> Any:
        while conn.head is None:
            if conn.error is not None:
                raise conn.error
            await conn.wait(self.read_timeout)
        if conn.error is not None and not conn.body:
            raise conn.error
        return Response(conn, self)
