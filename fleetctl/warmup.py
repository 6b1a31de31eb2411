"""Warm-up as a cost: servers' start-up times and the disruption a plan causes.

A server's start-up time is measured by apply, else estimated from its weights; a plan's
disruption is its server-minutes of warm-up, and of capacity missing while replacements start.

Start-up time is what apply times from the start command to a healthy /health and
/v1/models (fleetctl/apply/run.py); vLLM's start-up log names some of its phases, which
`parse_startup_log` reads. The lines were checked against a real vLLM 0.32.0 CPU server's log
(tests/data/vllm-0.32.0-cpu-startup.log: "Initializing model took", "Loading weights took",
"init engine (profile, create kv cache, warmup model) took"); the GPU runner's lines ("Model
loading took X GiB [memory] and Y seconds", "torch.compile takes X s in total", "Graph
capturing finished in X secs") are vLLM's format strings, read from its source, not captured
here.

Without a measurement the start-up is an estimate: the weights read from local disk at
DISK_READ_BYTES_S plus STARTUP_FIXED_S for the rest (the Python process and its imports,
profiling, KV cache, torch.compile and CUDA graphs). Both are round numbers, not measured on
this fleet: a network filesystem or a first download is slower, a warm compile cache faster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetctl.calibration import Calibration, find_startup, parse_startup_log
from fleetctl.plan import Deployment

if TYPE_CHECKING:
    from fleetctl.inventory import Inventory
    from fleetctl.state import State

__all__ = [
    "CHANGE_THRESHOLD",
    "disruption",
    "for_plan",
    "parse_startup_log",
    "replacement_minutes",
    "stay_bonus",
    "warmup_for",
    "warmup_seconds",
]

DISK_READ_BYTES_S = 1.0e9  # weights read at 1 GB/s (a local NVMe SSD; safetensors, page cache cold)
STARTUP_FIXED_S = 60.0  # process, imports, profiling, KV cache, torch.compile, CUDA graphs


@dataclass(frozen=True)
class Warmup:
    """One server's expected start-up seconds and where the figure comes from."""

    seconds: float
    source: str
    measured: bool = False


def estimate_startup_s(weights_bytes: int) -> float:
    """The default estimate: weights from disk at DISK_READ_BYTES_S, plus STARTUP_FIXED_S."""
    return max(0, weights_bytes) / DISK_READ_BYTES_S + STARTUP_FIXED_S


def warmup_for(
    calibration: Calibration | None,
    gpu: str,
    model: str,
    fmt: str,
    tp: int = 1,
    weights_bytes: int | None = None,
    vllm_version: str | None = None,
) -> Warmup:
    """The start-up of a server of this class: apply's measured median where the calibration
    has one (`model` is the profile's name, as calibration keys are), else the estimate."""
    found = (
        None
        if calibration is None
        else find_startup(calibration, gpu, model, fmt, tp, vllm_version)
    )
    if found is not None:
        return Warmup(found.median_s, found.describe(), True)
    if weights_bytes is None:
        return Warmup(STARTUP_FIXED_S, f"estimate: {STARTUP_FIXED_S:g} s, weights unknown")
    s = estimate_startup_s(weights_bytes)
    return Warmup(
        s,
        f"estimate: {weights_bytes / 1e9:.1f} GB at {DISK_READ_BYTES_S / 1e9:g} GB/s "
        f"+ {STARTUP_FIXED_S:g} s",
    )


def warmup_seconds(
    calibration: Calibration | None,
    gpu: str,
    model: str,
    fmt: str,
    tp: int = 1,
    weights_bytes: int | None = None,
    vllm_version: str | None = None,
) -> float:
    """`warmup_for(...).seconds`: what the planner weighs a server start by."""
    return warmup_for(calibration, gpu, model, fmt, tp, weights_bytes, vllm_version).seconds


# --- what the planner weighs: a replica that stays spares its replacement's disruption -------

# A change of placement must raise the throughput objective (a sum over models of
# log(capacity / workload)) by at least this much per server-minute of disruption it causes:
# 0.02 is a 2% capacity gain for one model per server-minute. Minimum replicas (1e3) and
# workload shortfall (20 per unit) weigh far more, so staying never leaves a workload short.
CHANGE_THRESHOLD = 0.02
# The cost objective: a change must pay its disruption back (GPU-hours of warm-up and of
# capacity missing, at the GPUs' price) within this many hours of running.
PAYBACK_HOURS = 24.0


def replacement_minutes(warmup_s: float, gpu_memory_utilization: float) -> float:
    """Server-minutes of disruption one replacement of a running server costs, as apply
    carries it out: its warm-up, and as long again of capacity missing unless the new server
    fits beside the old one (their memory shares sum to at most 1: start before stop)."""
    surge = 2 * gpu_memory_utilization <= 1.0
    return warmup_s / 60 * (1 if surge else 2)


def stay_bonus(
    warmup_s: float, gpu_memory_utilization: float, threshold: float = CHANGE_THRESHOLD
) -> float:
    """The throughput objective's bonus for a replica that stays where it runs: the gain a
    change must beat."""
    return threshold * replacement_minutes(warmup_s, gpu_memory_utilization)


# --- a plan's disruption ----------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """One server a plan starts: where, its warm-up, and whether it runs beside the server it
    replaces while it warms up (surge) or the old one stops first."""

    node: str
    gpus: tuple[int, ...]
    model: str
    variant: str
    kind: str  # start | replace
    warmup: Warmup
    surge: bool = False
    stopped_first: int = 0  # servers out of service while it starts
    missing_s: float = 0.0  # server-seconds of capacity missing on its account

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "gpu_indices": list(self.gpus),
            "model": self.model,
            "variant": self.variant,
            "kind": self.kind,
            "warmup_s": round(self.warmup.seconds, 1),
            "warmup_source": self.warmup.source,
            "surge": self.surge,
            "capacity_missing_s": round(self.missing_s, 1),
        }


@dataclass(frozen=True)
class Disruption:
    """What carrying a plan out costs the running fleet."""

    servers_started: int = 0
    servers_stopped: int = 0
    warmup_s: float = 0.0  # server-seconds of warm-up
    capacity_missing_s: float = 0.0  # server-seconds of servers out of service meanwhile
    started: tuple[Started, ...] = field(default=())

    @property
    def warmup_server_minutes(self) -> float:
        return self.warmup_s / 60

    @property
    def capacity_missing_server_minutes(self) -> float:
        return self.capacity_missing_s / 60

    def to_json(self) -> dict[str, Any]:
        return {
            "warmup_server_minutes": round(self.warmup_server_minutes, 2),
            "capacity_missing_server_minutes": round(self.capacity_missing_server_minutes, 2),
            "servers_started": self.servers_started,
            "servers_stopped": self.servers_stopped,
            "servers": [s.to_json() for s in self.started],
        }

    def line(self) -> str:
        """`Disruption: 2 servers start (4.1 server-minutes of warm-up), 1 stops; 1.3
        server-minutes of capacity missing (1 replacement stops its old server first).`"""
        if not self.servers_started and not self.servers_stopped:
            return ""
        out = (
            f"Disruption: {self.servers_started} server{'s' if self.servers_started != 1 else ''}"
            f" start ({self.warmup_server_minutes:.1f} server-minutes of warm-up), "
            f"{self.servers_stopped} stop"
        )
        first = sum(1 for s in self.started if s.stopped_first)
        surge = sum(1 for s in self.started if s.surge)
        out += f"; {self.capacity_missing_server_minutes:.1f} server-minutes of capacity missing"
        notes = []
        if first:
            notes.append(
                f"{first} replacement{'s stop' if first != 1 else ' stops'} the old server first"
            )
        if surge:
            notes.append(
                f"{surge} replacement{'s start' if surge != 1 else ' starts'} beside the old server"
            )
        if notes:
            out += f" ({'; '.join(notes)})"
        estimated = sum(1 for s in self.started if not s.warmup.measured)
        if estimated:
            out += f". Warm-up estimated for {estimated} (no start-up measured yet)"
        return out + "."


def disruption(
    desired: Sequence[Deployment],
    current: Sequence[Deployment],
    warmup_of: Callable[[Deployment], Warmup],
    port_base: int = 8000,
) -> Disruption:
    """The disruption of going from `current` (what state records) to `desired`, by the steps
    apply itself takes on each node (apply/steps.py, as if every recorded server runs):

    - a new server warms up for its start-up time;
    - a replacement that fits beside the old server (start before stop) leaves no capacity
      missing; one that must stop the old server(s) first leaves them missing for its warm-up;
    - a server the plan drops stops after the new servers of its node are healthy; when its
      model gains servers elsewhere (moved), it is missing until those are healthy too, since
      nodes are worked on in parallel. A model that simply shrinks loses nothing by accident.
    """
    from fleetctl.apply.node import Live, server_id
    from fleetctl.apply.steps import node_steps

    want: dict[str, list[Deployment]] = {}
    for d in desired:
        want.setdefault(d.node, []).append(d)
    have: dict[str, list[Deployment]] = {}
    for d in current:
        have.setdefault(d.node, []).append(d)
    by_sid = {(d.node, server_id(d)): d for d in current}
    started: list[Started] = []
    dropped: list[tuple[str, Deployment]] = []  # (node, server) stopped as not in the plan
    stopped = 0
    node_ready: dict[str, float] = {}  # when a node's new servers are healthy (its stops)
    for node in sorted(set(want) | set(have)):
        live = [
            Live(
                server_id(d),
                True,
                True,
                None,
                {
                    "args_hash": d.args_hash,
                    "port": d.port,
                    "gpu_indices": list(d.gpu_indices),
                    "argv": list(d.vllm_args),
                },
            )
            for d in have.get(node, [])
        ]
        steps = node_steps(node, want.get(node, []), live, have.get(node, []), port_base)
        ready = 0.0
        for st in steps:
            new = st.deployment
            if st.kind == "stop":
                stopped += len(st.stop)
                dropped.extend((node, by_sid[(node, s)]) for s in st.stop if (node, s) in by_sid)
                continue
            if new is None or st.kind in ("keep", "adopt"):
                continue
            w = warmup_of(new)
            ready = max(ready, w.seconds)
            old = len(st.stop) if st.kind == "replace" else 0
            stopped += old
            first = old if st.stop_first else 0
            started.append(
                Started(
                    node,
                    new.gpu_indices,
                    new.model,
                    new.variant,
                    "replace" if st.kind == "replace" else "start",
                    w,
                    surge=st.kind == "replace" and not st.stop_first,
                    stopped_first=first,
                    missing_s=first * w.seconds,
                )
            )
        node_ready[node] = ready
    # Moved servers: dropped on one node while the model starts on another.
    new_ready: dict[str, float] = {}
    for s in started:
        new_ready[s.model] = max(new_ready.get(s.model, 0.0), s.warmup.seconds)
    moved = sum(
        max(0.0, new_ready[d.model] - node_ready.get(node, 0.0))
        for node, d in dropped
        if d.model in new_ready
    )
    return Disruption(
        servers_started=len(started),
        servers_stopped=stopped,
        warmup_s=sum(s.warmup.seconds for s in started),
        capacity_missing_s=sum(s.missing_s for s in started) + moved,
        started=tuple(started),
    )


def plan_disruption(
    desired: Sequence[Deployment],
    current: Sequence[Deployment],
    profile_of: dict[str, str],
    calibration: Calibration | None,
    port_base: int = 8000,
    vllm_version: str | None = None,
) -> Disruption:
    """`disruption` with each server's warm-up from the calibration's start-ups, else the
    estimate from its weights; `profile_of` maps an inventory model to its profile's name."""

    def warmup_of(d: Deployment) -> Warmup:
        s = d.server
        return warmup_for(
            calibration,
            s.gpu_type,
            profile_of.get(s.model, s.model),
            s.variant,
            s.tensor_parallel_size,
            s.weights_bytes,
            vllm_version,
        )

    return disruption(desired, current, warmup_of, port_base)


def for_plan(
    inv: Inventory, desired: Sequence[Deployment], state: State, calibration: Calibration | None
) -> Disruption:
    """The disruption of applying `desired` over what `state` records, for `inv`."""
    return plan_disruption(
        desired,
        state.deployments,
        {m.name: m.profile.name for m in inv.models},
        calibration,
        inv.spec.planner.port_base,
        inv.spec.apply.vllm_version,
    )
