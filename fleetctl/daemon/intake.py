"""Request intake: protocol errors, the API key, the body within its limits, then the pure parse
to a Request."""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field, replace

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong

from fleetctl.base.limits import SHOWN
from fleetctl.daemon.adapters import Loader, with_adapters
from fleetctl.daemon.relay import header_value
from fleetctl.daemon.tokens import TokenCounter
from fleetctl.routing.request import ClientError, Parsed, parse_request
from fleetctl.routing.types import Backend, OutputEstimator, Request


def error_response(e: ClientError) -> web.Response:
    """A ClientError as the client gets it."""
    resp = web.json_response(e.body(), status=e.status)
    if e.status == 408:  # the rest of the body may still come: drop the connection
        resp.force_close()
    return resp


class JsonErrors(web.RequestHandler):
    """A connection whose protocol errors (a request aiohttp's HTTP parser refuses: a header
    too long, too many, an unknown method, Content-Length beside Transfer-Encoding) are
    answered in the OpenAI error shape, with the status that fits, as every other answer of
    route-serve is. aiohttp writes those answers in handle_error, before any route or
    middleware sees the request."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises once output began
        resp = error_response(protocol_error(status, exc))
        resp.force_close()  # what follows on the connection cannot be framed
        return resp


def protocol_error(status: int, exc: BaseException | None) -> ClientError:
    """What aiohttp's parser refused (`exc`, answered `status` by aiohttp), as a ClientError.
    The message is ours: aiohttp's quotes the client's bytes."""
    if status >= 500 or not isinstance(exc, HttpProcessingError):
        return ClientError(500, "internal error", "server_error")
    line = exc.args[0] if exc.args else b""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "its limit of"
        # A header line starts with its name, which never holds "/": this is the target.
        if isinstance(line, bytes | bytearray) and line[:1] == b"/":
            return ClientError(414, f"request target over {limit} bytes")
        return ClientError(431, f"request header over {limit} bytes")
    first = exc.message.splitlines()[0].rstrip(":") if exc.message else type(exc).__name__
    if first.startswith("Too many headers"):
        return ClientError(431, "too many request header lines")
    if isinstance(exc, BadHttpMethod) and "HTTPS" not in first:  # TLS to a plain port: 400
        return ClientError(501, "unknown HTTP method")
    return ClientError(400, f"malformed HTTP request: {header_value(first)[:SHOWN]}")


class JsonErrorServer(web.Server):
    """aiohttp's low-level server, with JsonErrors connections."""

    def __call__(self) -> web.RequestHandler:
        return JsonErrors(self, loop=self._loop, **self._kwargs)


class JsonErrorRunner(web.AppRunner):
    """An AppRunner whose connections are JsonErrors. aiohttp takes the connection class from
    Server.__call__ alone, so the server it builds becomes a JsonErrorServer (the same
    object, one method more)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = JsonErrorServer
        server.request_handler = functools.partial(json_refusals, server.request_handler)
        return server


async def json_refusals(
    handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]], request: web.BaseRequest
) -> web.StreamResponse:
    """The application's `handler`, with what aiohttp raises past its parser but outside any
    route (aiohttp writes it as plain text) in the OpenAI error shape: a target no route can
    match, not being a path (`OPTIONS *`, `CONNECT host:port`), or an Expect header other than
    100-continue. route-serve's own handlers return their errors, so nothing else comes here;
    a request that goes well pays one await for it."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        what = "request target not served by fleetctl route-serve" if e.status == 404 else e.reason
        resp = error_response(ClientError(e.status, what))
        resp.force_close()  # a body the client may still send cannot be framed as a request
        return resp


def authorize(api_key: str | None, request: web.Request) -> None:
    """Raises a 401 unless the client sent `api_key` as a Bearer token (or none is set)."""
    if api_key is None:
        return
    got = request.headers.get("Authorization", "")
    token = got[7:] if got.startswith("Bearer ") else ""
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        raise ClientError(401, "invalid or missing API key", "authentication_error")


@dataclass
class Intake:
    """What a client's request becomes before it is queued: its bytes (forwarded as received,
    less the fields only the router sets), its parsed fields, and the Request routing sees."""

    # The limits are DaemonConfig's (daemon.py), passed in.
    api_key: str | None
    max_body_bytes: int
    body_timeout_s: float
    priority_classes: int
    max_json_depth: int
    tokens: TokenCounter
    estimator: OutputEstimator
    known_formats: Collection[str]  # the catalog's: a precision hint names one
    served: Mapping[str, frozenset[str]] = field(default_factory=dict)  # model -> its formats
    # Whether each request's prompt is hashed into blocks (Request.blocks): only for a policy
    # that reads a prefix index, as it costs ~0.4 us per 64 characters (~20 us for a
    # 1K-token prompt, benchmarks/prefix_index.py).
    blocks: bool = False
    # The inventory's LoRA adapters (name -> base model): a request may name one as its model.
    adapters: Mapping[str, str] = field(default_factory=dict)
    backends: list[Backend] = field(default_factory=list)  # the router's (changed in place)
    loader: Loader = field(default_factory=Loader)  # adapters loaded at runtime, if any

    def index(self, backends: list[Backend]) -> None:
        """Which models the backends serve, in which formats (again after a reload)."""
        served: dict[str, set[str]] = {}
        for b in backends:
            served.setdefault(b.model, set()).add(b.variant)
        self.served = with_adapters({m: frozenset(v) for m, v in served.items()}, self.adapters)
        self.backends = backends

    def use_adapters(self, adapters: Mapping[str, str], loader: Loader | None = None) -> None:
        """Take requests for these adapters (name -> base model) from now on, loading the
        ones `loader` may load where no server has them."""
        self.adapters = adapters
        self.loader = loader or Loader()
        self.index(self.backends)

    async def read(self, request: web.Request, chat: bool) -> tuple[bytes, Parsed, Request]:
        authorize(self.api_key, request)
        try:
            async with asyncio.timeout(self.body_timeout_s):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ClientError(413, f"request body over {self.max_body_bytes} bytes") from None
        except TimeoutError:
            raise ClientError(
                408, f"request body not received within {self.body_timeout_s:g} s"
            ) from None
        p = parse_request(
            raw,
            request.headers,
            chat,
            self.served,
            self.known_formats,
            self.priority_classes,
            self.max_json_depth,
        )
        adapter = p.model if p.model in self.adapters else ""
        if adapter:  # routed as its base model's request; its body keeps the adapter's name
            await self.loader.ensure(adapter, self.adapters[adapter], self.backends)
            p = replace(p, model=self.adapters[adapter])
        if p.stripped:  # the router's own fields dropped: every path forwards these bytes
            raw = json.dumps(p.body, ensure_ascii=False).encode()
        m = await self.tokens.measure(p.model, p.body, chat, self.blocks)
        req = p.request(m.tokens, m.chars, self.estimator.estimate(p.model), time.monotonic())
        req.max_tokens = p.max_tokens  # the length filter needs what the client asked for
        req.blocks = m.blocks
        req.adapter = adapter
        return raw, p, req
