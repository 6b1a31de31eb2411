"""The autopilot's forecaster (autopilot/forecast.py): it smooths noise that "same as the last
interval" chases, follows a ramp that it lags, and keeps the last interval on short history."""

from __future__ import annotations

import random

import pytest

from fleetctl.autopilot.forecast import MIN_HISTORY, counts, forecast


def _one_step_mae(series: list[float]) -> tuple[float, float]:
    """(the forecaster's, the naive forecast's) mean absolute one-step error."""
    ours = naive = 0.0
    for i in range(3, len(series)):
        ours += abs(forecast(series[:i]).mean - series[i])
        naive += abs(series[i - 1] - series[i])
    n = len(series) - 3
    return ours / n, naive / n


def test_noise_around_a_level_is_smoothed():
    rng = random.Random(7)
    series = [float(rng.gauss(100, 15)) for _ in range(60)]
    ours, naive = _one_step_mae(series)
    assert ours < 0.85 * naive  # white noise: the mean would reach about 0.71


def test_a_ramp_is_followed_not_lagged():
    series = [100.0 + 10 * i for i in range(30)]
    f = forecast(series)
    assert f.mean == pytest.approx(400, abs=3)  # the naive forecast says 390
    ours, naive = _one_step_mae(series)
    assert ours < 0.5 * naive


def test_short_history_keeps_the_last_interval_with_a_band():
    f = forecast([10.0, 30.0, 20.0])
    assert f.mean == 20 and f.high == 40 and f.method == "last interval"
    assert len([1.0] * (MIN_HISTORY - 1)) < MIN_HISTORY
    with pytest.raises(ValueError):
        forecast([])


def test_the_band_is_above_the_forecast():
    rng = random.Random(3)
    series = [float(rng.randint(50, 150)) for _ in range(40)]
    f = forecast(series)
    assert f.high > f.mean >= 0


def test_counts_bins_whole_intervals():
    assert counts([0.0, 0.5, 59.9, 60.0, 130.0, 179.0, 200.0], 60, 180) == [3, 1, 2]


@pytest.mark.parametrize("rate", [12, 100, 400])
def test_the_band_is_the_rates_error_not_a_counts_poisson_scatter(rate):
    """At a steady rate the counts scatter by Poisson (variance the rate), which the
    planner's queueing model already counts within an interval: the band stays within about
    one standard deviation of a count (it was about two and a half, a quiet 70B banded 1.7x
    its mean). A rate that itself moves keeps its band."""
    import numpy as np

    for seed in range(3):
        steady = [float(x) for x in np.random.default_rng(seed).poisson(rate, 60)]
        f = forecast(steady)
        assert f.high - f.mean <= 1.2 * rate**0.5, (seed, f)
        rng = np.random.default_rng(seed)
        moving = [float(rng.poisson(rng.uniform(0.3, 1.7) * rate)) for _ in range(60)]
        f = forecast(moving)
        assert f.high - f.mean >= 0.5 * rate**0.5 + 0.3 * rate, (seed, f)
