"""route-serve's counters across a reload: a request placed before state.json changed gives its
room back to the server as route-serve lists it after, so a fleet the autopilot moves (every
sleep and wake is a reload) never keeps a server full of requests long gone."""

from __future__ import annotations

import time

from fleetctl.fleet.state import State, server_name
from tests.autopilot.test_autopilot_live import _in_flight, _metric, fleet  # noqa: F401 (the fixture)


def _outstanding(f) -> dict[str, float | None]:  # type: ignore[no-untyped-def]
    names = [f"http://{d.host}:{d.port}" for d in f.deployments]
    return {n: _metric(f, "fleetctl_backend_outstanding_requests", backend=n) for n in names}


def test_an_answer_in_flight_through_a_reload_gives_its_room_back(fleet):  # noqa: F811
    fleet.reset()
    socks = [_in_flight(fleet) for _ in range(2)]
    try:
        assert sum(v or 0 for v in _outstanding(fleet).values()) == 2
        one, two = fleet.deployments
        # A change of state.json (the autopilot marks a server draining): route-serve reloads.
        fleet.sdir.save_state(State(1, (one, two), draining=frozenset({server_name(two)})))
        end = time.monotonic() + 30
        while "reloaded" not in fleet.router.tail(50):
            assert time.monotonic() < end, fleet.router.tail()
            time.sleep(0.05)
    finally:
        for s in socks:
            s.close()  # the clients leave: their answers end at route-serve
    end = time.monotonic() + 30
    while any(_outstanding(fleet).values()):
        assert time.monotonic() < end, _outstanding(fleet)
        time.sleep(0.05)
    fleet.reset()
