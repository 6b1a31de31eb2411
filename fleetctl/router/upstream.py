"""A lean HTTP/1.1 client for the router's POSTs to its backends: keep-alive pool, no extras."""

from __future__ import annotations

import asyncio
import base64
import collections
import re
import ssl
from typing import Any
from urllib.parse import unquote, urlsplit

from multidict import CIMultiDict

MAX_HEAD = 64 * 1024  # status line and headers; also a chunk-size line and the trailers
MAX_INTERIM = 8  # 1xx answers before the final one
MAX_HEADERS = 100  # header lines in an answer (as Python's http.client)
MAX_BODY = 128 * 2**20  # an answer read whole (not streamed): the router holds it in memory
HIGH_WATER = 256 * 1024  # unread body bytes before the socket stops being read
# A pooled connection idle this long is closed, not reused: below the backend's keep-alive
# timeout (uvicorn's, so vLLM's, is 5 s), so that a request never races the backend's close.
IDLE_TIMEOUT = 4.0

# RFC 9112: status-line = HTTP-version SP 3DIGIT SP [reason]; ASCII digits only (str.isdigit
# takes "²", which int() refuses).
_STATUS = re.compile(r"HTTP/1\.([01]) ([1-5][0-9][0-9])(?: [^\x00-\x08\x0a-\x1f\x7f]*)?")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header name
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # controls but HTAB: CR and LF included
_LENGTH = re.compile(r"[0-9]{1,18}")  # up to 10^18 bytes, and int() never refuses it
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\r\n]*)?")


class UpstreamError(Exception):
    """The backend broke the exchange: it closed early or answered something not HTTP/1.x.
    Every way an answer can be malformed ends here, never in another exception."""


class ServerDisconnected(UpstreamError):
    pass


class BadResponse(UpstreamError):
    pass


class _Conn(asyncio.Protocol):
    """One connection. The protocol only buffers; parsing happens in the reading coroutine."""

    def __init__(self, pool: collections.deque[_Conn]):
        self.pool = pool
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.idle = False  # in the pool
        self.idle_since = 0.0  # loop time it went into the pool
        self.received = 0  # bytes of the current response so far
        self.paused = False
        self.reset = False  # lost by an error (a reset), not by an orderly close

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.idle:  # an idle connection must stay silent
            self.abort()
            return
        self.buf += data
        self.received += len(data)
        if len(self.buf) > HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()  # a slow client: let TCP push back on the backend
            self.paused = True
        self._wake()

    def eof_received(self) -> None:
        self._lost()

    def connection_lost(self, exc: Exception | None) -> None:
        self.reset = self.reset or exc is not None
        self._lost()

    def _lost(self) -> None:
        self.closed = True
        if self.idle:  # closed by the server while idle: forget it
            self.idle = False
            self.pool.remove(self)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until more bytes (or the end) arrive; TimeoutError after `timeout` of silence."""
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

    def __init__(
        self,
        conn: _Conn,
        upstream: Upstream,
        status: int,
        headers: CIMultiDict[str],
        keep_alive: bool = True,  # HTTP/1.1; HTTP/1.0 answers close
    ):
        self._conn, self._upstream = conn, upstream
        self.status, self.headers = status, headers
        self._reusable = keep_alive and "close" not in headers.get("Connection", "").lower()
        te = ",".join(headers.getall("Transfer-Encoding", ())).rstrip(" \t,")
        # Only a final `chunked` coding frames the body (RFC 9112 6.1); any other reads to close.
        self._chunked = te.lower().endswith("chunked") and te[-8:-7] in ("", ",", " ", "\t")
        length = _content_length(headers)
        if te and length is not None:  # RFC 9112 6.3: a smuggling attempt, or a bug
            raise BadResponse("both Transfer-Encoding and Content-Length")
        self._error: UpstreamError | None = None  # found after data still to be handed out
        self._trailers = 0  # bytes of trailers so far
        # _left: bytes of the body (or of the current chunk) still to come; below 0, what the
        # chunked parser expects next: -1 a size line, -2 the CRLF after data, -3 trailers.
        if status in (204, 304):
            self._left, self._chunked = 0, False
        elif self._chunked:
            self._left = -1
        elif length is not None:
            self._left = length
        else:
            self._left, self._reusable = -4, False  # -4: until the server closes
        self.done = self._left == 0

    async def read(self) -> bytes:
        """The whole body, at most `Upstream.max_body` bytes."""
        if self._left > self._upstream.max_body:
            raise BadResponse(f"answer of {self._left} bytes, over {self._upstream.max_body}")
        parts, size = [], 0
        while chunk := await self.read_chunk():
            size += len(chunk)
            if size > self._upstream.max_body:
                raise BadResponse(f"answer over {self._upstream.max_body} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def read_chunk(self) -> bytes:
        """The body bytes that have arrived (waiting for some if none have); b"" at the end."""
        conn = self._conn
        while not self.done:
            if self._error is not None:
                raise self._error
            data = self._take(conn.buf)
            if data or self.done:
                return data
            if conn.closed and self._left == -4:
                if conn.reset:  # a reset is no end of the body: the answer is cut short
                    raise ServerDisconnected("the backend reset the connection mid-answer")
                self.done = True
                break
            await conn.wait(self._upstream.read_timeout)
        return b""

    def _take(self, buf: bytearray) -> bytes:
        if not self._chunked:
            if self._left == -4 or len(buf) <= self._left:
                data = bytes(buf)
                buf.clear()
            else:
                data = bytes(buf[: self._left])
                del buf[: self._left]
            if self._left != -4:
                self._left -= len(data)
                self.done = self._left == 0
            return data
        out: list[bytes] = []
        try:
            self._take_chunks(buf, out)
        except BadResponse as e:
            if not out:
                raise
            self._error = e  # hand out the good data first; the next read raises
        return b"".join(out)

    def _take_chunks(self, buf: bytearray, out: list[bytes]) -> None:
        while not self.done:
            if self._left > 0:  # inside a chunk
                if not buf:
                    break
                piece = bytes(buf[: self._left])
                del buf[: len(piece)]
                out.append(piece)
                self._left -= len(piece)
                if self._left:
                    break
                self._left = -2
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    raise BadResponse("chunk line too long")
                break
            if end > MAX_HEAD:
                raise BadResponse("chunk line too long")
            line = bytes(buf[:end])
            del buf[: end + 2]
            if self._left == -2:  # the CRLF that ends a chunk's data
                if line:
                    raise BadResponse("chunk data overran its size")
                self._left = -1
            elif self._left == -1:
                # int(x, 16) also takes "-5", "0x5", " 5" and "5_0": only hex digits here.
                size = _CHUNK_SIZE.fullmatch(line)
                if size is None:
                    raise BadResponse(f"bad chunk size {line[:20]!r}")
                self._left = int(size[1], 16) or -3
            elif not line:  # -3: trailers end with an empty line
                self.done = True
            else:
                self._trailers += len(line) + 2
                if self._trailers > MAX_HEAD:
                    raise BadResponse("trailers too long")

    def close(self) -> None:
        """Back to the pool when the answer was read to its end; otherwise the connection is
        dropped, which tells a vLLM server to abort the request."""
        conn = self._conn
        if self.done and self._reusable and not conn.closed and not conn.buf:
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
        self._conn_class: Any = _Conn  # the connection protocol (its framing)

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
        _, conn = await asyncio.wait_for(
            loop.create_connection(
                lambda: self._conn_class(pool),
                key[0],
                key[1],
                ssl=self._ssl if key[2] else None,
                server_hostname=sni if key[2] else None,
            ),
            self.connect_timeout,
        )
        return conn

    async def _head(self, conn: _Conn) -> Response:
        buf = conn.buf
        for _ in range(MAX_INTERIM + 1):
            while (end := buf.find(b"\r\n\r\n")) < 0:
                if len(buf) > MAX_HEAD:
                    raise BadResponse(f"response head over {MAX_HEAD} bytes")
                await conn.wait(self.read_timeout)
            if end > MAX_HEAD:
                raise BadResponse(f"response head over {MAX_HEAD} bytes")
            lines = buf[:end].decode("latin-1").split("\r\n")
            del buf[: end + 4]
            status = _STATUS.fullmatch(lines[0])
            if status is None:
                raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:40]!r}")
            if not status[2].startswith("1"):  # skip interim answers (100 Continue, 103 hints)
                return Response(conn, self, int(status[2]), _headers(lines[1:]), status[1] == "1")
        raise BadResponse(f"over {MAX_INTERIM} interim (1xx) answers")

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


def _headers(lines: list[str]) -> CIMultiDict[str]:
    """Header lines to a multidict; names are tokens and values hold no CR, LF or other
    control character, so they can be written into the client's answer as they are."""
    if len(lines) > MAX_HEADERS:
        raise BadResponse(f"over {MAX_HEADERS} header lines")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise BadResponse(f"bad header line {line[:40]!r}")
        value = value.strip(" \t")
        if _BAD_VALUE.search(value):
            raise BadResponse(f"control character in header {name[:40]}")
        headers.add(name, value)
    return headers


def _content_length(headers: CIMultiDict[str]) -> int | None:
    """The body length, or None; repeated values must agree (RFC 9112 6.3)."""
    values = {v.strip() for h in headers.getall("Content-Length", []) for v in h.split(",")}
    if not values:
        return None
    if len(values) > 1 or not _LENGTH.fullmatch(next(iter(values))):
        raise BadResponse(f"bad Content-Length {', '.join(sorted(values))[:40]!r}")
    return int(values.pop())
