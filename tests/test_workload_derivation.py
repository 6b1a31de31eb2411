"""Issue 13: a known trace replayed through a real route-serve into emulators; the workload
`plan --workload-from` derives from route-serve's request log is the trace's, within 5%.

The scaled-down run of benchmarks/workload_derivation.py: 80 requests of the committed Azure
slice, four times denser, one emulator four times faster (about 20 s on two cores).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from benchmarks.workload_derivation import INVENTORY, compare, replay, trace_items
from fleetctl.catalog import load_catalog
from fleetctl.inventory import load_inventory

SLICE = Path(__file__).parent / "data" / "azure_conv_slice.csv"
REQUESTS = 80
COMPRESS = 4.0


def test_workload_derived_from_the_request_log_is_the_traces(tmp_path: Path) -> None:
    inv = load_inventory(INVENTORY, load_catalog())
    items = trace_items(SLICE, inv.models[0].name, 0, REQUESTS)
    run = asyncio.run(replay(items, tmp_path, COMPRESS, COMPRESS, emulators=1))
    assert run.statuses == {"200": REQUESTS}, run.statuses

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
