"""Workload derivation: a known trace replayed through a real route-serve into emulators; the workload
`plan --workload-from` derives from route-serve's request log is the trace's, within 5%.

The scaled-down run of benchmarks/workload_derivation.py: 80 requests of the committed Azure
slice, four times denser, one emulator four times faster (about 20 s on two cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from fleetctl.whatif.predict import KEYS
from tests.conftest import DATA, REPO

SLICE = DATA / "azure_conv_slice.csv"
INVENTORY = REPO / "inventory" / "seed-mixed-8b-16k.yaml"  # the benchmark's
REQUESTS = 80
COMPRESS = 4.0


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The slice replayed once through route-serve by the benchmark itself, scaled down, for
    both tests: its comparison of the derived workload with the trace, and the request log."""
    out = tmp_path_factory.mktemp("replay")
    cmd = [sys.executable, "benchmarks/workload_derivation.py", "--trace", str(SLICE)]
    cmd += ["--requests", str(REQUESTS), "--compress", str(COMPRESS), "--emulators", "1"]
    done = subprocess.run(
        [*cmd, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    run = out / f"{SLICE.stem}-{REQUESTS}"
    result = json.loads((run / "result.json").read_text())
    assert result["statuses"] == {"200": REQUESTS}, result["statuses"]
    return result, run / "state" / "requests"


def test_workload_derived_from_the_request_log_is_the_traces(replayed) -> None:
    c, _ = replayed
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
    """The day-two loop on real traffic: route-serve recorded the replay; the next plan is made
    from that log for cost under an SLO, checked by the simulator on the log's own requests,
    set beside the fleet that runs now on the same requests, with its disruption."""
    _, log = replayed
    text = INVENTORY.read_text().replace(
        "    max_context: 16384\n", "    max_context: 16384\n    slo: {ttft_p99_s: 2.0}\n", 1
    )
    inv_path = tmp_path / "fleet.yaml"
    inv_path.write_text(text)
    inv = load_inventory(inv_path, load_catalog())
    running = plan_fleet(inv)  # what apply ran: the throughput plan, every GPU in use
    StateDir.of(inv).save_state(State(1, running.deployments))
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
