"""Request intake: the API key, the body within its limits, then the pure parse to a Request."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from fleetctl.daemon.tokens import TokenCounter
from fleetctl.routing.request import ClientError, Parsed, parse_request
from fleetctl.routing.types import Backend, OutputEstimator, Request


def error_response(e: ClientError) -> web.Response:
    """A ClientError as the client gets it."""
    resp = web.json_response(e.body(), status=e.status)
    if e.status == 408:  # the rest of the body may still come: drop the connection
        resp.force_close()
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

    def index(self, backends: list[Backend]) -> None:
        """Which models the backends serve, in which formats (again after a reload)."""
        served: dict[str, set[str]] = {}
        for b in backends:
            served.setdefault(b.model, set()).add(b.variant)
        self.served = {m: frozenset(v) for m, v in served.items()}

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
        if p.stripped:  # the router's own fields dropped: every path forwards these bytes
            raw = json.dumps(p.body, ensure_ascii=False).encode()
        m = await self.tokens.measure(p.model, p.body, chat, self.blocks)
        req = p.request(m.tokens, m.chars, self.estimator.estimate(p.model), time.monotonic())
        req.max_tokens = p.max_tokens  # the length filter needs what the client asked for
        req.blocks = m.blocks
        return raw, p, req
