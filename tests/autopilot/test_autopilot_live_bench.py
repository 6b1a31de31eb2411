"""benchmarks/autopilot_live.py's machinery on a tiny scenario: six emulators with sleep mode,
route-serve and `fleetctl autopilot` over half a minute of traffic, and the simulator's
prediction of it; only the plumbing is asserted (both runs give their figures, and the
autopilot acted live), not the timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO


def test_the_live_run_and_its_prediction_both_give_their_figures(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "benchmarks" / "autopilot_live.py"), "--minutes", "0.5"]
    cmd += ["--interval", "3", "--down-after", "1", "--drain", "20", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| GPU-hours |" in run.stdout
    result = json.loads((out / "result.json").read_text())
    live, sim = result["live"], result["sim"]
    for figures in (live, sim):
        assert figures["gpu_hours"] > 0
        assert set(figures["models"]) == {"llama-3-8b", "mistral-7b"}
    assert live["samples"] > 0 and live["decisions"] > 0
    # The first interval sees no traffic yet: with --down-after 1 the autopilot sleeps servers.
    assert live["actions"].get("sleep", 0) > 0, live
    assert sum(sim["actions"].values()) > 0, sim
    assert any(m["judged"] for m in live["models"].values()), live
