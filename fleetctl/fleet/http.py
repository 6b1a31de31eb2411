"""fleetctl's one client for small GETs to its servers: /metrics scrapes, /health, /v1/models.

The router's scrapes use `Client` (async, kept-alive connections); `fleetctl health` and
apply's health waits run in thread pools and use `get`, the same GET run on its own loop. Both
share the timeout, the size bound and one error type whose text is a short reason
("connection refused", "timed out after 3 s"). The proxied requests themselves go through the
router's transport (fleetctl/daemon/transport.py), which streams and is tuned per request.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

MAX_ANSWER = 8 * 2**20  # vLLM's /metrics page is ~50 KB; a bigger answer is not a server's


class HttpError(Exception):
    """No usable answer: unreachable, timed out, cut short, too big. The text is one line."""


class HttpTimeout(HttpError):
    """No whole answer within the limit (the server may be busy rather than gone)."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not."""
        return json.loads(self.body)


class Client:
    """GETs (and the rare POST) over one aiohttp session: kept-alive connections, no cookies,
    a bounded answer."""

    def __init__(self, timeout: float, max_bytes: int = MAX_ANSWER):
        self.timeout, self.max_bytes = timeout, max_bytes
        self._session: aiohttp.ClientSession | None = None

    async def get(
        self, url: str, headers: dict[str, str] | None = None, timeout: float | None = None
    ) -> Reply:
        return await self._request("GET", url, headers, timeout)

    async def post(
        self,
        url: str,
        body: object,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Reply:
        """POST `body` as JSON."""
        return await self._request("POST", url, headers, timeout, body)

    async def _request(
        self,
        method: str,
        url: str,
        headers: dict[str, str] | None,
        timeout: float | None,
        payload: object = None,
    ) -> Reply:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4),
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=True,
            )
        limit = self.timeout if timeout is None else timeout
        try:
            async with self._session.request(
                method,
                url,
                headers=headers,
                json=payload,
                timeout=aiohttp.ClientTimeout(total=limit),
                allow_redirects=False,
            ) as resp:
                if (resp.content_length or 0) > self.max_bytes:
                    raise HttpError(f"answer of {resp.content_length} bytes, over the limit")
                # To the end: `content.read(n)` returns what has arrived so far, which on a busy
                # machine was the first part of a /metrics page, before any vllm: series.
                body = bytearray()
                async for chunk in resp.content.iter_any():
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise HttpError(f"answer over {self.max_bytes} bytes")
                return Reply(resp.status, bytes(body))
        except TimeoutError:
            raise HttpTimeout(f"timed out after {limit:g} s") from None
        except aiohttp.ClientConnectorError as e:
            raise HttpError(_os_reason(e.os_error)) from None
        except (aiohttp.ClientError, OSError) as e:
            raise HttpError(_reason(e)) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def get(
    url: str, timeout: float, headers: dict[str, str] | None = None, max_bytes: int = MAX_ANSWER
) -> Reply:
    """One GET from synchronous code (a worker thread): the same client on a loop of its own."""

    async def once() -> Reply:
        client = Client(timeout, max_bytes)
        try:
            return await client.get(url, headers)
        finally:
            await client.close()

    return asyncio.run(once())


def _os_reason(e: OSError) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    return (e.strerror or str(e) or type(e).__name__).lower()


def _reason(e: Exception) -> str:
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    if isinstance(e, aiohttp.InvalidURL):
        return f"invalid URL {e}"
    text = str(e).split("\n", 1)[0]
    return text or type(e).__name__
