"""From what should run on a node and what does run there, the steps to get there (pure).

apply reconciles against the node itself, not only against state.json: a server found alive
with the planned flags is kept (or adopted, when an interrupted apply started it but never
recorded it), a dead or missing one is started again, anything else fleetctl started there is
stopped. So a re-run after an apply killed at any moment converges.

Replacements start the new server before stopping the old one when the two fit on the GPUs
together (their `--gpu-memory-utilization` shares sum to at most 1); the new one then takes
the other port of the slot's pair (port_base + first GPU, and that + SURGE_PORT_OFFSET), and
the planner keeps whatever port a slot runs on. Otherwise the old server stops first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from fleetctl.apply.node import Live
from fleetctl.base.limits import SURGE_PORT_OFFSET
from fleetctl.fleet.plan import Deployment
from fleetctl.fleet.state import Sleeper

StepKind = Literal["keep", "adopt", "start", "restart", "replace", "stop"]


@dataclass(frozen=True)
class Step:
    """One thing to do on a node. `stop` lists server folders to stop; `stop_first` says
    whether they must stop before `deployment` starts (GPU memory or port) or after it is
    healthy (start before stop)."""

    kind: StepKind
    node: str
    deployment: Deployment | None = None
    stop: tuple[str, ...] = ()
    stop_first: bool = False
    note: str = ""
    replaced: tuple[Deployment, ...] = field(default=())  # kept in state if the start fails


def _util(argv: Sequence[str]) -> float:
    """A server's --gpu-memory-utilization (vLLM's default 0.9 when absent)."""
    args = list(argv)
    if "--gpu-memory-utilization" in args:
        i = args.index("--gpu-memory-utilization")
        try:
            return float(args[i + 1])
        except (IndexError, ValueError):
            pass
    return 0.9


def node_steps(
    node: str,
    want: Sequence[Deployment],
    live: Sequence[Live],
    recorded: Sequence[Deployment] = (),
    port_base: int = 8000,
) -> list[Step]:
    """Steps for one node. `recorded` is what state.json says runs there (used to name the
    old side of a replacement, so that a failed start leaves it in state)."""
    steps: list[Step] = []
    used: set[str] = set()
    by_hash: dict[str, Live] = {}
    for server in live:
        # Prefer a live copy over a dead one when both exist.
        if server.args_hash and (server.args_hash not in by_hash or server.alive):
            by_hash[server.args_hash] = server
    recorded_hashes = {d.args_hash for d in recorded}
    recorded_by_port = {d.port: d for d in recorded}

    pending: list[Deployment] = []
    for d in want:
        found = by_hash.get(d.args_hash)
        if found is not None and found.alive:
            used.add(found.sid)
            kept: StepKind = "keep" if d.args_hash in recorded_hashes else "adopt"
            steps.append(Step(kept, node, d))
        elif found is not None:
            used.add(found.sid)
            steps.append(Step("restart", node, d, (found.sid,), True, "it was not running"))
        else:
            pending.append(d)

    others = [s for s in live if s.sid not in used]
    taken_ports = {s.port for s in live if s.sid in used}
    claimed: dict[str, int] = {}  # server folder -> index in steps of the step stopping it
    for d in pending:
        gpus = set(d.gpu_indices)
        overlap = [s for s in others if s.gpus & gpus]
        same_port = [s for s in others if s.port == d.port]
        clash = list({s.sid: s for s in overlap + same_port}.values())
        mine = [s for s in clash if s.sid not in claimed]
        alive = [s for s in mine if s.alive]
        dead = tuple(s.sid for s in mine if not s.alive)
        old = tuple(recorded_by_port[s.port] for s in alive if s.port in recorded_by_port)
        shared = [s for s in overlap if s.alive]
        if not shared and not any(s.alive for s in same_port):
            kind: StepKind = "start" if not dead else "restart"
            note = "" if not dead else "it was not running"
            claimed.update({sid: len(steps) for sid in dead})
            steps.append(Step(kind, node, d, dead, True, note))
            taken_ports.add(d.port)
            continue
        fits = all(_util(s.argv) + _util(d.vllm_args) <= 1.0 for s in shared)
        # A server another step already stops must be gone before this one starts too:
        # make that step stop first (rare: one server split into several).
        earlier = {claimed[s.sid] for s in clash if s.sid in claimed}
        for i in earlier:
            steps[i] = dataclasses.replace(steps[i], stop_first=True)
        fits = fits and not earlier
        start = d
        if fits and any(s.alive and s.port == d.port for s in clash):
            home = port_base + d.gpu_indices[0]
            alt = home + SURGE_PORT_OFFSET if d.port == home else home
            if alt in taken_ports or any(s.port == alt for s in live):
                fits = False
            else:
                start = dataclasses.replace(d, port=alt)
        sids = tuple(s.sid for s in alive) + dead
        claimed.update({sid: len(steps) for sid in sids})
        if fits:
            note = "start before stop: both fit in GPU memory"
            if start.port != d.port:
                note += f", new server on port {start.port}"
        else:
            need = "GPU memory" if shared else "port"
            note = f"stop then start: the new server needs the old one's {need}"
        steps.append(Step("replace", node, start, sids, not fits, note, old))
        taken_ports.add(start.port)
    used.update(claimed)

    for s in others:
        if s.sid not in used:
            why = "not in the plan" if s.alive else "not in the plan (was not running)"
            steps.append(Step("stop", node, None, (s.sid,), False, why))
    return steps


@dataclass(frozen=True)
class SleeperFate:
    """What a plan means for a node's sleeping servers (vLLM's sleep mode, put to sleep by the
    autopilot): `keep` asleep where the plan leaves their GPUs to what runs there; `wake` the
    ones the plan wants awake on GPUs nothing else keeps; `stop` the rest, whose GPUs the plan
    gives to another server (a server the plan wants cold starts again after the stop)."""

    keep: tuple[Sleeper, ...] = ()
    wake: tuple[Sleeper, ...] = ()
    stop: tuple[Sleeper, ...] = ()


def sleepers_under(
    want: Sequence[Deployment], awake: Sequence[Deployment], asleep: Sequence[Sleeper]
) -> SleeperFate:
    """The fate of a node's sleepers `asleep` under a plan that wants `want` there, where
    `awake` runs now."""
    wanted = {w.args_hash for w in want}
    staying = {d.args_hash for d in awake} & wanted
    leaving = [d for d in awake if d.args_hash not in wanted]
    keep: list[Sleeper] = []
    wake: list[Sleeper] = []
    stop: list[Sleeper] = []
    for s in asleep:
        d = s.deployment
        if d.args_hash in wanted:
            # Woken beside a server that is still on its GPUs, it would not fit: that one
            # stops first, and this one starts cold after it.
            (stop if any(_overlap(d, a) for a in leaving) else wake).append(s)
        elif any(_overlap(d, w) and w.args_hash not in staying for w in want):
            stop.append(s)  # a new server takes its GPUs
        else:
            keep.append(s)
    return SleeperFate(tuple(keep), tuple(wake), tuple(stop))


def _overlap(a: Deployment, b: Deployment) -> bool:
    return a.node == b.node and bool(set(a.gpu_indices) & set(b.gpu_indices))
