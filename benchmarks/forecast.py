"""The autopilot's forecaster against "same as the last interval" on the public traces.

Run (from the repository root, in the dev venv):

    python benchmarks/forecast.py [--traces DIR] [--intervals 30,60,120,180]

Each trace's requests are counted per interval; at every interval from the third on, both
forecasters see the counts before it and predict it. Printed per trace and interval: the mean
absolute error of each (and their ratio: under 1, the autopilot's forecaster is better), and
how often the band (`Forecast.high`) held the interval's count, with its mean headroom over
the count, against the naive forecast plus the same band rule applied to its own errors.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fleetctl.autopilot.forecast import BAND_Z, MIN_HISTORY, counts, forecast
from fleetctl.sim.workload import load_trace

REPO = Path(__file__).resolve().parent.parent
TRACES = REPO.parent / "shared" / "traces"
FILES = {
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "azure-code": "AzureLLMInferenceTrace_code.csv",
    "mooncake": "mooncake_conversation_trace.jsonl",
}


def evaluate(series: list[float]) -> dict[str, float]:
    """One-step errors of both forecasters from the third interval on."""
    ours = naive = held = naive_held = 0.0
    headroom = naive_headroom = 0.0
    naive_errors: list[float] = []
    n = 0
    for i in range(3, len(series)):
        history, actual = series[:i], series[i]
        f = forecast(history)
        ours += abs(f.mean - actual)
        held += actual <= f.high
        headroom += f.high - actual
        last = history[-1]
        naive += abs(last - actual)
        # The naive forecast with the same band rule, on its own past errors.
        band = BAND_Z * (sum(naive_errors) / len(naive_errors)) if naive_errors else 0.0
        naive_held += actual <= last + band
        naive_headroom += last + band - actual
        naive_errors.append(abs(last - actual))
        n += 1
    return {
        "points": n,
        "mae": ours / n,
        "naive_mae": naive / n,
        "held": held / n,
        "headroom": headroom / n,
        "naive_held": naive_held / n,
        "naive_headroom": naive_headroom / n,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", type=Path, default=TRACES)
    p.add_argument("--intervals", default="30,60,120,180")
    args = p.parse_args()
    intervals = [float(x) for x in args.intervals.split(",")]
    print(
        "| trace | interval s | intervals | mean count | MAE ours | MAE naive | ours / naive "
        "| band held (naive's) | band headroom (naive's) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, file in FILES.items():
        items = load_trace(args.traces / file, "any")
        arrivals = [w.arrival for w in items]
        for interval in intervals:
            series = counts(arrivals, interval, max(arrivals))
            if len(series) <= MIN_HISTORY:
                continue
            r = evaluate(series)
            mean = sum(series) / len(series)
            print(
                f"| {name} | {interval:g} | {r['points']} | {mean:.0f} | {r['mae']:.1f} | "
                f"{r['naive_mae']:.1f} | {r['mae'] / r['naive_mae']:.2f} | "
                f"{r['held']:.0%} ({r['naive_held']:.0%}) | {r['headroom']:.1f} "
                f"({r['naive_headroom']:.1f}) |"
            )


if __name__ == "__main__":
    main()
