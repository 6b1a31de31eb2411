"""Multi-model traffic over hours, for the autopilot's simulation, benchmark and live run: each
model's request shapes drawn from a trace, its rate following a daily curve with bursts, all
on one clock, as JSONL rows that `simulate` (and route-serve's replay) read.

How a scenario is made (benchmarks/autopilot.py states its own):
- Shapes: (prompt, output) pairs drawn with replacement from a source trace, so the lengths
  keep that trace's joint distribution (a long prompt keeps its short answer).
- Rate: `mean_rps x (1 + a cos(2 pi (hour - peak_hour) / 24))`, with a = (swing - 1) /
  (swing + 1), so the peak is `swing` times the trough and the day's mean is `mean_rps`;
  times a burst's factor while it lasts.
- Arrivals: a Poisson process at that rate (Lewis-Shedler thinning), seeded: the same
  scenario and seed give the same rows.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fleetctl.sim.workload import WorkItem

DAY_S = 86400.0


@dataclass(frozen=True)
class Burst:
    """`factor` times the rate from `start_s` for `duration_s` (seconds of the scenario)."""

    start_s: float
    duration_s: float
    factor: float

    def covers(self, t: float) -> bool:
        return self.start_s <= t < self.start_s + self.duration_s


@dataclass(frozen=True)
class ModelTraffic:
    """One model's traffic: its shapes, its daily curve and its bursts."""

    model: str
    shapes: Sequence[tuple[int, int]]
    mean_rps: float
    peak_hour: float = 12.0
    swing: float = 1.0  # peak over trough; 1: flat
    bursts: Sequence[Burst] = field(default_factory=tuple)

    def rate_at(self, t: float, start_hour: float = 0.0, day_hours: float = 24.0) -> float:
        """Requests per second at `t` s; `day_hours`: the day compressed into that many hours
        (the curve's period), bursts kept at their own times."""
        hour = (start_hour + t / 3600 * 24 / day_hours) % 24
        a = (self.swing - 1) / (self.swing + 1)
        rate = self.mean_rps * (1 + a * math.cos(2 * math.pi * (hour - self.peak_hour) / 24))
        for b in self.bursts:
            if b.covers(t):
                rate *= b.factor
        return rate

    def max_rate(self) -> float:
        a = (self.swing - 1) / (self.swing + 1)
        top = max((b.factor for b in self.bursts), default=1.0)
        return self.mean_rps * (1 + a) * max(1.0, top)


def shapes_of(items: Sequence[WorkItem]) -> list[tuple[int, int]]:
    """The (prompt, output) pairs of a trace's requests, to draw a model's shapes from."""
    return [(w.prompt, w.output) for w in items]


def arrivals(
    m: ModelTraffic, hours: float, rng: random.Random, start_hour: float, day_hours: float = 24.0
) -> Iterator[float]:
    """Arrival times (s) of `m` over `hours`: thinning of a Poisson process at its top rate."""
    end, top = hours * 3600, m.max_rate()
    if top <= 0:
        return
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= end:
            return
        if rng.random() * top < m.rate_at(t, start_hour, day_hours):
            yield t


def generate(
    models: Sequence[ModelTraffic],
    hours: float,
    seed: int = 0,
    start_hour: float = 0.0,
    day_hours: float = 24.0,
) -> list[dict[str, object]]:
    """The scenario's rows in arrival order: timestamp (ms), input_length, output_length,
    model. `start_hour`: the hour of day the scenario starts at; `day_hours`: a day
    compressed into that many hours."""
    rows: list[tuple[float, int, dict[str, object]]] = []
    for k, m in enumerate(models):
        if not m.shapes:
            raise ValueError(f"{m.model}: no request shapes to draw from")
        rng = random.Random(f"{seed}:{m.model}")
        for t in arrivals(m, hours, rng, start_hour, day_hours):
            prompt, output = m.shapes[rng.randrange(len(m.shapes))]
            row = {"timestamp": int(t * 1000), "input_length": prompt}
            rows.append((t, k, row | {"output_length": output, "model": m.model}))
    rows.sort(key=lambda r: (r[0], r[1]))
    return [r[2] for r in rows]


def write(rows: Sequence[dict[str, object]], path: Path) -> None:
    """The rows as JSONL (the request log's format, which `simulate --trace` reads)."""
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def sine_burst(
    model: str, low_rps: float, high_rps: float, period_s: float, prompt: int, output: int,
    hours: float, seed: int = 0,
) -> list[dict[str, object]]:  # fmt: skip
    """A rate swinging between `low_rps` and `high_rps` with period `period_s`, fixed shapes:
    the burst test of dynamo#10528 (1 to 24 req/s, 8,000-token prompts, 1,000-token outputs)."""
    mean = (low_rps + high_rps) / 2
    rng = random.Random(f"{seed}:{model}")
    amplitude = (high_rps - low_rps) / 2
    out: list[dict[str, object]] = []
    t = 0.0
    while True:
        t += rng.expovariate(high_rps)
        if t >= hours * 3600:
            break
        rate = mean + amplitude * math.sin(2 * math.pi * t / period_s)
        if rng.random() * high_rps < rate:
            out.append(
                {"timestamp": int(t * 1000), "input_length": prompt, "output_length": output,
                 "model": model}
            )  # fmt: skip
    return out
