"""Admission in the daemon: each request waits on a future until the scheduler places it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetctl.daemon.telemetry import RouterMetrics
from fleetctl.routing.request import ClientError
from fleetctl.routing.scheduler import Scheduler, release
from fleetctl.routing.types import Backend, Decision, Request


@dataclass
class Waiter:
    request: Request
    future: asyncio.Future[Decision]


@dataclass
class Admission:
    """The scheduler, driven by the event loop: `place` queues a request (a first attempt or
    a retry alike) and returns its Decision once the scheduler has placed it, already
    accounted on its backend."""

    scheduler: Scheduler
    backends: list[Backend]  # the router's list: a reload replaces its contents in place
    metrics: RouterMetrics
    queue_timeout_s: float = 300.0
    # Asked to wake a server a dispatch chose while it slept (its requests wait here).
    on_wake: Callable[[Backend], None] | None = None
    waiting: dict[int, Waiter] = field(default_factory=dict)
    _ids: int = 0
    _kick: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        """Places queued requests whenever something changes, and at least every 50 ms (aging)."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await self._kick.wait()
            self._kick.clear()
            self.dispatch()

    def wake(self) -> None:
        """Something changed (a request ended or failed): let the dispatcher place what waits.
        Nothing waits almost always; then waking it would cost a task switch and a new timer
        per request for nothing."""
        if self.waiting:
            self._kick.set()

    def kick(self) -> None:
        """The backends changed (a reload): look at the queue again."""
        self._kick.set()

    def could_serve(self, req: Request) -> bool:
        """Whether any backend `req` does not exclude may ever serve it (room aside)."""
        left = [b for b in self.backends if b.name not in req.exclude]
        return bool(self.scheduler.policy.eligible(req, left)[0])

    def dispatch(self) -> None:
        if not len(self.scheduler):
            return
        before = self.scheduler.boosts
        sent, rejected = self.scheduler.dispatch(time.monotonic(), self.backends)
        if self.scheduler.boosts > before:
            self.metrics.boosts.inc(by=self.scheduler.boosts - before)
        for b in self.scheduler.take_woken():
            if self.on_wake is not None:
                self.on_wake(b)
        for d in (*sent, *rejected):
            w = self.waiting.pop(d.request.id, None)  # type: ignore[arg-type]
            if w is not None and not w.future.done():
                w.future.set_result(d.decision)
            elif d.decision.backend is not None:
                release(d.decision.backend, d.request, first_token_seen=False)  # client gone

    async def place(self, req: Request) -> Decision:
        """Queue `req` and wait for its Decision; a 503 ClientError after queue_timeout_s."""
        self._ids += 1
        req.id = self._ids
        fut: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self.waiting[req.id] = Waiter(req, fut)
        self.scheduler.submit(req)
        self.dispatch()  # most requests are placed right here, without a task switch
        if fut.done():
            return fut.result()
        placed = False
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns the result, and drops the
            # cancellation, when the client leaves in the same loop turn as the request is placed
            # (the handler then ran on for a client long gone; fixed in 3.12).
            async with asyncio.timeout(self.queue_timeout_s):
                decision = await fut
            placed = True
            return decision
        except TimeoutError:
            raise ClientError(
                503, "no backend had room in time; try again later", "server_error"
            ) from None
        finally:
            if not placed:  # timed out or the client went away: leave the queue
                self.waiting.pop(req.id, None)
                self.scheduler.remove(req)
                # Placed in the same loop turn as the client left: give the room back.
                if fut.done() and not fut.cancelled():
                    b = fut.result().backend
                    if b is not None:
                        release(b, req, first_token_seen=False)
