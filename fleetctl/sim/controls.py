"""Changes to a simulated fleet while it runs: servers put to sleep, woken, started and stopped
at given times (the autopilot's moves, or a scaler's), and the GPU-hours their awake spans add
up to.

A server that wakes or starts is out of routing until it is ready (its wake's or start's
seconds later), as route-serve keeps a warming server out; its GPUs count from the moment
the change began, since the weights hold them while they load. A server that sleeps or stops
leaves routing at once; what it runs finishes on its engine (a drain), and its GPUs count
until then.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

# "ready" is the simulator's own: a start or a wake is done and the server serves.
Action = Literal["start", "wake", "sleep", "stop", "ready"]
UP: tuple[Action, ...] = ("start", "wake")
DOWN: tuple[Action, ...] = ("sleep", "stop")


@dataclass(frozen=True)
class Control:
    """At `at` (s), do `action` to the server named `server`; a start or a wake serves
    `ready_s` later."""

    at: float
    server: str
    action: Action
    ready_s: float = 0.0
    # A start of a server the fleet does not have yet: the simulator's description of it
    # (sim/fleet.py's Server; typed loosely to keep this module below it).
    new: object | None = field(default=None, compare=False)
    # A sleep in sleep mode: the seconds a wake from it takes. The router may then wake the
    # server itself, as route-serve does, when its model has no awake server or every awake
    # one would miss the objective (routing/policy.py, eligible). None: a sleep the router
    # cannot undo (a server down, as a stop).
    wake_s: float | None = None


@dataclass(frozen=True)
class Observation:
    """What a controller sees at a tick: the time, the requests that arrived so far (every
    model's, in arrival order), and each server's state (awake, waking, asleep, stopped)."""

    now: float
    arrived: Sequence[object]  # WorkItem; typed loosely to keep this module below sim/workload
    states: dict[str, str]
    # What a scaler reads from /metrics and the router: each server's model and its engine's
    # waiting requests, and each model's requests queued in the router.
    models: dict[str, str] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    queued: dict[str, int] = field(default_factory=dict)
    # The requests that finished since the last tick (sim/fleet.py's Outcome): what the
    # router's attainment metrics count, to judge the fleet by.
    finished: Sequence[object] = ()


Controller = Callable[[Observation], Sequence[Control]]


@dataclass
class AwakeSpans:
    """When each server held its GPUs: from a start or wake to the end of its drain."""

    gpus: dict[str, int]  # GPUs per server
    since: dict[str, float] = field(default_factory=dict)
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    actions: dict[str, int] = field(default_factory=dict)
    # (when, server, state) as each server's state changed: what the day's plot draws asleep.
    states: list[tuple[float, str, str]] = field(default_factory=list)
    # Each server's (model, role), to group its GPUs by.
    owners: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, gpus: dict[str, int], awake: Iterable[str], at: float = 0.0) -> AwakeSpans:
        spans = cls(gpus)
        for name in awake:
            spans.since[name] = at
        return spans

    def up(self, name: str, at: float) -> None:
        self.since.setdefault(name, at)

    def down(self, name: str, at: float) -> None:
        start = self.since.pop(name, None)
        if start is not None:
            self.spans.append((name, start, max(start, at)))

    def count(self, action: str) -> None:
        self.actions[action] = self.actions.get(action, 0) + 1

    def gpu_hours(self, end: float) -> float:
        """GPU-hours over the closed spans and the ones still open at `end`."""
        total = sum((b - a) * self.gpus[n] for n, a, b in self.spans)
        total += sum((max(a, end) - a) * self.gpus[n] for n, a in self.since.items())
        return total / 3600

    def mark(self, name: str, at: float, state: str) -> None:
        self.states.append((at, name, state))

    def per_minute(
        self, end: float, step: float = 60.0
    ) -> dict[str, tuple[list[float], list[float]]]:
        """Per server, (GPUs awake, GPUs asleep) in each `step` from 0 to `end`, averaged over
        the part of the step before `end`: the awake ones add up to `gpu_hours(end)` over
        the spans within the run. Asleep: put to sleep and not still draining, until woken."""
        n = max(1, math.ceil(end / step))
        awake: dict[str, list[tuple[float, float]]] = {}
        for name, a, b in [*self.spans, *((n_, a, max(a, end)) for n_, a in self.since.items())]:
            awake.setdefault(name, []).append((a, b))
        asleep: dict[str, list[tuple[float, float]]] = {}
        since: dict[str, float] = {}
        for at, name, state in sorted(self.states, key=lambda s: s[0]):
            start = since.pop(name, None)
            if start is not None:
                asleep.setdefault(name, []).append((start, at))
            if state == "asleep":
                since[name] = at
        for name, start in since.items():
            asleep.setdefault(name, []).append((start, max(start, end)))
        out = {}
        for name, g in self.gpus.items():
            up = awake.get(name, [])
            down = [p for a, b in asleep.get(name, []) for p in _minus((a, b), up)]
            out[name] = (_spread(up, g, n, step, end), _spread(down, g, n, step, end))
        return out


def _minus(
    span: tuple[float, float], others: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The parts of `span` outside every one of `others`."""
    parts = [span]
    for c, d in others:
        parts = [q for a, b in parts for q in ((a, min(b, c)), (max(a, d), b)) if q[1] > q[0]]
    return parts


def _spread(
    spans: Sequence[tuple[float, float]], gpus: int, n: int, step: float, end: float
) -> list[float]:
    """`gpus` over `spans`, as the mean held in each of `n` steps (cut at `end`)."""
    out = [0.0] * n
    for a, b in spans:
        a, b = max(a, 0.0), min(b, end)
        k = int(a // step)
        while k < n and k * step < b:
            lo, hi = max(a, k * step), min(b, (k + 1) * step)
            if hi > lo:
                out[k] += gpus * (hi - lo)
            k += 1
    return [v / (min(end, (k + 1) * step) - k * step or step) for k, v in enumerate(out)]


def check(controls: Sequence[Control], servers: Iterable[str]) -> None:
    """Controls must name known servers and known actions, at times not before 0."""
    known = set(servers)
    for c in controls:
        if c.server not in known and not (c.action == "start" and c.new is not None):
            raise ValueError(f"control for an unknown server {c.server!r}")
        if c.action not in (*UP, *DOWN):
            raise ValueError(f"unknown action {c.action!r}")
        if c.at < 0 or c.ready_s < 0:
            raise ValueError(f"control at {c.at} with ready_s {c.ready_s}: negative time")
