"""A simulated fleet that changes while it runs (sim/controls.py): servers slept, woken and
started at given times or by a controller at its ticks, kept out of routing until ready, their
drains finished, and their GPU-hours counted from their awake spans."""

from __future__ import annotations

import pytest

from fleetctl.sim.controls import Control, Observation
from fleetctl.sim.fleet import simulate
from fleetctl.sim.workload import Synthetic
from tests.routing.test_policy import server


def _fleet(catalog):
    return [server(catalog, f"rtx-{i}", "RTX-4090") for i in range(2)]


def _items(rate=2.0, duration=120.0):
    return Synthetic(model="llama-3-8b", rate=rate, duration=duration).generate(1)


def _by_server(result):
    out: dict[str, list] = {}
    for o in result.outcomes:
        out.setdefault(o.backend, []).append(o)
    return out


def test_a_server_put_to_sleep_takes_nothing_new_and_its_drain_ends_its_span(catalog):
    items = _items()
    r = simulate(_fleet(catalog), items, "round-robin", controls=[Control(30.0, "rtx-1", "sleep")])
    mine = _by_server(r)["rtx-1"]
    assert mine and all(o.dispatched <= 30.0 for o in mine)
    assert all(o.done for o in r.outcomes)  # what it ran at 30 s finished there
    drained = max(o.finished for o in mine)
    assert drained >= 30.0
    assert r.awake.actions == {"sleep": 1}
    end = max(o.finished for o in r.outcomes)
    # rtx-0 awake to the end, rtx-1 to its drain; one GPU each.
    assert r.awake.gpu_hours(end) == pytest.approx((end + drained) / 3600)


def test_a_woken_server_serves_only_once_ready(catalog):
    items = _items()
    r = simulate(
        _fleet(catalog),
        items,
        "round-robin",
        down=["rtx-1"],
        controls=[Control(40.0, "rtx-1", "wake", ready_s=5.0)],
    )
    mine = _by_server(r)["rtx-1"]
    assert mine and min(o.dispatched for o in mine) >= 45.0
    assert r.awake.actions == {"wake": 1}
    end = max(o.finished for o in r.outcomes)
    assert r.awake.gpu_hours(end) == pytest.approx((end + (end - 40.0)) / 3600)


def test_a_controller_sees_the_arrivals_and_moves_the_fleet_at_its_ticks(catalog):
    items = _items(duration=300.0)
    seen: list[Observation] = []

    def controller(o: Observation):
        seen.append(o)
        if o.now == 60.0:
            return [Control(o.now, "rtx-1", "sleep")]
        if o.now == 180.0:
            return [Control(o.now, "rtx-1", "wake", ready_s=2.0)]
        return []

    r = simulate(_fleet(catalog), items, "round-robin", controller=controller, tick_s=60.0)
    assert [o.now for o in seen][:5] == [0.0, 60.0, 120.0, 180.0, 240.0]
    at_120 = seen[2]
    assert len(at_120.arrived) == sum(1 for w in items if w.arrival < 120.0)
    assert at_120.states["rtx-1"] == "asleep" and seen[4].states["rtx-1"] == "awake"
    mine = _by_server(r)["rtx-1"]
    assert not any(60.0 < o.dispatched < 182.0 for o in mine)
    assert any(o.dispatched >= 182.0 for o in mine)
    assert r.awake.actions == {"sleep": 1, "wake": 1}


def test_controls_must_name_known_servers(catalog):
    with pytest.raises(ValueError, match="unknown server"):
        simulate(_fleet(catalog), _items(), "round-robin", controls=[Control(1, "nope", "stop")])


@pytest.mark.parametrize("policy", ["round-robin", "hardware-aware"])
def test_requests_wait_for_a_models_only_server_while_it_wakes(catalog, policy):
    """The simulated router applies route-serve's rule (routing/policy.py, eligible): with
    every server of the model asleep and one waking, arrivals wait in the router's queue for
    it and are served once it is ready; none is sent before, none refused meanwhile."""
    items = _items(duration=60.0)
    r = simulate(
        _fleet(catalog),
        items,
        policy,
        down=["rtx-0", "rtx-1"],
        controls=[Control(0.0, "rtx-1", "wake", ready_s=20.0)],
    )
    assert not any(o.rejected for o in r.outcomes)
    mine = _by_server(r)["rtx-1"]
    assert len(mine) == len(items)
    assert min(o.dispatched for o in mine) >= 20.0
    # The ones that waited go at its ready instant (hardware-aware: within its KV caps).
    early = [o for o in mine if o.item.arrival < 20.0]
    assert early and min(o.dispatched for o in early) == pytest.approx(20.0)


@pytest.mark.parametrize("policy", ["round-robin", "hardware-aware"])
def test_the_router_wakes_a_sleeper_itself_when_its_model_has_none_awake(catalog, policy):
    """route-serve's rule in the simulator: with every server of the model put to sleep in
    sleep mode, the first arrival's dispatch wakes one (a "router wake") and the requests
    wait for it in the router's queue; none is refused, none reaches it before it is ready,
    and a second server is not woken for requests the waking one will take."""
    items = _items(rate=0.5, duration=60.0)
    r = simulate(
        _fleet(catalog),
        items,
        policy,
        controls=[
            Control(0.0, "rtx-0", "sleep", wake_s=5.0),
            Control(0.0, "rtx-1", "sleep", wake_s=5.0),
        ],
    )
    assert not any(o.rejected for o in r.outcomes)
    assert all(o.done for o in r.outcomes)
    assert r.awake.actions == {"sleep": 2, "router wake": 1}
    first = min(items, key=lambda w: w.arrival).arrival
    assert min(o.dispatched for o in r.outcomes) == pytest.approx(first + 5.0)


def test_a_server_stopped_or_asleep_without_sleep_mode_is_not_woken_by_the_router(catalog):
    items = _items(rate=0.5, duration=30.0)
    controls = [Control(0.0, "rtx-0", "sleep"), Control(0.0, "rtx-1", "stop")]
    r = simulate(_fleet(catalog), items, "round-robin", controls=controls)
    assert all(o.rejected for o in r.outcomes)
    assert "router wake" not in r.awake.actions


def test_the_router_never_wakes_a_sleeper_whose_gpu_another_server_holds(catalog):
    """Two models on one RTX 4090, Llama-3 8B asleep under an awake Mistral 7B (what the
    autopilot leaves when it moves a GPU): a wake there would fail out of memory, so the
    8B's requests are refused with the reason, and none ever reaches its server; once the
    Mistral server stops, the router wakes the 8B's and serves them."""
    from dataclasses import replace

    llama = replace(server(catalog, "box", "RTX-4090"), name="box:8000", gpus=(0,))
    mistral = replace(
        server(catalog, "box", "RTX-4090", model="mistral-7b"), name="box:8001", gpus=(0,)
    )
    items = _items(rate=0.5, duration=60.0)
    sleep = Control(0.0, "box:8000", "sleep", wake_s=2.0)
    r = simulate([llama, mistral], items, "hardware-aware", controls=[sleep])
    assert all(o.rejected and "GPUs another server holds" in o.rejected for o in r.outcomes)
    assert "router wake" not in r.awake.actions
    # The GPU freed at 30 s: later arrivals wake the 8B's server and are served.
    r = simulate(
        [llama, mistral],
        items,
        "hardware-aware",
        controls=[sleep, Control(30.0, "box:8001", "stop")],
    )
    late = [o for o in r.outcomes if o.item.arrival > 30.0]
    assert late and all(o.done for o in late)
    assert r.awake.actions.get("router wake") == 1
