"""`fleetctl route-serve`: an OpenAI-compatible proxy that routes by the seed's rules.

Each request is parsed once, classified (tokens, hints, priority, session), queued in the
same Scheduler the simulator uses, and proxied to the chosen backend byte for byte: SSE
chunks are written to the client as they arrive. Connection failures and 5xx answers before
the first byte are retried on another backend; a backend that keeps failing is ejected.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import aiohttp
from aiohttp import web

from fleetctl.router.live import LiveState, cancel
from fleetctl.routing.policy import Policy
from fleetctl.routing.request import (
    MAX_JSON_DEPTH,
    PRIORITY_CLASSES,
    ClientError,
    parse_request,
)
from fleetctl.routing.scheduler import Scheduler, account, first_token, release
from fleetctl.router.shared import RedisShared
from fleetctl.router.telemetry import RouterMetrics
from fleetctl.router.tokens import TokenCounter
from fleetctl.routing.types import Backend, Decision, OutputEstimator, Request
from fleetctl.router.upstream import Response, Upstream, UpstreamError

log = logging.getLogger("fleetctl.router")

RETRY_STATUSES = range(500, 600)
HOP_HEADERS = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "host",
    "content-encoding",
}


@dataclass
class DaemonConfig:
    max_body_bytes: int = 32 * 2**20
    upstream_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    queue_timeout_s: float = 300.0
    max_retries: int = 2
    api_key: str | None = None  # clients must send it as a Bearer token
    backend_api_key: str | None = None  # sent to backends instead of the client's header
    priority_classes: int = PRIORITY_CLASSES  # X-Priority from 0 to this minus one
    max_json_depth: int = MAX_JSON_DEPTH
    # A slow client cannot hold a connection: its request body must arrive within this
    # (408 otherwise), and its request head within idle_timeout_s of the connection opening
    # or of its last answer (serve.py), or the connection is closed.
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 75.0  # above the 60 s idle timeout of the usual load balancers
    # After an early answer (408, 413), the unread rest of a body is read and dropped this
    # long, so that the client gets the answer rather than a reset; then the connection closes.
    linger_s: float = 2.0


def _answer(body: bytes) -> dict[str, Any] | None:
    """A 200 answer's JSON object, or None when it is not one (a broken backend). Parsed
    whole: only a parse proves it is JSON, and an answer holds the generated text, not the
    prompt, so it is small (~10 us for a 256-token completion)."""
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return answer if isinstance(answer, dict) else None


def _count(value: object) -> TypeGuard[int]:
    """A token count a backend may report: an int (not a bool) below 2**31."""
    return type(value) is int and 0 <= value < 2**31


def _header_value(value: str) -> str:
    """`value` with CR, LF and other control characters escaped: whatever reaches a response
    header cannot split it, even when validation upstream missed one."""
    if value.isprintable():
        return value
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in value)


@dataclass
class Waiter:
    request: Request
    future: asyncio.Future[Decision]


@dataclass
class Router:
    backends: list[Backend]
    scheduler: Scheduler
    config: DaemonConfig = field(default_factory=DaemonConfig)
    estimator: OutputEstimator = field(default_factory=OutputEstimator)
    live: LiveState | None = None
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    shared: RedisShared | None = None  # session pins and the TTFT window, across replicas
    tokens: TokenCounter = field(default_factory=TokenCounter)
    waiting: dict[int, Waiter] = field(default_factory=dict)
    _ids: int = 0
    _kick: asyncio.Event = field(default_factory=asyncio.Event)
    _session: aiohttp.ClientSession | None = None  # for /metrics scrapes
    _upstream: Upstream | None = None  # for the proxied requests: cheaper than aiohttp's client
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    known_formats: frozenset[str] = frozenset()  # the catalog's: a precision hint names one
    _served: dict[str, frozenset[str]] = field(default_factory=dict)  # model -> its formats

    def __post_init__(self) -> None:
        self._index()

    def _index(self) -> None:
        served: dict[str, set[str]] = {}
        for b in self.backends:
            served.setdefault(b.model, set()).add(b.variant)
        self._served = {m: frozenset(v) for m, v in served.items()}

    @property
    def policy(self) -> Policy:
        return self.scheduler.policy

    # --- lifecycle ---------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._upstream = Upstream(self.config.connect_timeout_s, self.config.upstream_timeout_s)
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.config.connect_timeout_s,
            sock_read=self.config.upstream_timeout_s,
        )
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        # No cookie jar: a proxy must not keep a backend's cookies and replay them to the
        # backends on other clients' requests.
        self._session = aiohttp.ClientSession(
            timeout=timeout,
            connector=connector,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._tasks.append(asyncio.create_task(self._dispatcher()))
        if self.shared is not None:
            try:
                await self.shared.check()
            except Exception as e:  # keep serving; affinity falls back to this replica's memory
                log.error(
                    "session store unreachable (%s); using this replica's memory", type(e).__name__
                )
            self._tasks.append(asyncio.create_task(self._sync_ttft()))
        if self.live is not None:
            self._tasks.append(asyncio.create_task(self.live.run(self._session)))

    async def _stop(self, app: web.Application) -> None:
        for t in self._tasks:
            await cancel(t)
        if self._session is not None:
            await self._session.close()
        if self._upstream is not None:
            self._upstream.close()
        if self.shared is not None:
            await self.shared.close()

    async def _sync_ttft(self) -> None:
        """Rebuild the aging median from every replica's samples once a second."""
        assert self.shared is not None
        window = self.scheduler.aging.window_s
        while True:
            await asyncio.sleep(1.0)
            try:
                self.scheduler.ttft = await self.shared.ttft_median(window)
            except Exception as e:
                log.warning("session store: %s", type(e).__name__)

    def _wake(self) -> None:
        """Something changed (a request ended or failed): let the dispatcher place what waits.
        Nothing waits almost always; then waking it would cost a task switch and a new timer
        per request for nothing."""
        if self.waiting:
            self._kick.set()

    def _background(self, coro: Any) -> None:
        """Fire and forget (a shared-store write), keeping a reference until it ends."""
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.remove(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("session store: %s", type(task.exception()).__name__)

    def replace_backends(self, fresh: list[Backend]) -> None:
        """Reload: keep the live counters of servers that stay; in-flight requests finish."""
        old = {b.name: b for b in self.backends}
        merged = []
        for b in fresh:
            keep = old.get(b.name)
            if keep is not None:
                b.outstanding, b.reserved_tokens, b.pending_prefill = (
                    keep.outstanding,
                    keep.reserved_tokens,
                    keep.pending_prefill,
                )
                b.running, b.waiting, b.kv_usage, b.healthy = (
                    keep.running,
                    keep.waiting,
                    keep.kv_usage,
                    keep.healthy,
                )
            merged.append(b)
        self.backends[:] = merged
        self._index()
        if self.live is not None:
            self.live.backends = self.backends
        self._kick.set()

    # --- queueing ----------------------------------------------------------------------------

    async def _dispatcher(self) -> None:
        """Places queued requests whenever something changes, and at least every 50 ms (aging)."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), 0.05)
            self._kick.clear()
            self._dispatch()

    def _dispatch(self) -> None:
        if not len(self.scheduler):
            return
        before = self.scheduler.boosts
        sent, rejected = self.scheduler.dispatch(time.monotonic(), self.backends)
        if self.scheduler.boosts > before:
            self.metrics.boosts.inc(by=self.scheduler.boosts - before)
        for d in (*sent, *rejected):
            w = self.waiting.pop(d.request.id, None)  # type: ignore[arg-type]
            if w is not None and not w.future.done():
                w.future.set_result(d.decision)
            elif d.decision.backend is not None:
                release(d.decision.backend, d.request, first_token_seen=False)  # client gone

    async def place(self, req: Request) -> Decision:
        self._ids += 1
        req.id = self._ids
        fut: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self.waiting[req.id] = Waiter(req, fut)
        self.scheduler.submit(req)
        self._dispatch()  # most requests are placed right here, without a task switch
        if fut.done():
            return fut.result()
        try:
            return await asyncio.wait_for(fut, self.config.queue_timeout_s)
        except TimeoutError:
            raise ClientError(
                503, "no backend had room in time; try again later", "server_error"
            ) from None
        finally:
            if not fut.done():  # timed out or the client went away: leave the queue
                self.waiting.pop(req.id, None)
                self.scheduler.remove(req)

    # --- handlers ------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, chat=True)

    def _authorize(self, request: web.Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        got = request.headers.get("Authorization", "")
        token = got[7:] if got.startswith("Bearer ") else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise ClientError(401, "invalid or missing API key", "authentication_error")

    async def _read(
        self, request: web.Request, chat: bool
    ) -> tuple[bytes, dict[str, Any], Request]:
        self._authorize(request)
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ClientError(
                413, f"request body over {self.config.max_body_bytes} bytes"
            ) from None
        except TimeoutError:
            raise ClientError(
                408, f"request body not received within {self.config.body_timeout_s:g} s"
            ) from None
        p = parse_request(
            raw,
            request.headers,
            chat,
            self._served,
            self.known_formats,
            self.config.priority_classes,
            self.config.max_json_depth,
        )
        prompt_tokens, chars = await self.tokens.count(p.model, p.body, chat)
        req = Request(
            0,
            p.model,
            prompt_tokens,
            p.max_tokens or self.estimator.estimate(p.model),
            p.priority,
            p.session,
            p.precision,
            p.strict,
            time.monotonic(),
            prompt_chars=chars,
        )
        body = p.body
        return raw, body, req

    async def _proxy(self, request: web.Request, chat: bool) -> web.StreamResponse:
        started = time.monotonic()
        try:
            raw, body, req = await self._read(request, chat)
            sessions = getattr(self.policy, "sessions", None)
            if self.shared is not None and req.session and sessions is not None:
                try:
                    await self.shared.load_pin(sessions, req.session)
                except Exception as e:
                    log.warning("session store: %s", type(e).__name__)
            decision = await self.place(req)
            if self.shared is not None and req.session and sessions is not None:
                pin = sessions.get(req.session)
                if pin is not None:
                    self._background(self.shared.save_pin(req.session, pin))
        except ClientError as e:
            self.metrics.requests.inc("", "", "bad-request", str(e.status))
            return e.response()
        if decision.backend is None:
            self.metrics.requests.inc(req.model, "", "rejected", "400")
            return ClientError(400, decision.reason, "invalid_request_error").response()
        stream = bool(body.get("stream"))
        tried: list[Backend] = []
        backend: Backend | None = decision.backend
        reason = decision.reason.split(" ttft~")[0]
        while backend is not None:
            tried.append(backend)
            outcome = await self._forward(request, raw, req, backend, stream, chat, started)
            if isinstance(outcome, web.StreamResponse):
                status = str(outcome.status)
                self.metrics.requests.inc(req.model, backend.node_class, reason, status)
                self._wake()
                return outcome
            # Failed before any byte reached the client: try another backend.
            if len(tried) > self.config.max_retries:
                break
            backend = self._retry_target(req, tried)
            if backend is not None:
                self.metrics.retries.inc(req.model)
                account(backend, req)
                reason = "retry"
        self.metrics.requests.inc(req.model, tried[-1].node_class, reason, "502")
        self._wake()
        return ClientError(
            502, "every backend tried failed before answering", "server_error"
        ).response()

    def _retry_target(self, req: Request, tried: list[Backend]) -> Backend | None:
        pool, _ = self.policy.eligible(req, [b for b in self.backends if b not in tried])
        if not pool:
            return None
        return self.policy.choose(req, pool).backend

    async def _forward(
        self,
        request: web.Request,
        raw: bytes,
        req: Request,
        b: Backend,
        stream: bool,
        chat: bool,
        started: float,
    ) -> web.StreamResponse | None:
        """Send to `b`; None when it failed before the first byte (the caller may retry)."""
        assert self._upstream is not None
        headers = {"Content-Type": "application/json"}
        if self.config.backend_api_key:
            headers["Authorization"] = f"Bearer {self.config.backend_api_key}"
        elif self.config.api_key is None and "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]  # the client's, for vLLM
        url = b.name + ("/v1/chat/completions" if chat else "/v1/completions")
        try:
            up = await self._upstream.post(url, raw, headers)
        except asyncio.CancelledError:
            release(b, req, first_token_seen=False)  # the client left while we connected
            raise
        except (TimeoutError, UpstreamError, OSError):
            self._failed(b, req)
            return None
        except Exception:  # a bug here, not the backend's: still never leave the counters raised
            release(b, req, first_token_seen=False)
            raise
        # Leaving this block before the answer's end closes the upstream connection: vLLM
        # sees a disconnect and aborts the request, which is what a client that went away needs.
        with up:
            if up.status in RETRY_STATUSES:
                with contextlib.suppress(UpstreamError, TimeoutError):
                    await up.read()
                self._failed(b, req)
                return None
            if self.live is not None:
                self.live.succeeded(b)
            if not stream or up.status != 200:
                return await self._relay_whole(request, up, req, b, started)
            return await self._relay_stream(request, up, req, b, started)

    async def _relay_whole(
        self,
        request: web.Request,
        up: Response,
        req: Request,
        b: Backend,
        started: float,
    ) -> web.StreamResponse | None:
        try:
            data = await up.read()
        except asyncio.CancelledError:
            release(b, req, first_token_seen=False)
            raise
        except (TimeoutError, UpstreamError):
            self._failed(b, req)
            return None
        answer = _answer(data) if up.status == 200 else None
        if up.status == 200 and answer is None:
            log.warning("backend %s answered 200 with a body that is not a JSON object", b.name)
            self._failed(b, req)
            return None
        self._first(b, req, started)
        out = web.Response(body=data, status=up.status, headers=self._headers(up, b))
        self._done(b, req, started, answer)
        return out

    async def _relay_stream(
        self,
        request: web.Request,
        up: Response,
        req: Request,
        b: Backend,
        started: float,
    ) -> web.StreamResponse | None:
        out = web.StreamResponse(status=up.status, headers=self._headers(up, b))
        # Whatever has arrived, at once (b"" at the end): this loop runs once per chunk.
        read = up.read_chunk
        try:
            first = await read()
        except asyncio.CancelledError:
            release(b, req, first_token_seen=False)
            raise
        except (TimeoutError, UpstreamError):
            self._failed(b, req)
            return None  # nothing reached the client yet: retry elsewhere
        self._first(b, req, started)
        tokens = 0
        released = False
        try:
            await out.prepare(request)
            write = out.write
            chunk = first
            while chunk:
                tokens += chunk.count(b"data: {")
                await write(chunk)  # as it arrives: no buffering
                try:
                    chunk = await read()
                except (TimeoutError, UpstreamError) as e:
                    # The backend died mid-stream: end the client's stream with an error event.
                    self._failed(b, req, first_token_seen=True)
                    released = True
                    err = {
                        "error": {
                            "message": f"backend failed mid-stream ({type(e).__name__})",
                            "type": "server_error",
                            "code": 502,
                        }
                    }
                    # A blank line first ends an event the backend left half-written.
                    sep = b"" if chunk.endswith(b"\n\n") else b"\n\n"
                    await out.write(sep + b"data: " + json.dumps(err).encode() + b"\n\n")
                    await out.write_eof()
                    return out
            await out.write_eof()
        except BaseException:
            # The client went away (or the write failed): closing `up` aborts the upstream
            # request. Released once, whatever happened.
            if not released:
                release(b, req)
            raise
        self.estimator.observe(req.model, max(1, tokens - 1))
        self._done(b, req, started, None)
        return out

    def _headers(self, up: Response, b: Backend) -> dict[str, str]:
        h = {k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS}
        # The backend's own headers were checked as they were parsed (upstream.py); these come
        # from inventory, state or a backends file.
        h["X-Fleet-Backend"] = _header_value(b.node)
        h["X-Fleet-Class"] = _header_value(b.node_class)
        h["X-Fleet-Precision"] = _header_value(b.variant)
        return h

    def _first(self, b: Backend, req: Request, started: float) -> None:
        now = time.monotonic()
        first_token(b, req)
        self.metrics.ttft.observe(now - started, req.model)
        # Aging compares waiting to the backends' TTFT (dispatch to first byte), as simulated.
        self.scheduler.observe_ttft(now, now - started)
        if self.shared is not None:
            self._background(self.shared.add_ttft(now - started))

    def _done(
        self, b: Backend, req: Request, started: float, answer: dict[str, Any] | None
    ) -> None:
        release(b, req)
        self._wake()
        self.metrics.e2e.observe(time.monotonic() - started, req.model)
        usage = answer.get("usage") if answer else None
        if isinstance(usage, dict):
            # Learned from only when sane: a broken backend must not skew the estimates.
            out, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
            if _count(out):
                self.estimator.observe(req.model, out)
            if _count(prompt):
                self.tokens.observe(req.model, req.prompt_chars, prompt)

    def _failed(self, b: Backend, req: Request, first_token_seen: bool = False) -> None:
        release(b, req, first_token_seen)
        self._wake()
        if self.live is not None:
            self.live.failed(b, time.monotonic())

    async def models(self, request: web.Request) -> web.Response:
        try:
            self._authorize(request)
        except ClientError as e:
            return e.response()
        seen: dict[str, dict[str, Any]] = {}
        for b in self.backends:
            if b.model not in seen:
                seen[b.model] = {
                    "id": b.model,
                    "object": "model",
                    "owned_by": "fleetctl",
                    "backends": 0,
                    "healthy": 0,
                }
            seen[b.model]["backends"] += 1
            seen[b.model]["healthy"] += int(b.healthy)
        return web.json_response({"object": "list", "data": list(seen.values())})

    async def health(self, request: web.Request) -> web.Response:
        up = sum(b.healthy for b in self.backends)
        body = {
            "status": "ok" if up else "no healthy backend",
            "backends": len(self.backends),
            "healthy": up,
            "queued": len(self.scheduler),
        }
        return web.json_response(body, status=200 if up else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        depth = {prio: len(q) for prio, q in self.scheduler.classes.items()}
        for prio in {*depth, *(int(k[0]) for k in self.metrics.queue.values)}:
            self.metrics.queue.set(str(prio), value=depth.get(prio, 0))
        for b in self.backends:
            self.metrics.up.set(b.name, b.node_class, value=1.0 if b.healthy else 0.0)
            self.metrics.outstanding.set(b.name, value=b.outstanding)
            self.metrics.reserved.set(b.name, value=b.reserved_tokens)
            self.metrics.prefill.set(b.name, value=b.pending_prefill)
            if self.live is not None:
                age = (
                    now - self.live.state(b).scraped_at
                    if self.live.state(b).scraped_at
                    else float("inf")
                )
                self.metrics.scrape_age.set(b.name, value=age)
                self.metrics.ejections.values[(b.name,)] = float(self.live.state(b).ejections)
        if self.live is not None:
            self.live.expire_all(now)
        return web.Response(text=self.metrics.render(), content_type="text/plain", charset="utf-8")
