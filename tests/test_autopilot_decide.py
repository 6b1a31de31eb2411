"""The autopilot's decisions (autopilot/decide.py) on the seed's multi-model fleet: it follows
a surge at once, lets servers go only after `down_after` quiet intervals, keeps each model's
floor, spends at most its hourly budget of moves, and says why it held anything back."""

from __future__ import annotations

import dataclasses

import pytest

from fleetctl.autopilot.changes import Costs, Resident
from fleetctl.autopilot.decide import Autopilot, Settings
from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from tests.conftest import REPO

GB = 10**9
COSTS = Costs(start_s=lambda d: 90.0, wake_s=lambda d, lvl: 2.0, host_bytes=lambda n: 1000 * GB)
QUIET = {"llama-3-70b": 6.0, "llama-2-13b": 12.0, "llama-3-8b": 60.0}  # per 60 s: 1/5 of planned


@pytest.fixture(scope="module")
def inv(tmp_path_factory):
    """The seed's multi-model fleet, its servers started with sleep mode."""
    text = (REPO / "inventory" / "seed-multi-model.yaml").read_text()
    path = tmp_path_factory.mktemp("inv") / "fleet.yaml"
    path.write_text(text.replace("planner:\n", "planner:\n  sleep_mode: true\n"))
    return load_inventory(path, load_catalog())


def _pilot(inv, **settings) -> Autopilot:
    running = [Resident(d) for d in plan_fleet(inv).deployments]
    assert all("--enable-sleep-mode" in d.vllm_args for d in pilot_servers(running))
    pilot = Autopilot(inv, COSTS, Settings(gate=False, **settings), running)
    for _ in range(10):
        pilot.record(QUIET)
    return pilot


def pilot_servers(residents):
    return [r.deployment for r in residents]


def _count(deployments, model):
    return sum(1 for d in deployments if d.model == model)


def test_quiet_traffic_lets_servers_go_only_after_the_hold(inv):
    pilot = _pilot(inv, down_after=3)
    before = len(pilot.awake())
    for k in range(2):
        d = pilot.decide(60.0 * k)
        assert d.changes == [] and any("unneeded" in h for h in d.held), d.to_json()
        pilot.carried_out(d)
        pilot.record(QUIET)
    d = pilot.decide(120.0)
    leaving = [c for c in d.changes if c.kind == "sleep"]
    assert len(leaving) >= len(d.changes) - 1, d.to_json()  # at most one re-placement
    pilot.carried_out(d)
    assert len(pilot.awake()) < before
    for model in QUIET:
        assert _count(pilot.awake(), model) >= 1


def test_a_surge_is_followed_at_once_by_waking_sleepers(inv):
    pilot = _pilot(inv, down_after=1)
    d = pilot.decide(0.0)
    pilot.carried_out(d)
    low = _count(pilot.awake(), "llama-3-8b")
    for _ in range(3):
        pilot.record(QUIET | {"llama-3-8b": 900.0})  # 15 req/s, above the inventory's 14
    d = pilot.decide(60.0)
    ups = [c for c in d.changes if c.kind in ("wake", "start")]
    assert ups and {c.deployment.model for c in ups} == {"llama-3-8b"}
    # Its sleepers wake (seconds) before anything starts cold (minutes).
    wakes = [c for c in ups if c.kind == "wake"]
    assert len(wakes) >= 2 and all(c.seconds == 2.0 for c in wakes)
    pilot.carried_out(d)
    assert _count(pilot.awake(), "llama-3-8b") > low


def test_each_model_keeps_its_floor_with_no_traffic(inv):
    pilot = _pilot(inv, down_after=1, floor=1)
    for _ in range(10):
        pilot.record({})
    d = pilot.decide(0.0)
    pilot.carried_out(d)
    for model in QUIET:
        assert _count(pilot.awake(), model) >= 1, d.to_json()


def test_moves_beyond_the_hours_budget_wait(inv):
    pilot = _pilot(inv, down_after=1)
    first = pilot.decide(0.0)
    spent = sum(1 for c in first.changes if c.kind in ("wake", "start"))  # re-placements
    pilot.carried_out(first)
    # One move left in the hour.
    pilot.settings = dataclasses.replace(pilot.settings, moves_per_hour=spent + 1)
    for _ in range(3):
        pilot.record(QUIET | {"llama-3-8b": 900.0})
    d = pilot.decide(60.0)
    ups = [c for c in d.changes if c.kind in ("wake", "start")]
    assert [c.kind for c in ups] == ["wake"]  # the hour's last move: the quickest
    assert any("budget" in h for h in d.held)
    pilot.carried_out(d)
    d = pilot.decide(120.0)
    assert not any(c.kind in ("wake", "start") for c in d.changes)


def test_the_gate_refuses_a_fleet_that_serves_the_recent_traffic_worse(inv):
    """The what-if replay: a target without most of the 8B servers, on a minute of 8B traffic
    the running fleet carries, meets the objectives for fewer requests: refused, with both
    figures."""
    from fleetctl.sim.workload import Synthetic

    pilot = _pilot(inv)
    recent = {"llama-3-8b": Synthetic(model="llama-3-8b", rate=30, duration=60).generate(1)}
    thin = [d for d in pilot.awake() if d.model != "llama-3-8b"]
    thin += [d for d in pilot.awake() if d.model == "llama-3-8b"][:1]
    why = pilot._gate(thin, recent, {})
    assert why is not None and why.startswith("gate:"), why
    assert pilot._gate(pilot.awake(), recent, {}) is None


def test_a_model_that_misses_its_slo_is_planned_for_more_traffic(inv):
    """The measured correction: an interval in which the 8B met its objectives for 90% of
    its requests raises the traffic it is planned for by 1.5x (up to 4x), and it gets more
    servers; intervals that meet them give it back slowly; too few requests judge nothing."""
    pilot = _pilot(inv, down_after=1)
    pilot.carried_out(pilot.decide(0.0))
    before = _count(pilot._plan({m: forecast_of(v) for m, v in QUIET.items()}), "llama-3-8b")
    pilot.record(QUIET, {"llama-3-8b": (90, 100)})
    assert pilot.headroom["llama-3-8b"] == pytest.approx(1.5)
    for _ in range(10):
        pilot.record(QUIET, {"llama-3-8b": (90, 100)})
    assert pilot.headroom["llama-3-8b"] == pytest.approx(4.0)
    after = _count(pilot._plan({m: forecast_of(v) for m, v in QUIET.items()}), "llama-3-8b")
    assert after > before
    pilot.record(QUIET, {"llama-3-8b": (100, 100)})
    assert pilot.headroom["llama-3-8b"] < 4.0
    pilot.record(QUIET, {"llama-2-13b": (0, 10)})  # too few to judge
    assert "llama-2-13b" not in pilot.headroom


def forecast_of(count: float):
    from fleetctl.autopilot.forecast import Forecast

    return Forecast(count, count, "test")
