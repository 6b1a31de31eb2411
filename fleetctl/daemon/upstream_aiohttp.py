"""The reference transport: aiohttp's client behind the same interface as the fast one."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import aiohttp
from multidict import CIMultiDictProxy

from fleetctl.daemon.upstream import (
    IDLE_TIMEOUT,
    MAX_BODY,
    MAX_HEAD,
    MAX_HEADERS,
    BadResponse,
    ServerDisconnected,
)

# aiohttp would add these on its own; the proxy sends only what the fast client sends.
_SKIP = frozenset({"User-Agent", "Accept", "Accept-Encoding", "Content-Type"})


def _mapped(e: BaseException) -> BaseException:
    """aiohttp's exception as the interface's: UpstreamError, TimeoutError or OSError."""
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return ServerDisconnected(str(e) or "the backend closed the connection")
    if isinstance(e, aiohttp.ClientConnectorError):
        return e.os_error
    if isinstance(e, TimeoutError):
        return TimeoutError(str(e))
    if isinstance(e, aiohttp.ClientPayloadError):
        # A body cut short by the backend's close is a disconnect; anything else malformed.
        if "not completed" in str(e) or "ConnectionResetError" in repr(e.__cause__):
            return ServerDisconnected(str(e))
        return BadResponse(str(e))
    if isinstance(e, aiohttp.ClientOSError):
        return ServerDisconnected(str(e))
    return BadResponse(str(e))


class AiohttpAnswer:
    def __init__(self, resp: aiohttp.ClientResponse, max_body: int):
        self._resp, self._max_body = resp, max_body
        self.status = resp.status

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return self._resp.headers

    async def read(self) -> bytes:
        length = self._resp.content_length
        if length is not None and length > self._max_body:
            raise BadResponse(f"answer of {length} bytes, over {self._max_body}")
        parts, size = [], 0
        while chunk := await self.read_chunk():
            size += len(chunk)
            if size > self._max_body:
                raise BadResponse(f"answer over {self._max_body} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def read_chunk(self) -> bytes:
        try:
            return await self._resp.content.readany()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _mapped(e) from e

    def close(self) -> None:
        """Back to the pool when read to the end; otherwise the connection is dropped."""
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()

    def __enter__(self) -> AiohttpAnswer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AiohttpUpstream:
    """The same contract as the fast Upstream: POST, a pool per backend with idle expiry, one
    retry when a reused connection was closed before the backend answered anything."""

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
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            trace = aiohttp.TraceConfig()
            trace.on_connection_reuseconn.append(_reused)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=0, keepalive_timeout=self.idle_timeout, ttl_dns_cache=300
                ),
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=self.connect_timeout, sock_read=self.read_timeout
                ),
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),  # never replay one backend's cookies
                skip_auto_headers=_SKIP,
                trace_configs=[trace],
                max_line_size=MAX_HEAD,
                max_field_size=MAX_HEAD,
                max_headers=MAX_HEADERS,
            )
        return self._session

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> AiohttpAnswer:
        for k, v in headers.items():
            if "\n" in v or "\r" in v:
                raise ValueError(f"header {k} holds a line break")
        session = self._open()
        for attempt in (1, 2):
            ctx = SimpleNamespace(reused=False)
            try:
                resp = await session.post(
                    url, data=body, headers=headers, trace_request_ctx=ctx, allow_redirects=False
                )
            except aiohttp.ServerDisconnectedError as e:
                # The keep-alive race: a reused connection closed before a byte of answer (a
                # partial answer comes as e.message; nothing, as aiohttp's default text).
                if ctx.reused and attempt == 1 and isinstance(e.message, str):
                    continue
                raise _mapped(e) from e
            except (TimeoutError, aiohttp.ClientError) as e:
                raise _mapped(e) from e
            if not 200 <= resp.status <= 599:  # llhttp takes any 3 digits: 099 included
                resp.close()
                raise BadResponse(f"status {resp.status} out of range")
            return AiohttpAnswer(resp, self.max_body)
        raise AssertionError("unreachable")

    def idle_connections(self) -> int:
        connector = self._session.connector if self._session is not None else None
        if connector is None:
            return 0
        conns: Any = connector._conns  # aiohttp keeps no public count of its pool
        return sum(1 for pool in conns.values() for proto, _ in pool if proto.is_connected())

    def close(self) -> None:
        """Closes every connection now; the session is done (a sync call, as the fast one)."""
        if self._session is not None and self._session.connector is not None:
            # close() closes the transports at once and returns a coroutine that only waits
            # for their ends; its synchronous half is what a sync close needs.
            self._session.connector._close(abort_ssl=True)
        self._session = None


async def _reused(session: object, ctx: SimpleNamespace, params: object) -> None:
    ctx.trace_request_ctx.reused = True
