"""Proxying: send a placed request to its backend, relay the answer, retry through admission.

Every attempt holds a Lease on its backend, and one handler pair in `Proxy.attempt` decides
every outcome: success, an upstream failure (before or after the first byte), the client
leaving (cancellation), or a bug. Whatever happens, the lease releases the backend's counters
(outstanding, reserved tokens, pending prefill) exactly once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from aiohttp import web

from fleetctl.daemon import disagg
from fleetctl.daemon.admission import Admission
from fleetctl.daemon.backends import body_for, host_port, served_name
from fleetctl.daemon.intake import error_response
from fleetctl.daemon.live import LiveState
from fleetctl.daemon.relay import (
    BackendFailed,
    Stream,
    header_value,
    relay_whole,
    without_owned,
)
from fleetctl.daemon.telemetry import RouterMetrics
from fleetctl.daemon.tokens import TokenCounter
from fleetctl.daemon.transport import Answer, Transport
from fleetctl.daemon.upstream import UpstreamError
from fleetctl.routing.goodput import Slo, prompt_prefill_s
from fleetctl.routing.phases import PREFILL
from fleetctl.routing.request import ClientError, Parsed
from fleetctl.routing.scheduler import first_token, release
from fleetctl.routing.types import Backend, Decision, OutputEstimator, Request

RETRY_STATUSES = range(500, 600)
# What a backend failing looks like; anything else (a client that left, a bug) is not its fault.
FAILURES = (TimeoutError, UpstreamError, BackendFailed)
# The backend that served a request (the last one tried), for the access log (serve.py).
SERVED_BY = web.RequestKey("fleetctl_backend", Backend)


def _count(value: object) -> TypeGuard[int]:
    """A token count a backend may report: an int (not a bool) below 2**31."""
    return type(value) is int and 0 <= value < 2**31


@dataclass
class Hooks:
    """What the proxy tells the rest of the daemon about an attempt's outcome."""

    admission: Admission
    metrics: RouterMetrics
    estimator: OutputEstimator
    tokens: TokenCounter
    live: LiveState | None
    # Records a backend TTFT sample (scheduler's aging window, and the shared store).
    observe_ttft: Callable[[float, float], None]
    slo: dict[str, Slo] = field(default_factory=dict)  # each model's objectives, if it has


def current(b: Backend, backends: list[Backend]) -> Backend:
    """`b` as the router lists it now. A reload lists a new object for a server that stays,
    with its counters carried over (Router.replace_backends): a request placed before the
    reload gives its room back to that one, or the counters never come down again."""
    for x in backends:
        if x is b:
            return b
    return next((x for x in backends if x.name == b.name), b)


class Lease:
    """One attempt's hold on a backend, from placement (the scheduler accounted it) to its end.
    Each ending releases the counters only if no other ending has: exactly once."""

    __slots__ = (
        "b",
        "ended",
        "first_seen",
        "held",
        "hooks",
        "output",
        "prefilled",
        "reached",
        "req",
        "started",
        "ttft",
    )

    def __init__(
        self, hooks: Hooks, b: Backend, req: Request, started: float, prefilled: bool = False
    ):
        self.hooks, self.b, self.req, self.started = hooks, b, req, started
        # A decode server's lease: the prompt was prefilled elsewhere, so none is pending here.
        self.prefilled = prefilled
        self.first_seen = False
        self.held = True
        self.ttft: float | None = None  # from arrival to the first byte
        self.output: int | None = None  # output tokens, as reported or counted
        self.ended = ""  # "done", "failed", "abandoned" or "cut"
        self.reached = True  # whether the backend may have received the request

    def first(self) -> None:
        """The first byte of the answer arrived: the prompt is no longer pending prefill."""
        now = time.monotonic()
        self.b = current(self.b, self.hooks.admission.backends)
        if not self.prefilled:
            first_token(self.b, self.req)
        self.first_seen = True
        self.ttft = now - self.started
        self.hooks.metrics.ttft.observe(now - self.started, self.req.model)
        self.hooks.observe_ttft(now, now - self.started)

    def _release(self) -> bool:
        if not self.held:
            return False
        self.held = False
        self.b = current(self.b, self.hooks.admission.backends)
        release(self.b, self.req, self.first_seen or self.prefilled)
        self.hooks.admission.wake()
        return True

    def done(self, answer: dict[str, Any] | None, streamed: int | None = None) -> None:
        """Answered whole: learn from what the backend reported, when it is sane (a broken
        backend must not skew the estimates)."""
        if not self._release():
            return
        self.ended = "done"
        h, req = self.hooks, self.req
        e2e = time.monotonic() - self.started
        h.metrics.e2e.observe(e2e, req.model)
        if streamed is not None:
            h.estimator.observe(req.model, streamed)
            self.output = streamed
        usage = answer.get("usage") if answer else None
        if isinstance(usage, dict):
            out, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
            if _count(out):
                h.estimator.observe(req.model, out)
                self.output = out
            if _count(prompt):
                h.tokens.observe(req.model, req.prompt_chars, prompt)
        # A streamed answer times its tokens; a whole one arrives at once (no TPOT to time).
        if streamed is not None and self.ttft is not None and self.output and self.output > 1:
            tpot = (e2e - self.ttft) / (self.output - 1)
            slo = h.slo.get(req.model)
            met = None if slo is None else slo.met(self.ttft, tpot)
            h.metrics.served(req.model, self.b.node_class, tpot, met)

    def failed(self, reason: str) -> None:
        """The backend failed: counted against it (ejection after several, logged with why)."""
        if not self._release():
            return
        self.ended = "failed"
        if self.hooks.live is not None:
            self.hooks.live.failed(self.b, time.monotonic(), reason)

    def abandoned(self) -> None:
        """The client left, or a bug: not the backend's fault."""
        if self._release():
            self.ended = "abandoned"

    def cut(self, streamed: int) -> None:
        """route-serve cut the answer at its drain's end, after `streamed` output tokens
        reached the client: not the backend's fault."""
        if self._release():
            self.ended = "cut"
            self.output = streamed


@dataclass(frozen=True)
class Prefilled:
    """A prompt a prefill server has computed: the server, and the KV transfer's parameters
    it answered with (None: it gave none, so the decode server prefills the prompt itself)."""

    backend: Backend
    params: dict[str, Any] | None


# The last attempt's Lease: how it ended, its TTFT and output tokens (the request log).
LAST_ATTEMPT = web.RequestKey("fleetctl_attempt", Lease)


@dataclass
class Proxy:
    upstream: Transport
    hooks: Hooks
    max_retries: int = 2
    api_key: str | None = None  # the router's own: when set, the client's header is not passed
    backend_api_key: str | None = None  # sent to backends instead of the client's header
    held: disagg.Held = field(default_factory=disagg.Held)  # KV left on prefill servers

    async def serve(
        self,
        request: web.Request,
        raw: bytes,
        parsed: Parsed,
        req: Request,
        decision: Decision,
        chat: bool,
        started: float,
        tried: list[Backend] | None = None,
    ) -> web.StreamResponse:
        """Answer a placed request; a failure before the first byte is retried elsewhere.
        `tried`: servers that failed it already (a split request's prefill servers)."""
        if decision.kind == PREFILL:
            return await self.split(request, raw, parsed, req, decision, chat, started)
        metrics = self.hooks.metrics
        stream = bool(parsed.body.get("stream"))
        headers = self._headers(request)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        label = decision.label
        tried = list(tried or ())
        backend = decision.backend
        while backend is not None:
            tried.append(backend)
            request[SERVED_BY] = backend
            out = await self.attempt(request, raw, req, backend, path, headers, stream, started)
            if out is not None:
                metrics.requests.inc(req.model, backend.node_class, label, str(out.status))
                return out
            # Failed before any byte reached the client: try another backend.
            if len(tried) > self.max_retries:
                break
            again = await self._place_again(req, tried)
            backend = again.backend if again is not None else None
            if backend is not None:
                metrics.retries.inc(req.model)
                label = "retry"
        metrics.requests.inc(req.model, tried[-1].node_class, label, "502")
        return error_response(
            ClientError(502, "every backend tried failed before answering", "server_error")
        )

    async def split(
        self,
        request: web.Request,
        raw: bytes,
        parsed: Parsed,
        req: Request,
        decision: Decision,
        chat: bool,
        started: float,
    ) -> web.StreamResponse:
        """A disaggregated request: its prompt on the prefill server placed (another prefill
        server if it fails), then its answer from a decode server that pulls the KV cache; a
        decode server that fails before the first byte is replaced by another. With no
        prefill server left, or a body the two phases cannot serve (disagg.splittable), the
        request is served whole where the scheduler places it, with no transfer parameters.
        The client sees one answer, or one error."""
        metrics = self.hooks.metrics
        headers = {**self._headers(request), "X-Request-Id": disagg.request_id()}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        tried: list[Backend] = []
        prefill: Decision | None = decision
        done: Prefilled | web.Response | None = None
        if not disagg.splittable(parsed.body):
            # Never sent: give the prefill server its room back, decode it whole instead.
            assert decision.backend is not None
            release(decision.backend, req, first_token_seen=False)
            self.hooks.admission.wake()
            return await self._decode(request, parsed, req, path, headers, started, None)
        while prefill is not None and prefill.backend is not None:
            if prefill.kind != PREFILL:
                # No prefill server left: the scheduler placed it whole (on a decode server).
                return await self.serve(request, raw, parsed, req, prefill, chat, started, tried)
            tried.append(prefill.backend)
            done = await self._prefill(prefill.backend, parsed.body, req, path, headers)
            if done is not None or len(tried) > self.max_retries:
                break
            prefill = await self._place_again(req, tried)
            if prefill is not None:
                metrics.retries.inc(req.model)
        if isinstance(done, web.Response):  # the client's mistake: its answer, as vLLM gave it
            request[SERVED_BY] = tried[-1]
            metrics.requests.inc(req.model, tried[-1].node_class, decision.label, str(done.status))
            return done
        if done is None and len(tried) > self.max_retries:
            metrics.requests.inc(req.model, tried[-1].node_class, decision.label, "502")
            return error_response(
                ClientError(502, "every prefill server tried failed", "server_error")
            )
        if done is None:  # none left to try, and no other server may serve it whole
            metrics.requests.inc(req.model, tried[-1].node_class, decision.label, "503")
            why = prefill.reason if prefill is not None and prefill.reason else ""
            return error_response(
                ClientError(
                    503,
                    "every prefill server tried failed and no server is left to serve the "
                    f"request{': ' + why if why else ''}; try again later",
                    "server_error",
                )
            )
        return await self._decode(request, parsed, req, path, headers, started, done)

    async def _decode(
        self,
        request: web.Request,
        parsed: Parsed,
        req: Request,
        path: str,
        headers: dict[str, str],
        started: float,
        done: Prefilled | None,
    ) -> web.StreamResponse:
        """The answer from a decode server: pulling the prompt's KV cache from the prefill
        server `done` names, or prefilling the prompt itself (no `done`, or after a decode
        server that received the parameters failed: the blocks it may have pulled are gone)."""
        metrics = self.hooks.metrics
        extra = {}
        if done is not None:
            extra["X-Fleet-Prefill-Backend"] = header_value(host_port(done.backend))
        params = done.params if done is not None else None
        stream = bool(parsed.body.get("stream"))
        decoders: list[Backend] = []
        status = 502
        for _ in range(self.max_retries + 1):
            d = self._decode_server(req, decoders, params is not None)
            if d is None:
                status = 503 if not decoders else 502
                break
            decoders.append(d)
            request[SERVED_BY] = d
            body = disagg.decode_body(parsed.body, served_name(d), params)
            out = await self.attempt(
                request, body, req, d, path, headers, stream, started, extra, params is not None
            )
            if out is not None:
                metrics.requests.inc(req.model, d.node_class, "decode", str(out.status))
                return out
            lease = request[LAST_ATTEMPT]
            if params is not None and not lease.reached:
                continue  # it never got the parameters: the next one pulls the blocks
            if params is not None and done is not None:
                # It got them and failed: vLLM's decode server frees the prefill server's
                # blocks when it pulled them or aborts (a dropped connection), but one that
                # failed without a word (its engine dead) leaves them to the lease.
                self.held.hold(done.backend.name)
            params = None
        if params is not None and done is not None:
            self.held.hold(done.backend.name)  # no decode server received them at all
        last = decoders[-1] if decoders else done.backend if done is not None else None
        metrics.requests.inc(req.model, last.node_class if last else "", "decode", str(status))
        if status == 503:
            why = f"no decode server can serve {req.model} now; try again later"
            return error_response(ClientError(503, why, "server_error"))
        return error_response(
            ClientError(502, "every decode server tried failed before answering", "server_error")
        )

    async def _prefill(
        self, b: Backend, body: dict[str, Any], req: Request, path: str, headers: dict[str, str]
    ) -> Prefilled | web.Response | None:
        """The prompt on prefill server `b`: where its KV cache waits (Prefilled), a client
        error to pass on as it is (a 4xx Response), or None when `b` failed (retry)."""
        live, admission = self.hooks.live, self.hooks.admission
        first = False
        try:
            prompt = disagg.prefill_body(body, served_name(b))
            up = await _post(self.upstream, b.name + path, prompt, headers)
            with up:
                data = await up.read()
            if up.status in RETRY_STATUSES:
                raise BackendFailed(f"status {up.status}")
            first = True
            if up.status != 200:
                return web.Response(
                    body=without_owned(data), status=up.status, content_type="application/json"
                )
            if live is not None:
                live.succeeded(b)
            return Prefilled(b, disagg.transfer_params(data))
        except FAILURES as e:
            if live is not None:
                live.failed(b, time.monotonic(), str(e) or type(e).__name__)
            return None
        finally:
            b = current(b, admission.backends)
            if first:
                first_token(b, req)
            release(b, req, first)
            admission.wake()

    def _decode_server(
        self, req: Request, tried: list[Backend], transferred: bool
    ) -> Backend | None:
        """The decode server for the prompt, held for it from now: the one it slows least
        with room, else the least busy (its vLLM queues it); None when none may serve it.
        One that must prefill the prompt itself counts it as pending there."""
        admission = self.hooks.admission
        left = [b for b in admission.backends if b not in tried]
        decision = admission.scheduler.decode_for(req, left, force=True)
        if decision is None or decision.backend is None:
            return None
        b = decision.backend
        if not transferred:
            b.pending_prefill += req.prefill_tokens
            b.pending_prefill_s += prompt_prefill_s(b, req)
        return b

    async def _place_again(self, req: Request, tried: list[Backend]) -> Decision | None:
        """A retry is a normal scheduler entry: the same priority and arrival (it keeps its
        place in line), minus the backends that failed, and it waits for room like any other.
        For a split model it is a prefill server while one is left, else a whole placement."""
        req.exclude = frozenset(b.name for b in tried)
        if not self.hooks.admission.could_serve(req):
            return None  # no backend left to try: do not wait in line for nothing
        try:
            decision = await self.hooks.admission.place(req)
        except ClientError:  # no room in time: the client gets the 502
            return None
        return decision

    def _headers(self, request: web.Request) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.backend_api_key:
            headers["Authorization"] = f"Bearer {self.backend_api_key}"
        elif self.api_key is None and "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]  # the client's, for vLLM
        return headers

    async def attempt(
        self,
        request: web.Request,
        raw: bytes,
        req: Request,
        b: Backend,
        path: str,
        headers: dict[str, str],
        stream: bool,
        started: float,
        extra: dict[str, str] | None = None,
        prefilled: bool = False,
    ) -> web.StreamResponse | None:
        """Send to `b` and relay its answer; None when it failed before the first byte reached
        the client (the caller may retry). The one place an attempt's outcome is handled.
        `extra`: headers for the client's answer; `prefilled`: `b` decodes a prompt another
        server prefilled (its body carries the KV transfer's parameters)."""
        lease = Lease(self.hooks, b, req, started, prefilled)
        request[LAST_ATTEMPT] = lease
        relay = Stream() if stream else None
        try:
            up = await _post(self.upstream, b.name + path, body_for(b, raw), headers)
            # Leaving this block before the answer's end closes the upstream connection: vLLM
            # sees a disconnect and aborts the request, which is what a client that left needs.
            with up:
                if up.status in RETRY_STATUSES:
                    with contextlib.suppress(UpstreamError, TimeoutError):
                        await up.read()
                    raise BackendFailed(f"status {up.status}")
                if self.hooks.live is not None:
                    self.hooks.live.succeeded(b)
                if relay is None or up.status != 200:
                    relay = None
                    return await relay_whole(up, b, lease, extra)
                return await relay.relay(request, up, b, lease, extra)
        except FAILURES as e:
            lease.reached = not isinstance(e, Unreached)
            lease.failed(str(e) or type(e).__name__)
            if relay is None or relay.out is None:
                return None  # nothing reached the client yet: retry elsewhere
            await relay.end_with_error(e)
            return relay.out
        except BaseException:
            # The client went away (cancelled) or a write failed, or a bug: never leave the
            # counters raised.
            lease.abandoned()
            raise


class Unreached(BackendFailed):
    """The backend refused the connection: it cannot have received the request."""


async def _post(upstream: Transport, url: str, raw: bytes, headers: dict[str, str]) -> Answer:
    """A connection that cannot be made is the backend failing, like a bad answer; an OSError
    later on is the client's connection, so it is told apart here."""
    try:
        return await upstream.post(url, raw, headers)
    except TimeoutError:
        raise
    except OSError as e:
        refused = (e, getattr(e, "os_error", None), e.__cause__)
        if any(isinstance(x, ConnectionRefusedError) for x in refused):
            raise Unreached(f"cannot connect: {type(e).__name__}") from e
        raise BackendFailed(f"cannot connect: {type(e).__name__}") from e
