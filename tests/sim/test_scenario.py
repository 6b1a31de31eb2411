"""Multi-model scenarios for the autopilot (sim/scenario.py): the daily curve, bursts and
shapes they promise, deterministic by seed, read back by `simulate`'s multi-model reader."""

from __future__ import annotations

from collections import Counter

import pytest

from fleetctl.sim.multi import trace_by_model
from fleetctl.sim.scenario import Burst, ModelTraffic, generate, sine_burst, write

SHAPES = [(100, 10), (2000, 30), (500, 200)]


def _per_hour(rows, model):
    return Counter(int(r["timestamp"] // 3_600_000) for r in rows if r["model"] == model)


def test_a_day_follows_its_curve_and_keeps_its_mean():
    chat = ModelTraffic("chat", SHAPES, mean_rps=0.5, peak_hour=12, swing=4)
    rows = generate([chat], hours=24, seed=1)
    per_hour = _per_hour(rows, "chat")
    assert len(rows) == pytest.approx(0.5 * 86400, rel=0.03)
    # The peak hour (12-13) holds about 4x the trough hour (0-1): swing 4, with the curve's
    # value over each hour and Poisson scatter.
    assert 3.0 < per_hour[12] / per_hour[0] < 5.0
    assert {(r["input_length"], r["output_length"]) for r in rows} == set(SHAPES)


def test_a_burst_multiplies_the_rate_while_it_lasts():
    flat = ModelTraffic("code", SHAPES, mean_rps=1.0, bursts=[Burst(1800, 600, 5.0)])
    rows = generate([flat], hours=1, seed=2)
    inside = sum(1 for r in rows if 1_800_000 <= r["timestamp"] < 2_400_000)
    before = sum(1 for r in rows if 600_000 <= r["timestamp"] < 1_200_000)
    assert inside == pytest.approx(3000, rel=0.1) and before == pytest.approx(600, rel=0.15)


def test_scenarios_are_seeded_and_models_share_one_clock(tmp_path):
    models = [
        ModelTraffic("chat", SHAPES, 0.2, peak_hour=13, swing=3),
        ModelTraffic("batch", SHAPES, 0.1, peak_hour=2, swing=3),
    ]
    rows = generate(models, hours=6, seed=5)
    assert rows == generate(models, hours=6, seed=5) != generate(models, hours=6, seed=6)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    path = tmp_path / "day.jsonl"
    write(rows, path)
    back = trace_by_model(path, ["chat", "batch"])
    first = min(r["timestamp"] for r in rows) / 1000
    for name in ("chat", "batch"):
        mine = [r for r in rows if r["model"] == name]
        assert len(back[name]) == len(mine)
        # One clock: each model's arrivals count from the scenario's first request.
        assert back[name][0].arrival == pytest.approx(mine[0]["timestamp"] / 1000 - first)


def test_the_sine_burst_swings_between_its_rates():
    rows = sine_burst("m", 1, 24, period_s=600, prompt=8000, output=1000, hours=1)
    per_minute = Counter(int(r["timestamp"] // 60_000) for r in rows)
    # sin peaks at 150 s (minute 2) and bottoms at 450 s (minute 7) of each 600 s period.
    assert per_minute[2] > 4 * per_minute[7]
    assert len(rows) == pytest.approx(12.5 * 3600, rel=0.05)
    assert {(r["input_length"], r["output_length"]) for r in rows} == {(8000, 1000)}


def test_a_compressed_day_runs_its_curve_in_fewer_hours():
    chat = ModelTraffic("chat", SHAPES, mean_rps=0.5, peak_hour=12, swing=4)
    rows = generate([chat], hours=6, seed=3, day_hours=6)
    per_hour = _per_hour(rows, "chat")
    # Six hours hold the whole day: hour 3 is noon, hour 0 midnight.
    assert per_hour[3] > 2.5 * per_hour[0]
    assert len(rows) == pytest.approx(0.5 * 6 * 3600, rel=0.05)
