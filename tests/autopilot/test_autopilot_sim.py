"""The autopilot against the simulator (autopilot/simulated.py): its decisions become the
simulated fleet's controls on one clock for every model; no request is ever dispatched to a
server while it sleeps or warms up; the fleet's GPU-hours follow the awake spans; a static run
of the same fleet keeps every GPU awake."""

from __future__ import annotations

import pytest

from fleetctl.autopilot.decide import Settings
from fleetctl.autopilot.simulated import run_autopilot, run_reactive, run_static
from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.sim.scenario import Burst, ModelTraffic, generate
from fleetctl.sim.workload import WorkItem
from tests.conftest import REPO

SHAPES = [(300, 60), (1200, 200), (600, 120), (2500, 100)]


@pytest.fixture(scope="module")
def inv(tmp_path_factory):
    text = (REPO / "inventory" / "seed-multi-model.yaml").read_text()
    path = tmp_path_factory.mktemp("inv") / "fleet.yaml"
    path.write_text(text.replace("planner:\n", "planner:\n  sleep_mode: true\n"))
    return load_inventory(path, load_catalog())


@pytest.fixture(scope="module")
def traffic():
    """20 minutes: quiet 70B and 13B, an 8B that bursts 4x from minute 10 to 14."""
    models = [
        ModelTraffic("llama-3-8b", SHAPES, 1.5, bursts=[Burst(600, 240, 4.0)]),
        ModelTraffic("llama-2-13b", SHAPES, 0.3),
        ModelTraffic("llama-3-70b", SHAPES, 0.1),
    ]
    out: dict[str, list[WorkItem]] = {}
    for row in generate(models, hours=1 / 3, seed=4):
        mine = out.setdefault(str(row["model"]), [])
        mine.append(WorkItem(len(mine), row["timestamp"] / 1000, row["input_length"],
                             row["output_length"], str(row["model"])))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def runs(inv, traffic):
    settings = Settings(interval_s=60, down_after=3, gate=False)
    return run_static(inv, traffic), run_autopilot(inv, traffic, settings)


def test_the_autopilot_moves_the_fleet_and_no_request_meets_a_sleeping_server(runs):
    _, auto = runs
    actions = auto.fleet()["actions"]
    assert actions.get("sleep", 0) > 0, auto.decisions[-1].to_json()
    awake = auto.result.awake
    assert awake is not None
    end = auto.span_s
    spans = [*awake.spans, *((n, a, max(a, end + 1e9)) for n, a in awake.since.items())]
    for o in auto.result.outcomes:
        if o.backend is None:
            continue
        assert any(n == o.backend and a <= o.dispatched <= b for n, a, b in spans), o
    assert all(o.done for o in auto.result.outcomes)


def test_gpu_hours_follow_the_awake_spans(runs):
    static, auto = runs
    gpus = 16  # the seed's multi-model fleet: 4 A100 pairs and 8 RTX 4090s
    assert static.fleet()["gpu_hours"] == pytest.approx(gpus * static.span_s / 3600, rel=1e-3)
    assert static.fleet()["actions"] == {}
    assert auto.fleet()["gpu_hours"] < static.fleet()["gpu_hours"]


def test_each_decision_is_kept_with_its_figures(runs):
    _, auto = runs
    assert len(auto.decisions) >= 15
    first = auto.decisions[0].to_json()
    assert set(first) == {"at_s", "forecast", "servers", "changes", "held"}
    assert set(first["forecast"]) == {"llama-3-8b", "llama-2-13b", "llama-3-70b"}


def test_the_reactive_scaler_stops_idle_replicas_and_starts_them_on_waiting(inv, traffic):
    """KEDA-like: the quiet models lose replicas once the scale-down window has passed, the
    bursting 8B's waiting requests bring replicas back (cold starts), each model keeps one."""
    day = run_reactive(inv, traffic)
    actions = day.fleet()["actions"]
    assert actions.get("stop", 0) > 0 and actions.get("start", 0) > 0, actions
    awake = day.result.awake
    assert awake is not None
    stops = [(n, b) for n, _, b in awake.spans]
    assert min(b for _, b in stops) >= 300.0  # not before the 300 s stabilization window
    for model in ("llama-3-8b", "llama-2-13b", "llama-3-70b"):
        assert any(model in n for n in awake.since), model  # its floor stays up
