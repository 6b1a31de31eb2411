"""The autopilot's decisions on route-serve's /metrics, read from its audit log (one JSON line
per decision, fleetctl/autopilot/live.py): route-serve is what Prometheus scrapes already, and
the autopilot may run one interval at a time (`--once`) with no port of its own.

The log is read on each scrape from where the last read stopped, up to its last whole line; a
file that shrank was replaced and is read again from its start (the counts start over). The
series' names are what the shipped dashboard reads.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from fleetctl.daemon.telemetry import Counter, Gauge

KINDS = ("start", "stop", "sleep", "wake")
OUTCOMES = ("moved", "held", "gated", "dry_run", "idle")


class AutopilotLog:
    """The audit log's decisions as Prometheus series."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.bad_lines = 0
        self._fresh()

    def _fresh(self) -> None:
        self.decisions = Counter(
            "fleetctl_autopilot_decisions_total",
            "The autopilot's decisions by what came of them: moved (changes carried out), held "
            "(changes held back by hysteresis, floors or the hour's budget, or none carried "
            "out), gated (the what-if replay refused the new fleet), dry_run, idle.",
            ("outcome",),
        )
        for o in OUTCOMES:  # every series from the start, as rate() wants
            self.decisions.values[(o,)] = 0.0
        self.actions = Counter(
            "fleetctl_autopilot_actions_total",
            "Changes the autopilot carried out, by kind (start, stop, sleep, wake).",
            ("kind",),
        )
        for k in KINDS:
            self.actions.values[(k,)] = 0.0
        self.forecast = Gauge(
            "fleetctl_autopilot_forecast_requests",
            "Requests the autopilot's last decision forecast for each model's next interval.",
            ("model",),
        )
        self.last = Gauge(
            "fleetctl_autopilot_last_decision_timestamp_seconds",
            "When the autopilot's last decision was made (Unix time; 0: none yet).",
        )

    def read(self) -> None:
        """Take in the lines written since the last read."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return  # not written yet
        with os.fdopen(fd, "rb") as handle:
            if os.fstat(fd).st_size < self.offset:
                self.offset = 0
                self._fresh()
            handle.seek(self.offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            try:
                self._take(json.loads(line))
            except (ValueError, TypeError, AttributeError, KeyError):
                self.bad_lines += 1

    def _take(self, record: dict[str, object]) -> None:
        outcome = record["outcome"]
        if outcome not in OUTCOMES:
            raise ValueError(outcome)
        self.decisions.inc(str(outcome))
        results = record.get("carried_out") or []
        if not isinstance(results, list):
            raise TypeError(results)
        for r in results:
            if isinstance(r, dict) and r.get("result") == "done" and r.get("kind") in KINDS:
                self.actions.inc(str(r["kind"]))
        forecast = record.get("forecast") or {}
        if not isinstance(forecast, dict):
            raise TypeError(forecast)
        for model, f in forecast.items():
            with contextlib.suppress(KeyError, TypeError, ValueError):
                self.forecast.set(str(model), value=float(f["mean"]))
        at = record.get("at_s")
        if isinstance(at, int | float):
            self.last.set(value=float(at))

    def render(self) -> list[str]:
        self.read()
        lines: list[str] = []
        for m in (self.decisions, self.actions, self.forecast, self.last):
            lines.extend(m.render())
        return lines
