"""A plan's disruption: server-minutes of warm-up, and of capacity missing while replacements
start, as apply's own steps would carry it out; and apply's measured start-ups kept in the
calibration. Start-up times themselves, measured or estimated: fleetctl/model/startup.py."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetctl.fleet.plan import Deployment
from fleetctl.model.calibration import Calibration, Key, parse_startup_log, record_startup
from fleetctl.model.startup import (
    CHANGE_THRESHOLD,
    DISK_READ_BYTES_S,
    PAYBACK_HOURS,
    STARTUP_FIXED_S,
    Warmup,
    estimate_startup_s,
    replacement_minutes,
    stay_bonus,
    warmup_for,
    warmup_seconds,
)

if TYPE_CHECKING:
    from fleetctl.apply.execute import Outcome
    from fleetctl.fleet.inventory import Inventory
    from fleetctl.fleet.state import State
    from fleetctl.fleet.statedir import StateDir

__all__ = [
    "CHANGE_THRESHOLD",
    "DISK_READ_BYTES_S",
    "PAYBACK_HOURS",
    "STARTUP_FIXED_S",
    "Warmup",
    "disruption",
    "estimate_startup_s",
    "for_plan",
    "parse_startup_log",
    "record_startups",
    "replacement_minutes",
    "stay_bonus",
    "warmup_for",
    "warmup_seconds",
]


def record_startups(
    sdir: StateDir, inv: Inventory, deployments: list[Deployment], outcomes: list[Outcome]
) -> int:
    """Add the start-up time of every server apply started and saw healthy to the state
    folder's calibration (per GPU type, model, format and TP); returns how many."""
    planned = {(d.node, d.gpu_indices): d for d in deployments}
    profile_of = {m.name: m.profile.name for m in inv.models}
    timed = [(o, planned.get((o.node, o.gpus))) for o in outcomes if o.startup_s is not None]
    timed = [(o, d) for o, d in timed if d is not None]
    if not timed:
        return 0
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")

    def add(cal: Calibration) -> Calibration:
        for o, d in timed:
            assert o.startup_s is not None and d is not None
            s = d.server
            key = Key(
                s.gpu_type,
                profile_of.get(s.model, s.model),
                s.variant,
                s.tensor_parallel_size,
                inv.spec.apply.vllm_version,
                s.max_model_len,
            )
            cal = record_startup(cal, key, o.startup_s, now, o.phases, f"{o.node}:{o.port}")
        return cal

    sdir.update_calibration(add)
    return len(timed)


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
