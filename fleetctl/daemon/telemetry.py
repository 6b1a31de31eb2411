"""The router's own Prometheus metrics: tiny counters, gauges and histograms, rendered as text."""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from fleetctl.fleet.slo import Slo

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Time per output token: 10 ms is an H100's decode step, 250 ms a step with a prefill chunk.
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    parts = []
    for n, v in zip(names, values, strict=True):
        v = v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        parts.append(f'{n}="{v}"')
    return "{" + ",".join(parts) + "}"


class Counter:
    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help, labels
        self.values: dict[tuple[str, ...], float] = defaultdict(float)
        if not labels:
            self.values[()] = 0.0  # a plain counter exists from the start

    def inc(self, *labels: str, by: float = 1.0) -> None:
        self.values[labels] += by

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for labels, v in sorted(self.values.items()):
            out.append(f"{self.name}{_labels(self.label_names, labels)} {v}")
        return out


class Gauge(Counter):
    def set(self, *labels: str, value: float) -> None:
        self.values[labels] = value

    def render(self) -> list[str]:
        lines = super().render()
        lines[1] = f"# TYPE {self.name} gauge"
        return lines


class Histogram:
    def __init__(
        self,
        name: str,
        help: str,
        labels: tuple[str, ...] = (),
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
    ):
        self.name, self.help, self.label_names, self.buckets = name, help, labels, buckets
        self.counts: dict[tuple[str, ...], list[int]] = {}
        self.sums: dict[tuple[str, ...], float] = defaultdict(float)

    def observe(self, value: float, *labels: str) -> None:
        counts = self.counts.setdefault(labels, [0] * (len(self.buckets) + 1))
        counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sums[labels] += value

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for labels, counts in sorted(self.counts.items()):
            total = 0
            for bound, c in zip((*self.buckets, float("inf")), counts, strict=True):
                total += c
                le = "+Inf" if bound == float("inf") else repr(bound)
                names = (*self.label_names, "le")
                out.append(f"{self.name}_bucket{_labels(names, (*labels, le))} {total}")
            base = _labels(self.label_names, labels)
            out.append(f"{self.name}_sum{base} {self.sums[labels]}")
            out.append(f"{self.name}_count{base} {total}")
        return out


class RouterMetrics:
    """Everything /metrics shows. Label values never include headers, keys or prompts."""

    def __init__(self) -> None:
        # More series rendered after the router's own (daemon/autopilot_log.py).
        self.sources: list[Callable[[], list[str]]] = []
        self.requests = Counter(
            "fleetctl_requests_total",
            "Requests by model, node class, policy reason and HTTP status.",
            ("model", "node_class", "reason", "status"),
        )
        self.queue = Gauge(
            "fleetctl_queue_depth",
            "Requests waiting in the router, by priority class.",
            ("priority",),
        )
        self.boosts = Counter(
            "fleetctl_aging_boosts_total", "Requests raised to the top priority class by aging."
        )
        self.ttft = Histogram(
            "fleetctl_ttft_seconds",
            "Time to first byte from a backend, as clients see it.",
            ("model",),
        )
        self.e2e = Histogram(
            "fleetctl_e2e_seconds", "Request latency end to end, as clients see it.", ("model",)
        )
        self.tpot = Histogram(
            "fleetctl_tpot_seconds",
            "Time per output token of a streamed answer after its first, as clients see it, "
            "by the node class that served it.",
            ("model", "node_class"),
            TPOT_BUCKETS,
        )
        self.slo = Counter(
            "fleetctl_slo_requests_total",
            "Streamed answers by whether they met both of their model's objectives (p99 TTFT "
            "and TPOT, the inventory's slo or the derived default), by node class.",
            ("model", "node_class", "met"),
        )
        self.attainment = Gauge(
            "fleetctl_slo_attainment",
            "Share of the streamed answers a node class served within both objectives, since "
            "the start (rate() of fleetctl_slo_requests_total gives it over a window).",
            ("model", "node_class"),
        )
        self.objective = Gauge(
            "fleetctl_slo_objective_seconds",
            "Each model's objectives the SLO series count by (objective: ttft_p99, "
            "tpot_p99), and where they come from (source: stated in the inventory, planned: "
            "the one the applied plan was made by, derived: from the servers given).",
            ("model", "objective", "source"),
        )
        self.up = Gauge(
            "fleetctl_backend_up",
            "1 when a backend takes traffic, 0 while ejected.",
            ("backend", "node_class"),
        )
        self.state = Gauge(
            "fleetctl_backend_state",
            "1 for the state each backend is in (awake, asleep, waking, starting, draining), "
            "0 for the others.",
            ("backend", "model", "state"),
        )
        self.wakes = Counter(
            "fleetctl_backend_wakes_total",
            "Wakes asked of a sleeping backend, by who asked (router: its model had no awake "
            "server that could take a request).",
            ("backend", "trigger"),
        )
        self.ejections = Counter(
            "fleetctl_backend_ejections_total",
            "Times a backend was ejected after failures.",
            ("backend",),
        )
        self.retries = Counter(
            "fleetctl_retries_total", "Requests retried on another backend.", ("model",)
        )
        self.scrape_age = Gauge(
            "fleetctl_backend_metrics_age_seconds",
            "Age of the last good /metrics scrape.",
            ("backend",),
        )
        # What the router holds against each backend: a leak shows here as a value that never
        # returns to 0 when the fleet is idle.
        self.outstanding = Gauge(
            "fleetctl_backend_outstanding_requests",
            "Requests the router has in flight at a backend.",
            ("backend",),
        )
        self.reserved = Gauge(
            "fleetctl_backend_reserved_tokens",
            "Prompt plus expected output tokens of the requests in flight at a backend.",
            ("backend",),
        )
        self.prefill = Gauge(
            "fleetctl_backend_pending_prefill_tokens",
            "Prompt tokens in flight at a backend that have not produced a token yet.",
            ("backend",),
        )
        self.speed = Gauge(
            "fleetctl_backend_speed_factor",
            "A backend's speed over the perf model's: measured online, else calibrated, else 1.",
            ("backend",),
        )
        self.prefix_blocks = Gauge(
            "fleetctl_prefix_index_blocks",
            "Prompt blocks the router's prefix index believes a backend holds.",
            ("backend",),
        )
        self.session_pins = Gauge(
            "fleetctl_session_pins",
            "Session pins the router holds in memory: at most route-serve's --max-sessions, the "
            "least recently used forgotten first.",
        )
        self.kv_held = Gauge(
            "fleetctl_prefill_kv_held",
            "Prompts whose KV cache a prefill server may still hold for a decode server that "
            "failed after receiving where to pull it from: freed by the server when its lease "
            "ends (vLLM's kv_lease_duration, 30 s by default), when this drops.",
            ("backend",),
        )
        self.prefix_updates = Counter(
            "fleetctl_prefix_share_updates_total",
            "Prefix-index updates shared with the other replicas through the session store: "
            "published, applied (another replica's) and dropped.",
            ("direction",),
        )

        # The session store (daemon/shared.py): whether this replica shares state with the
        # others now; while it does not, the replicas may disagree.
        self.store_up = Gauge(
            "fleetctl_session_store_up",
            "1 while the session store answers (state shared with the other replicas), 0 while "
            "this replica routes on its own state.",
        )
        self.store_outages = Counter(
            "fleetctl_session_store_outages_total",
            "Times the session store went away (this replica then ran on its own state).",
        )
        self.store_errors = Counter(
            "fleetctl_session_store_errors_total", "Failed session store round trips."
        )
        self.store_down_s = Gauge(
            "fleetctl_session_store_down_seconds",
            "How long the session store has been away (0 while it answers).",
        )
        self.store_pending = Gauge(
            "fleetctl_session_store_pending_pins",
            "Session pins decided here and not yet in the session store.",
        )
        self.store_pins = Counter(
            "fleetctl_session_store_pins_total",
            "Session pins: written to the store, applied (another replica's), conflicts (ours "
            "lost to a later writer's), read (a session unknown here), read_timeout (a request "
            "went on without), write_timeout (an answer left before its new pin reached the "
            "store), dropped (past the pending bound), restored (written back to a "
            "store that had lost them).",
            ("event",),
        )
        self.store_local = Gauge(
            "fleetctl_session_store_local_pins", "Session pins this replica holds in memory."
        )

    def served(self, model: str, node_class: str, tpot_s: float, met: bool | None) -> None:
        """A streamed answer ended: its TPOT, and whether it met its SLO (None: no SLO)."""
        self.tpot.observe(tpot_s, model, node_class)
        if met is None:
            return
        self.slo.inc(model, node_class, "true" if met else "false")
        # Both series exist from a class's first answer (0 where none yet), as rate() wants.
        good = self.slo.values[(model, node_class, "true")]
        bad = self.slo.values[(model, node_class, "false")]
        self.attainment.set(model, node_class, value=good / (good + bad))

    def objectives(self, slos: Mapping[str, Slo]) -> None:
        """Each model's objectives, as the SLO series judge by them."""
        for model, slo in slos.items():
            for name, seconds in (("ttft_p99", slo.ttft_s), ("tpot_p99", slo.tpot_s)):
                if seconds is not None:
                    self.objective.set(model, name, slo.origin, value=seconds)

    def session_store(self, shared: Any) -> None:
        """Copy the session store's state (a RedisShared) into the metrics above."""
        import time

        self.store_up.set(value=1.0 if shared.up else 0.0)
        self.store_outages.values[()] = float(shared.outages)
        self.store_errors.values[()] = float(shared.errors)
        down = 0.0 if shared.up else time.monotonic() - shared.since
        self.store_down_s.set(value=down)
        self.store_pending.set(value=len(shared.pending))
        self.store_local.set(value=len(shared.sessions.pins))
        for event, n in shared.counts.items():
            self.store_pins.values[(event,)] = float(n)

    def render(self) -> str:
        lines: list[str] = []
        for m in (
            self.requests,
            self.queue,
            self.boosts,
            self.ttft,
            self.e2e,
            self.tpot,
            self.slo,
            self.attainment,
            self.objective,
            self.up,
            self.state,
            self.wakes,
            self.ejections,
            self.retries,
            self.scrape_age,
            self.outstanding,
            self.reserved,
            self.prefill,
            self.speed,
            self.prefix_blocks,
            self.session_pins,
            self.kv_held,
            self.prefix_updates,
        ):
            lines.extend(m.render())
        if self.store_pins.values:  # only with a session store
            for m in (
                self.store_up,
                self.store_outages,
                self.store_errors,
                self.store_down_s,
                self.store_pending,
                self.store_pins,
                self.store_local,
            ):
                lines.extend(m.render())
        for source in self.sources:
            lines.extend(source())
        return "\n".join(lines) + "\n"
