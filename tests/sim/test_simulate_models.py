"""`simulate` without --model on a multi-model trace: every model on one fleet, with the fleet's
GPU-hours and the share of minutes in which every model met its objectives (sim/multi.py)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from fleetctl.fleet.slo import Slo
from fleetctl.sim.fleet import Outcome, SimResult
from fleetctl.sim.multi import slo_minutes
from fleetctl.sim.workload import WorkItem
from tests.conftest import REPO


def _outcome(model: str, arrival: float, ttft: float) -> Outcome:
    item = WorkItem(0, arrival, 100, 11, model)
    return Outcome(item, "b", arrival, arrival + ttft, arrival + ttft + 0.5)  # TPOT 50 ms


def test_a_minute_holds_when_every_model_meets_its_share_in_it():
    """Two models, three minutes: minute 0 both fine; minute 1 model b misses for half its
    requests; minute 2 only a has requests and meets. 2 of 3 minutes hold."""
    slo = Slo(ttft_s=1.0, tpot_s=0.06, share=0.9)
    a = SimResult("p", [_outcome("a", t, 0.2) for t in (1, 30, 61, 90, 130)], 180, 0, 0, slo=slo)
    b = SimResult(
        "p", [_outcome("b", 5, 0.1), _outcome("b", 65, 0.1), _outcome("b", 70, 5.0)], 180, 0, 0
    )
    b.slo = slo
    share, minutes = slo_minutes([a, b], 180.0)
    assert minutes == 3 and share == pytest.approx(2 / 3)
    # At a share of 0.5, model b's minute 1 (1 of 2 met) holds too.
    b.slo = Slo(ttft_s=1.0, tpot_s=0.06, share=0.5)
    assert slo_minutes([a, b], 180.0)[0] == 1.0


def _scenario(path: Path, rates: dict[str, float], seconds: float, seed: int = 1) -> int:
    """A two-minute multi-model trace: Poisson arrivals per model, the seed's lengths."""
    rng = random.Random(seed)
    rows = []
    for model, rate in rates.items():
        t = 0.0
        while (t := t + rng.expovariate(rate)) < seconds:
            prompt, output = rng.randint(200, 2000), rng.randint(20, 200)
            rows.append({"timestamp": int(t * 1000), "input_length": prompt,
                         "output_length": output, "model": model})  # fmt: skip
    rows.sort(key=lambda r: r["timestamp"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


@pytest.fixture
def multi(tmp_path: Path) -> Path:
    inv = tmp_path / "fleet.yaml"
    shutil.copy(REPO / "inventory" / "seed-multi-model.yaml", inv)
    return inv


def test_simulate_runs_every_model_of_the_trace_on_one_fleet(cli, multi, tmp_path):
    trace = tmp_path / "day.jsonl"
    rates = {"llama-3-8b": 4.0, "llama-2-13b": 2.0, "llama-3-70b": 0.5}
    n = _scenario(trace, rates, 120)
    r = cli("simulate", multi, "--trace", trace, "--policies", "round-robin,hardware-aware",
            "--json")  # fmt: skip
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert set(data["models"]) == set(rates)
    assert sum(m["requests"] for m in data["models"].values()) == n
    for model in rates:
        one = data["models"][model]["policies"]["hardware-aware"]
        assert one["completed"] == one["requests"] > 0
    fleet = data["fleet"]["hardware-aware"]
    span_h = data["span_s"] / 3600
    assert fleet["gpu_hours"] == pytest.approx(data["gpus"] * span_h, rel=1e-3)
    assert 0 <= fleet["slo_minutes"] <= 1 and fleet["minutes"] == 2
    assert fleet["actions"] == {}
    text = cli("simulate", multi, "--trace", trace, "--policies", "hardware-aware")
    assert text.code == 0 and "minutes within SLO" in text.out


def test_rows_that_name_no_model_or_an_unserved_one_are_refused(cli, multi, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n')
    r = cli("simulate", multi, "--trace", trace)
    assert r.code == 2 and "names no model" in r.err and "--model" in r.err
    assert "Traceback" not in r.err
    trace.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5, "model": "llama-3-8b"}\n'
        '{"timestamp": 9, "input_length": 10, "output_length": 5, "model": "gpt-9"}\n'
    )
    r = cli("simulate", multi, "--trace", trace)
    assert r.code == 2 and "'gpt-9'" in r.err and "t.jsonl:2" in r.err
    r = cli("simulate", multi, "--trace", trace, "--load", "0.5")
    assert r.code == 2 and "--load applies to one model's traffic" in r.err


def test_simulate_autopilot_and_the_reactive_scaler_give_the_fleets_figures(cli, multi, tmp_path):
    """`simulate --autopilot` and `--scaler reactive` on a multi-model trace: each model's
    figures and the fleet's gpu_hours, slo_minutes and actions, the names the autopilot's
    acceptance reads."""
    multi.write_text(multi.read_text().replace("planner:\n", "planner:\n  sleep_mode: true\n"))
    trace = tmp_path / "day.jsonl"
    rates = {"llama-3-8b": 3.0, "llama-2-13b": 0.5, "llama-3-70b": 0.2}
    n = _scenario(trace, rates, 600)
    for flag in (["--autopilot"], ["--scaler", "reactive"]):
        r = cli("simulate", multi, "--trace", trace, *flag, "--json")
        assert r.code == 0, r.err
        data = json.loads(r.out)
        assert data["run"] == ("autopilot" if flag == ["--autopilot"] else "reactive")
        assert sum(m["requests"] for m in data["models"].values()) == n
        fleet = data["fleet"]
        assert set(fleet) >= {"gpu_hours", "slo_minutes", "actions"}
        assert 0 < fleet["gpu_hours"] <= 16 * 600 / 3600 + 1e-6 and 0 <= fleet["slo_minutes"] <= 1
    text = cli("simulate", multi, "--trace", trace, "--autopilot")
    assert text.code == 0 and "GPU-hours" in text.out
    for bad, says in (
        (["--autopilot", "--scaler", "reactive"], "not both"),
        (["--scaler", "keda"], "unknown scaler"),
        (["--autopilot", "--load", "0.5"], "multi-model trace"),
    ):
        r = cli("simulate", multi, "--trace", trace, *bad)
        assert r.code == 2 and says in r.err and "Traceback" not in r.err, (bad, r.err)
