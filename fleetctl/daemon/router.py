"""`fleetctl route-serve`: an OpenAI-compatible proxy that routes by the seed's rules.

Each request is read and parsed once (intake.py), queued in the same Scheduler the simulator
uses (admission.py), and proxied to the chosen backend byte for byte (proxy.py, relay.py):
SSE chunks are written to the client as they arrive. Connection failures and 5xx answers
before the first byte are retried on another backend through the scheduler; a backend that
keeps failing is ejected (live.py). This module wires them into an aiohttp application.

Kept whole because it is the one place the daemon's parts meet: the app, its handlers, start and
stop, reloads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from fleetctl.daemon.admission import Admission
from fleetctl.daemon.backends import KvEndpoint
from fleetctl.daemon.intake import Intake, authorize, error_response
from fleetctl.daemon.live import LiveState, cancel, wake_request, where
from fleetctl.daemon.prefix_share import PrefixShare, SharedIndex
from fleetctl.daemon.proxy import LAST_ATTEMPT, SERVED_BY, Hooks, Proxy
from fleetctl.daemon.relay import CUT, CUT_MESSAGE
from fleetctl.daemon.request_log import CUT_BY_DRAIN, RequestLog
from fleetctl.daemon.shared import RedisShared
from fleetctl.daemon.telemetry import Counter, Gauge, RouterMetrics
from fleetctl.daemon.tokens import TokenCounter
from fleetctl.daemon.transport import make_transport
from fleetctl.routing.goodput import Slo
from fleetctl.routing.policy import Policy, RoutingConfig
from fleetctl.routing.prefix import PrefixIndex
from fleetctl.routing.registry import make_policy, policy_class
from fleetctl.routing.request import MAX_JSON_DEPTH, PRIORITY_CLASSES, ClientError
from fleetctl.routing.scheduler import Aging, Scheduler
from fleetctl.routing.sessions import SESSIONS_MAX, SessionTable
from fleetctl.routing.types import (
    ASLEEP,
    AWAKE,
    DRAINING,
    STATES,
    WAKING,
    Backend,
    OutputEstimator,
    Request,
)

log = logging.getLogger("fleetctl.router")

# Blocks the prefix index holds, over all backends: 262,144 blocks of ~16 tokens, 4M tokens
# of KV cache. The index is keyed by clients' prompts, and a block costs ~150 bytes
# (benchmarks/prefix_index.py): so filled by distinct prompts it stays near 40 MB, where the
# earlier 1M blocks grew route-serve by ~150 MB. A larger fleet raises --prefix-capacity.
PREFIX_CAPACITY = 1 << 18
# At the drain's end, how long the requests cut get to write their last bytes and log lines.
CUT_WAIT_S = 1.0
# The KV event subscriber's counts (SourceStats fields) exported on /metrics.
KV_KINDS = ("batches", "events", "malformed", "gaps", "replayed", "cleared")


# What route-serve serves: an unserved path or method gets a JSON error that lists them.
ROUTES = {
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/v1/models": ("GET", "HEAD"),
    "/health": ("GET", "HEAD"),
    "/metrics": ("GET", "HEAD"),
}


async def unserved(request: web.Request) -> web.Response:
    """404 for a path route-serve does not serve, 405 for a method it does not take on one it
    does, in the error shape of its other answers (OpenAI's), not aiohttp's plain text."""
    allowed = ROUTES.get(request.path)
    if allowed is None:
        listed = ", ".join(f"{m[0]} {p}" for p, m in ROUTES.items())
        e = ClientError(
            404,
            f"{request.method} {request.path} is not served by fleetctl route-serve; it serves "
            f"{listed}",
            "not_found_error",
        )
        return error_response(e)
    e = ClientError(405, f"{request.path} takes {' or '.join(allowed)}, not {request.method}")
    resp = error_response(e)
    resp.headers["Allow"] = ", ".join(allowed)
    return resp


def keep_state(b: Backend, old: Backend) -> None:
    """A reloaded server's state: the file's, except what the router knows better: a wake it
    asked is still under way, and a server its scrape found asleep stays so until a scrape
    finds it awake (the file says awake before the server is)."""
    if b.state == DRAINING:
        return
    if old.state == WAKING and b.state in (ASLEEP, AWAKE):
        b.state, b.ready_at = WAKING, old.ready_at
    elif old.state == ASLEEP and b.state == AWAKE:
        b.state, b.sleep_level, b.wake_s = ASLEEP, old.sleep_level, old.wake_s


def per_backend(total: int, backends: int) -> int:
    """A PrefixIndex's capacity (per backend) for `total` blocks over `backends` backends."""
    return max(1, total // max(1, backends))


def routing_core(
    policy: str,
    backends: int,
    *,
    config: RoutingConfig | None = None,
    aging: Aging | None = None,
    prefix_capacity: int = PREFIX_CAPACITY,
    kv_events: bool = False,
    shared: RedisShared | None = None,
    seed: int = 0,
    max_sessions: int = SESSIONS_MAX,
) -> Scheduler:
    """The scheduler and the policy `policy` for `backends` servers, each built with what it
    needs: a prefix index of `prefix_capacity` blocks when the policy reads one and keeps
    none of its own (fed by placements, or by the servers' KV events), session pins for the
    `max_sessions` sessions used last, and with `shared`, the session pins (bounded by its
    own table) and the TTFT window every replica keeps in Redis."""
    declared = policy_class(policy)
    prefix = None
    if declared.reads_prefix and not declared.own_index and prefix_capacity > 0:
        prefix = SharedIndex(per_backend(prefix_capacity, backends), learn=not kv_events)
    aging = aging or Aging()
    sessions = shared.sessions if shared is not None else SessionTable(max_sessions)
    chosen = make_policy(policy, seed, config, prefix, sessions)
    window = shared.ttft_window(aging.window_s) if shared is not None else None
    return Scheduler(chosen, aging, ttft_window=window)


@dataclass
class DaemonConfig:
    max_body_bytes: int = 32 * 2**20
    upstream_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    queue_timeout_s: float = 300.0
    max_retries: int = 2
    transport: str = "fast"  # the HTTP client to backends (daemon/transport.py)
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
    # On SIGTERM or SIGINT, requests in flight get this long to finish before they are cut
    # (a second signal cuts them at once); an idle router stops at once.
    drain_timeout_s: float = 20.0


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
    known_formats: frozenset[str] = frozenset()  # the catalog's: a precision hint names one
    # The prefix index's bound over all backends, which routing_core sized it by: it follows
    # the number of backends on a reload.
    prefix_capacity: int = PREFIX_CAPACITY
    # Whether requests are hashed into blocks (Request.blocks); None: when the policy reads
    # the prefix index (Policy.reads_prefix).
    hash_prompts: bool | None = None
    # Per backend name, the ZMQ endpoint of its vLLM KV events (vLLM's default binds
    # tcp://*:5557: give tcp://HOST:5557), or a KvEndpoint with its topic and replay socket:
    # the index is then fed by them (precise, fleetctl/daemon/kv_events.py) rather than by
    # placements (approximate), and prompts are named as vLLM names its blocks of
    # `kv_block_size` tokens (fleetctl/vllm/hashing.py). Each replica subscribes itself, so
    # nothing of it goes through Redis.
    kv_events: dict[str, str | KvEndpoint] | None = None
    # The servers' --block-size until their /metrics say (vllm:cache_config_info's
    # block_size, read by live.py): prompts are hashed once per request, with the size most
    # of the subscribed backends use; a backend with another size finds no hits (logged).
    kv_block_size: int = 16
    # One JSON line per finished request (daemon/request_log.py); None: no log. The log
    # needs each prompt's block hashes, so requests are hashed while it is kept.
    request_log: RequestLog | None = None
    # Which of route-serve's --workers this process is (None: the only one).
    worker: int | None = None
    # Each model's objectives (the inventory's slo): /metrics counts the answers that met them.
    slo: dict[str, Slo] = field(default_factory=dict)
    prefix: PrefixIndex | None = field(init=False, default=None)
    prefix_share: PrefixShare | None = field(init=False, default=None)
    _kv: Any = None  # the KvEventSubscriber, while it runs
    _kv_counts: dict[tuple[str, str], float] = field(default_factory=dict)  # of past ones
    _kv_sizes: str = ""  # the block sizes last logged
    _kv_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one (re)subscription at once
    _proxy: Proxy | None = None  # built at start, with its upstream connection pool
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _inflight: dict[asyncio.Task[Any], web.Request] = field(default_factory=dict)
    intake: Intake = field(init=False)
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        # Prompts are hashed into blocks (~0.03 ms for 1K tokens, benchmarks/prefix_index.py)
        # for a policy that reads them, and for the request log.
        hashed = self.policy.reads_prefix if self.hash_prompts is None else self.hash_prompts
        given = self.policy.prefix  # the index the policy was built with (routing_core)
        self.prefix = given if isinstance(given, PrefixIndex) else None
        self.intake = Intake(
            c.api_key,
            c.max_body_bytes,
            c.body_timeout_s,
            c.priority_classes,
            c.max_json_depth,
            self.tokens,
            self.estimator,
            self.known_formats,
            blocks=hashed or self.request_log is not None,
        )
        self.intake.index(self.backends)
        self.metrics.objectives(self.slo)
        self.admission = Admission(self.scheduler, self.backends, self.metrics, c.queue_timeout_s)
        self.admission.on_wake = self._wake
        if self.live is not None:  # a scrape found a server asleep or awake again
            self.live.on_state = lambda b: self.admission.kick()
        if self.kv_events and self.prefix is not None:
            self._follow_kv_events(self.prefix)
        elif self.prefix is not None and self.prefix.learn and hashed and self.shared:
            self.prefix_share = PrefixShare(self.shared, self.prefix)

    def _follow_kv_events(self, index: PrefixIndex) -> None:
        """The servers' KV events feed the index from now on, with prompts named in blocks
        of the size the servers' /metrics report."""
        index.follow_events()
        self.tokens.name_blocks_as_engine(self.kv_block_size)
        if self.live is not None:
            self.live.report_block_sizes(self._block_size)

    def become_worker(self, worker: int) -> None:
        """This process is route-serve's --workers number `worker`, a forked copy: a replica
        id of its own in the session store."""
        self.worker = worker
        if self.shared is not None:
            self.shared.new_identity()
            if self.prefix_share is not None:
                self.prefix_share.renamed()

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
        # Last, so it takes only what no route above does: a route rather than a middleware,
        # which would cost every proxied request a call.
        app.router.add_route("*", "/{path:.*}", unserved)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        c = self.config
        # For the proxied requests: "fast" is cheaper than aiohttp's client.
        upstream = make_transport(c.transport, c.connect_timeout_s, c.upstream_timeout_s)
        hooks = Hooks(
            self.admission,
            self.metrics,
            self.estimator,
            self.tokens,
            self.live,
            self._ttft,
            self.slo,
        )
        self._proxy = Proxy(upstream, hooks, c.max_retries, c.api_key, c.backend_api_key)
        self._tasks.append(asyncio.create_task(self.admission.run()))
        if self.request_log is not None:
            self._tasks.append(asyncio.create_task(self.request_log.run()))
        if self.shared is not None:
            try:
                await asyncio.wait_for(self.shared.check(), 2.0)
            except Exception as e:  # keep serving on this replica's own state
                self.shared.down(e)
            self._tasks.append(asyncio.create_task(self.shared.run()))
            if self.prefix_share is not None:
                self._tasks.append(asyncio.create_task(self.prefix_share.run()))
        if self.live is not None:
            await self.live.read_lengths()  # on_startup: before the port takes requests
            self._tasks.append(asyncio.create_task(self.live.run()))
        if self.kv_events and self.prefix is not None:
            await self._start_kv()

    async def _start_kv(self) -> None:
        # pyzmq and msgpack: needed only with KV events (the `prefix` extra).
        from fleetctl.daemon.kv_events import KvEventSubscriber, KvSource

        assert self.kv_events and self.prefix is not None
        sources = [
            KvSource(b, e)
            if isinstance(e, str)
            else KvSource(b, e.endpoint, e.topic, e.replay, e.bind)
            for b, e in sorted(self.kv_events.items())
        ]
        self._kv = KvEventSubscriber(self.prefix, sources)
        await self._kv.start()
        log.info("KV events: subscribed to %d backends", len(sources))

    async def _stop_kv(self) -> None:
        if self._kv is None:
            return
        for name, stats in self._kv.stats.items():  # counters carry over a restart
            for kind in KV_KINDS:
                key = (name, kind)
                self._kv_counts[key] = self._kv_counts.get(key, 0.0) + getattr(stats, kind)
        await self._kv.close()
        self._kv = None

    def set_kv_events(self, fresh: dict[str, str | KvEndpoint]) -> None:
        """Reload: subscribe to these sources instead (a no-op when they are the same). The
        subscriber restarts in the background; the index keeps what it holds of backends
        that stay (a restarted subscription asks each replay socket for what it missed)."""
        if fresh == (self.kv_events or {}):
            return
        self.kv_events = dict(fresh)
        if self.prefix is None:
            return
        if fresh:  # the index now follows the events (from placements until now, if empty)
            self._follow_kv_events(self.prefix)

        async def restart() -> None:
            async with self._kv_lock:
                await self._stop_kv()
                if self.kv_events and self.prefix is not None:
                    await self._start_kv()

        if self._proxy is not None:  # started: restart now; else _start subscribes
            task = asyncio.create_task(restart())
            self._tasks.append(task)
            task.add_done_callback(self._kv_restarted)

    def _kv_restarted(self, task: asyncio.Task[None]) -> None:
        if task in self._tasks:
            self._tasks.remove(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("KV events: resubscribing failed: %s", task.exception())

    def _block_size(self, b: Backend, size: int) -> None:
        """A backend's /metrics said its KV block size: hash prompts with the size most
        subscribed backends use (one size per request), saying so when they differ."""
        if self.live is None or not self.kv_events:
            return
        sizes: dict[int, int] = {}
        for x in self.backends:
            got = self.live.state(x).block_size
            if got and x.name in self.kv_events:
                sizes[got] = sizes.get(got, 0) + 1
        if not sizes:
            return
        best = max(sizes, key=lambda k: (sizes[k], -k))
        self.kv_block_size = best
        self.tokens.name_blocks_as_engine(best)
        seen = ", ".join(f"{n} x {k}" for k, n in sorted(sizes.items()))
        if len(sizes) > 1 and seen != self._kv_sizes:
            log.warning(
                "KV events: backends use different block sizes (%s tokens): prompts are named "
                "in blocks of %d, so the others find no cached prefix; give every server the "
                "same --block-size",
                seen,
                best,
            )
        self._kv_sizes = seen

    async def _stop(self, app: web.Application) -> None:
        await self._stop_kv()
        for t in list(self._tasks):
            await cancel(t)
        if self._proxy is not None:
            self._proxy.upstream.close()
        if self.shared is not None:
            await self.shared.close()
        if self.request_log is not None:
            self.request_log.close()

    def _ttft(self, now: float, ttft: float) -> None:
        # Aging compares waiting to the backends' TTFT (dispatch to first byte), as simulated;
        # with a session store, the window's samples reach the others once a second.
        self.scheduler.observe_ttft(now, ttft)

    # --- sleep mode ------------------------------------------------------------------------------

    def _wake(self, b: Backend) -> None:
        """A dispatch chose `b` while it slept (no awake server of its model could take the
        request): ask it to wake, once; the request waits in the queue meanwhile."""
        if self.live is not None:  # before any scrape can read it as a wake ended asleep
            self.live.state(b).wake_asked = True
        task = asyncio.create_task(self._wake_up(b))
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _wake_up(self, b: Backend) -> None:
        self.metrics.wakes.inc(b.name, "router")
        log.info(
            "waking %s (sleep level %d, about %.1f s): its model has no awake server for the "
            "requests queued",
            where(b),
            b.sleep_level,
            b.wake_s or 0.0,
        )
        try:
            ok, why = await wake_request(
                b, self.config.backend_api_key, self.config.upstream_timeout_s
            )
        finally:
            if self.live is not None:
                self.live.state(b).wake_asked = False
        if ok:
            self._set_state(b, AWAKE)
            log.info("%s is awake", where(b))
        else:
            # Not asked again until a reload: a wake that fails out of memory fails again
            # while the GPU is held (vllm#47654); its requests go elsewhere or are refused.
            self._set_state(b, ASLEEP)
            b.wakeable = False
            log.error("waking %s failed (%s); it gets no requests until a reload", where(b), why)
        self.admission.kick()

    def _set_state(self, b: Backend, state: str) -> None:
        for x in [b, *(x for x in self.backends if x.name == b.name and x is not b)]:
            if self.live is not None:
                self.live.set_state(x, state)
            else:
                x.state = state

    def replace_backends(self, fresh: list[Backend]) -> None:
        """Reload: keep the live counters of servers that stay; in-flight requests finish."""
        old = {b.name: b for b in self.backends}
        merged = []
        for b in fresh:
            keep = old.get(b.name)
            if keep is None and self.live is not None:
                # A server that joins (apply started it, maybe to replace another): no
                # traffic until its /health says it is ready and it is warmed up.
                self.live.joining(b)
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
                b.pending_prefill_s = keep.pending_prefill_s
                keep_state(b, keep)
            merged.append(b)
        self.backends[:] = merged
        self.intake.index(self.backends)
        if isinstance(self.prefix, SharedIndex):  # ours: its bound follows the backend count
            self.prefix.resize(per_backend(self.prefix_capacity, len(self.backends)))
        if self.prefix is not None:  # forget servers that left
            for name in set(self.prefix.blocks) - {b.name for b in self.backends}:
                self.prefix.clear(name)
        if self.live is not None:
            self.live.reloaded(self.backends)
        self.admission.kick()

    # --- handlers ------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._inflight[task] = request  # until it ends: the drain's end cuts what is left
        try:
            return await self._answer(request, chat)
        finally:
            del self._inflight[task]

    async def cut(self) -> None:
        """The drain is over: end each request still in flight as cut (CUT): a stream with an
        error event, an answer not begun with a 503; each logged with what reached its client.
        Waits CUT_WAIT_S at most for them to end."""
        for task, request in self._inflight.items():
            request[CUT] = True
            task.cancel()
        if self._inflight:
            await asyncio.wait(list(self._inflight), timeout=CUT_WAIT_S)

    def _cut(
        self, request: web.Request, req: Request | None, arrival: float, started: float
    ) -> web.Response | None:
        """A request cut before its answer began: the 503 its client gets (None once bytes
        went out: nothing can be answered then), and its log line."""
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        if req is not None:
            self._finished(request, req, arrival, started, 503, CUT_BY_DRAIN)
        if request.writer is not None and request.writer.output_size > 0:
            return None
        return error_response(ClientError(503, CUT_MESSAGE, "server_error"))

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        started = time.monotonic()
        arrival = time.time()
        shared = self.shared
        req: Request | None = None
        try:
            raw, parsed, req = await self.intake.read(request, chat)
            # A session's pin: in memory (kept fresh by the other replicas' updates), else one
            # batched read, waited for READ_WAIT_S at most. The policy's new pin is queued
            # for Redis as it places the request (SharedSessions.set), not waited for.
            if shared is not None and req.session and shared.needs_read(req.session):
                await shared.read_pin(req.session)
            decision = await self.admission.place(req)
        except ClientError as e:
            self.metrics.requests.inc("", "", "bad-request", str(e.status))
            if req is not None:  # parsed, then refused (no room in time)
                self._finished(request, req, arrival, started, e.status)
            return error_response(e)
        except BaseException:
            if request.get(CUT):
                if cut := self._cut(request, req, arrival, started):
                    return cut
                raise
            if req is not None:  # the client left while its request waited for room
                self._finished(request, req, arrival, started, 499)
            raise
        if decision.backend is None:
            down = decision.down
            status, kind = (503, "server_error") if down else (400, "invalid_request_error")
            self.metrics.requests.inc(req.model, "", "rejected", str(status))
            self._finished(request, req, arrival, started, status)
            return error_response(ClientError(status, decision.reason, kind))
        assert self._proxy is not None
        try:
            out = await self._proxy.serve(request, raw, parsed, req, decision, chat, started)
            if shared is not None and req.session and not out.prepared:
                await shared.settled(req.session)  # a new pin reaches Redis before the answer
        except BaseException:
            if request.get(CUT):
                if cut := self._cut(request, req, arrival, started):
                    return cut
                raise
            self._finished(request, req, arrival, started, 499)  # the client left (or a bug)
            raise
        self._finished(request, req, arrival, started, out.status)
        return out

    def _finished(
        self,
        request: web.Request,
        req: Request,
        arrival: float,
        started: float,
        status: int,
        outcome: str | None = None,
    ) -> None:
        """A request ended: its line in the request log, if one is kept."""
        if self.request_log is None:
            return
        attempt = request.get(LAST_ATTEMPT)
        ttft = output = None
        if attempt is not None:
            ttft, output = attempt.ttft, attempt.output
            if attempt.ended == "failed" and status < 400:
                status = 502  # the backend failed mid-stream: the client got an error event
            if attempt.ended == "cut":  # cut mid-stream: the client got a 503 error event
                status, outcome = 503, CUT_BY_DRAIN
        try:
            self.request_log.record(
                req,
                arrival,
                request.get(SERVED_BY),
                ttft,
                time.monotonic() - started,
                status,
                output,
                outcome,
            )
        except Exception as e:  # a request never fails for its log line
            log.warning("request log: %s", type(e).__name__)

    async def models(self, request: web.Request) -> web.Response:
        try:
            authorize(self.config.api_key, request)
        except ClientError as e:
            return error_response(e)
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
        states: dict[str, int] = {}
        for b in self.backends:  # awake, asleep, waking, starting, draining (sleep mode)
            states[b.state] = states.get(b.state, 0) + 1
        body: dict[str, object] = {
            "status": "ok" if up else "no healthy backend",
            "backends": len(self.backends),
            "healthy": up,
            "states": dict(sorted(states.items())),
            "queued": len(self.scheduler),
        }
        if self.worker is not None:
            body["worker"] = self.worker
        if self.live is not None:  # each backend out of routing, and why (wrong model, ejected)
            body["unhealthy"] = self.live.unhealthy()
        if self.shared is not None:
            # Still serving, on this replica's own state: degraded, not down (a load balancer
            # keeps sending here), with the reason.
            store = self.shared.health()
            body["session_store"] = store
            if up and store["status"] != "ok":
                body["status"] = "degraded"
        return web.json_response(body, status=200 if up else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        depth = {prio: len(q) for prio, q in self.scheduler.classes.items()}
        for prio in {*depth, *(int(k[0]) for k in self.metrics.queue.values)}:
            self.metrics.queue.set(str(prio), value=depth.get(prio, 0))
        for b in self.backends:
            self.metrics.up.set(b.name, b.node_class, value=1.0 if b.healthy else 0.0)
            for name in STATES:
                self.metrics.state.set(b.name, b.model, name, value=float(b.state == name))
            self.metrics.outstanding.set(b.name, value=b.outstanding)
            self.metrics.reserved.set(b.name, value=b.reserved_tokens)
            self.metrics.prefill.set(b.name, value=b.pending_prefill)
            if b.perf is not None:
                self.metrics.speed.set(b.name, value=b.perf.speed)
            if self.live is not None:
                state = self.live.state(b)
                age = now - state.scraped_at if state.scraped_at else float("inf")
                self.metrics.scrape_age.set(b.name, value=age)
                self.metrics.ejections.values[(b.name,)] = float(state.ejections)
        if self._proxy is not None:  # a series per prefill server that may hold any
            held = self._proxy.held.counts()
            for name in {*held, *(k[0] for k in self.metrics.kv_held.values)}:
                self.metrics.kv_held.set(name, value=held.get(name, 0))
        if self.prefix is not None:
            for b in self.backends:
                self.metrics.prefix_blocks.set(b.name, value=self.prefix.size(b.name))
        sessions = getattr(self.policy, "sessions", None)
        if isinstance(sessions, SessionTable):
            self.metrics.session_pins.set(value=len(sessions.pins))
        if self.prefix_share is not None:
            share = self.prefix_share
            for direction, n in (
                ("published", share.published),
                ("applied", share.applied),
                ("dropped", share.dropped),
            ):
                self.metrics.prefix_updates.values[(direction,)] = float(n)
        if self.shared is not None:
            self.metrics.session_store(self.shared)
        if self.live is not None:
            self.live.expire_all(now)
        text = self.metrics.render()
        if self.kv_events and self.prefix is not None:
            text += self._kv_metrics()
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    def _kv_metrics(self) -> str:
        """The KV event subscriber's counts per backend (one series per backend and kind:
        bounded by the backends), and the block size each reports."""
        counts = Counter(
            "fleetctl_kv_events_total",
            "KV events from each backend: batches and events applied, malformed messages "
            "skipped, gaps (batches lost), batches replayed, index clears.",
            ("backend", "kind"),
        )
        names = {b.name for b in self.backends}
        for key, v in self._kv_counts.items():
            if key[0] in names:
                counts.values[key] = v
        if self._kv is not None:
            for name, stats in self._kv.stats.items():
                for kind in KV_KINDS:
                    key = (name, kind)
                    counts.values[key] = self._kv_counts.get(key, 0.0) + getattr(stats, kind)
        size = Gauge(
            "fleetctl_kv_block_size",
            'Tokens per KV block: the size prompts are hashed with (backend ""), and each '
            "backend's own (vllm:cache_config_info).",
            ("backend",),
        )
        size.set("", value=self.kv_block_size)
        if self.live is not None:
            for b in self.backends:
                got = self.live.state(b).block_size
                if got:
                    size.set(b.name, value=got)
        return "\n".join([*counts.render(), *size.render()]) + "\n"
