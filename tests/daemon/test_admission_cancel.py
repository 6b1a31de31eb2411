"""A client that leaves in the same loop turn as its queued request is placed: the request ends
(it is cancelled, not served) and its room on the backend is given back.

On Python 3.11, asyncio.wait_for returned the placement and dropped the cancellation in that
case, so the handler went on to send the request for a client long gone. It showed as a rare
failure of tests/daemon/test_router_outcomes.py, which took 30 s: the upstream timeout.
"""

from __future__ import annotations

import asyncio

import pytest

from fleetctl.daemon.admission import Admission
from fleetctl.daemon.telemetry import RouterMetrics
from fleetctl.model.perf import EnginePerf
from fleetctl.routing.policy import HardwareAware
from fleetctl.routing.scheduler import Scheduler, release
from fleetctl.routing.types import Backend, Request


def test_a_client_that_leaves_as_it_is_placed_gives_the_room_back(catalog):
    g, m, f = catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3-8b"), catalog.format("bf16")
    b = Backend("b", "n", g.name, "llama-3-8b", "bf16", 10_000, 1, EnginePerf(g, m, f))

    async def scenario() -> None:
        admission = Admission(Scheduler(HardwareAware()), [b], RouterMetrics())
        first = Request("first", "llama-3-8b", 10, 10, arrival=0)
        await admission.place(first)  # the backend's one seat
        waiting = asyncio.create_task(
            admission.place(Request("second", "llama-3-8b", 10, 10, arrival=0))
        )
        await asyncio.sleep(0)
        assert b.outstanding == 1 and len(admission.waiting) == 1  # queued: no room
        # The first request ends, the second is placed, and its client leaves: one loop turn.
        release(b, first)
        admission.dispatch()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert b.outstanding == 0

    asyncio.run(scenario())
