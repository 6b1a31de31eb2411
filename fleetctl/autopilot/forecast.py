"""Next interval's demand per model from the intervals before it: damped-trend exponential
smoothing whose two weights are fitted to the history at each call, with a band above it.

Why this forecaster: the autopilot re-plans every few minutes on request counts per interval,
which are noisy (bursts, Poisson scatter) and drift (a daily curve). "Same as the last
interval" chases the noise; a fixed smoothing weight lags a drift. Fitting the level and trend
weights to the series' own one-step errors picks the naive forecast (weight 1, no trend) when
that is what the series rewards, and smooths where the noise dominates.
`benchmarks/forecast.py` measures it against the naive forecast on the public traces
(benchmarks/results/forecast.md). ARIMA, Prophet or a Kalman filter (Dynamo's planner) need
more history than an hour of minutes gives, and a dependency each.

The band is the forecast plus BAND_Z standard deviations of the error in the rate itself:
the one-step errors' variance (for normal errors, 1.25 MAE is one standard deviation) less a
count's Poisson scatter at the forecast (its variance is the mean), which the planner's
queueing model already counts within an interval. Counted twice, it banded a model at 12
requests a minute to 1.7x its mean; a rate that moves keeps its band.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

# Damping of the trend per step ahead: a ramp is followed, not extrapolated without end.
PHI = 0.9
LEVEL_WEIGHTS = (0.2, 0.35, 0.5, 0.7, 1.0)
TREND_WEIGHTS = (0.0, 0.1, 0.3)
# Below this many intervals the fit has too little to choose by: the last interval is kept.
MIN_HISTORY = 8
BAND_Z = 2.5  # about two standard deviations of the one-step error
MAE_TO_SD = 1.25  # a normal error's standard deviation over its mean absolute value


@dataclass(frozen=True)
class Forecast:
    """The next interval's expected value, a high value to provision for, and how they were
    made (the weights chosen, or "last interval")."""

    mean: float
    high: float
    method: str

    def to_json(self) -> dict[str, object]:
        return {"mean": round(self.mean, 4), "high": round(self.high, 4), "method": self.method}


def _smooth(series: Sequence[float], alpha: float, beta: float) -> tuple[float, float]:
    """(sum of absolute one-step errors over the series, forecast of the step after it)."""
    level, trend, error = series[0], 0.0, 0.0
    for x in series[1:]:
        predicted = level + PHI * trend
        error += abs(x - predicted)
        previous = level
        level = alpha * x + (1 - alpha) * predicted
        trend = beta * (level - previous) + (1 - beta) * PHI * trend
    return error, level + PHI * trend


def forecast(history: Sequence[float]) -> Forecast:
    """The next value of `history` (one per interval, oldest first, at least one)."""
    if not history:
        raise ValueError("forecast needs at least one interval")
    last = float(history[-1])
    if len(history) < MIN_HISTORY:
        spread = max((abs(a - b) for a, b in itertools.pairwise(history)), default=0.0)
        return Forecast(last, last + spread, "last interval")
    best: tuple[float, float, float, float] | None = None
    for alpha in LEVEL_WEIGHTS:
        for beta in TREND_WEIGHTS:
            error, nxt = _smooth(history, alpha, beta)
            if best is None or error < best[0] - 1e-12:
                best = (error, nxt, alpha, beta)
    assert best is not None
    error, nxt, alpha, beta = best
    mae = error / (len(history) - 1)
    mean = max(0.0, nxt)
    # The counts' errors hold the Poisson scatter of a count at the forecast rate (variance
    # the mean), which the planner's queueing model already counts within an interval: the
    # band is for the error in the rate itself, what is left of the errors' variance.
    spread = math.sqrt(max(0.0, (MAE_TO_SD * mae) ** 2 - mean))
    return Forecast(
        mean, mean + BAND_Z / MAE_TO_SD * spread, f"smoothed (level {alpha:g}, trend {beta:g})"
    )


def counts(arrivals: Sequence[float], interval_s: float, until: float) -> list[float]:
    """Requests per interval of `interval_s` seconds from 0 to `until` (whole intervals only;
    arrivals in seconds, any order)."""
    n = int(until // interval_s)
    out = [0.0] * n
    for t in arrivals:
        k = int(t // interval_s)
        if 0 <= k < n:
            out[k] += 1
    return out
