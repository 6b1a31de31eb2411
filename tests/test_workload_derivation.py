"""Issue 13: a known trace replayed through a real route-serve into emulators; the workload
`plan --workload-from` derives from route-serve's request log is the trace's, within 5%.

The scaled-down run of benchmarks/workload_derivation.py: 80 requests of the committed Azure
slice, four times denser, one emulator four times faster (about 20 s on two cores).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.workload_derivation import INVENTORY, compare, replay, trace_items
from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from fleetctl.whatif.predict import KEYS

SLICE = Path(__file__).parent / "data" / "azure_conv_slice.csv"
REQUESTS = 80
COMPRESS = 4.0


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    """The slice replayed once through route-serve, for both tests: its items, the run (with
    its log folder) and the inventory."""
    inv = load_inventory(INVENTORY, load_catalog())
    items = trace_items(SLICE, inv.models[0].name, 0, REQUESTS)
    run = asyncio.run(
        replay(items, tmp_path_factory.mktemp("replay"), COMPRESS, COMPRESS, emulators=1)
    )
    assert run.statuses == {"200": REQUESTS}, run.statuses
    return items, run, inv


def test_workload_derived_from_the_request_log_is_the_traces(replayed) -> None:
    items, run, inv = replayed

    c = compare(items, run.log, inv, COMPRESS)
    rows = {r["figure"]: r for r in c["rows"]}
    assert c["log"]["requests"] == REQUESTS and c["log"]["source"] == "log"
    # Rates on either clock, and the mean lengths: the 5%.
    judged = [r for r in c["rows"] if r["judged"]]
    assert {r["figure"] for r in judged} >= {
        "req/s, replay clock",
        "req/s, trace clock (log x C)",
        "mean prompt tokens",
        "mean output tokens",
    }
    for r in judged:
        assert abs(r["error"]) <= 0.05, r
    # The prompts are sent at the 4 characters per token route-serve counts before it learns
    # a ratio: their lengths come back exactly (the tail and the long share with them).
    assert rows["mean prompt tokens"]["log"] == rows["mean prompt tokens"]["trace"]
    assert rows["p95 prompt tokens"]["log"] == rows["p95 prompt tokens"]["trace"]
    assert abs(rows["long share"]["error"]) <= 0.05, rows["long share"]


def test_the_day_two_loop_replans_from_the_log_with_cost_slos_and_a_what_if(
    replayed, cli, tmp_path: Path
) -> None:
    """Issue 13's loop on real traffic: route-serve recorded the replay; the next plan is made
    from that log for cost under an SLO, checked by the simulator on the log's own requests,
    set beside the fleet that runs now on the same requests, with its disruption."""
    _, run, _ = replayed
    text = INVENTORY.read_text().replace(
        "    max_context: 16384\n", "    max_context: 16384\n    slo: {ttft_p99_s: 2.0}\n", 1
    )
    inv_path = tmp_path / "fleet.yaml"
    inv_path.write_text(text)
    inv = load_inventory(inv_path, load_catalog())
    running = plan_fleet(inv)  # what apply ran: the throughput plan, every GPU in use
    StateDir.of(inv).save_state(State(1, running.deployments))
    log = run.log
    r = cli(
        *("plan", inv_path, "--workload-from", log, "--objective", "cost"),
        *("--what-if", log, "--json"),
    )
    assert r.code == 0, r.err
    data = json.loads(r.out)
    model = inv.models[0].name
    assert data["workloads"][model]["source"] == "log"
    (checked,) = data["slo_checks"]
    assert checked["traffic"] == "trace" and checked["requests"] == REQUESTS and checked["met"]
    w = data["what_if"]
    assert set(w["current"]) == set(KEYS) == set(w["candidate"])
    assert w["candidate"]["gpus"] < w["current"]["gpus"] == len(running.deployments)
    assert w["candidate"]["cost_per_hour"] < w["current"]["cost_per_hour"]
    assert w["candidate"]["slo_attainment"] >= 0.99
    assert data["disruption"]["servers_stopped"] > 0  # the GPUs the cost plan gives back
