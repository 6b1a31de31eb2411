"""What moving the fleet from what runs to a target placement takes, change by change, each
costed in seconds of its server's absence: a wake where the target server sleeps on its GPUs,
a cold start where it does not; a sleep for a server that leaves while it may come back, a stop
otherwise.

A GPU group holds one awake server and any number of sleeping ones (vLLM's sleep mode): a
sleeping server at level 1 keeps its weights in host memory and wakes in a second or so; at
level 2 it dropped them and reads them again (fleetctl/model/startup.py: `wake_seconds`).
Which level a leaving server sleeps at is the host memory's call: level 1 while the node's
host memory holds its weights beside the other level-1 sleepers there, else level 2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from fleetctl.fleet.plan import Deployment

Kind = Literal["start", "wake", "sleep", "stop"]
# The order a change set is carried out in: servers that free GPUs for arrivals leave first,
# then the arrivals, then (`Change.after`) the servers that leave once the arrivals are ready.
ORDER: dict[str, int] = {"sleep": 0, "stop": 0, "wake": 1, "start": 1}


@dataclass(frozen=True)
class Resident:
    """A server on a GPU group now: awake, or asleep at `level` (1 or 2)."""

    deployment: Deployment
    level: int = 0  # 0: awake

    @property
    def awake(self) -> bool:
        return self.level == 0


@dataclass(frozen=True)
class Change:
    """One step: what it does to which server, how many seconds its server is away for it
    (a start's or a wake's; 0 for a sleep or a stop, whose cost is the capacity that leaves),
    and why."""

    kind: Kind
    deployment: Deployment
    seconds: float
    level: int = 0  # a sleep's level, or the level a wake wakes from
    why: str = ""
    # A leaving server whose GPUs no arriving one needs leaves only once the arrivals are
    # ready (start before stop): its model keeps serving while they warm up.
    after: bool = False

    def to_json(self) -> dict[str, object]:
        d = self.deployment
        return {
            "kind": self.kind,
            "node": d.node,
            "gpus": list(d.gpu_indices),
            "model": d.model,
            "variant": d.variant,
            "role": d.server.role,
            "level": self.level,
            "seconds": round(self.seconds, 3),
            "why": self.why,
            "after_arrivals": self.after,
        }


# Flags the planner tunes to the traffic it plans for (the step budget, planner/candidates.py):
# a plan for another interval's request shapes may choose another, worth far less than the
# cold start (or a second resident server) a new command costs. `plan` and `apply` still
# weigh such a change by the planner's change threshold.
TUNED_FLAGS = frozenset({"--max-num-batched-tokens", "--max-num-seqs"})


def same_server(a: Deployment, b: Deployment) -> bool:
    """Whether `a` and `b` are one server: the same GPUs of one node and the same command,
    but for the flags the planner tunes to the traffic (TUNED_FLAGS)."""
    return a.key == b.key and _command(a.vllm_args) == _command(b.vllm_args)


def _command(args: Sequence[str]) -> list[str]:
    """`args` without TUNED_FLAGS and their values."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in TUNED_FLAGS:
            skip = True
        elif arg.split("=", 1)[0] not in TUNED_FLAGS:
            out.append(arg)
    return out


def overlaps(a: Deployment, b: Deployment) -> bool:
    """Whether `a` and `b` hold a GPU in common."""
    return a.node == b.node and bool(set(a.gpu_indices) & set(b.gpu_indices))


@dataclass(frozen=True)
class Costs:
    """What the change set weighs: seconds to start a server cold, to wake one from a level,
    and the host memory (bytes) a node has for level-1 sleepers' weights."""

    start_s: Callable[[Deployment], float]
    wake_s: Callable[[Deployment, int], float]
    host_bytes: Callable[[str], int]


def changes(
    residents: Sequence[Resident], target: Sequence[Deployment], costs: Costs
) -> list[Change]:
    """The changes that leave exactly `target` awake, in the order to carry them out: leaving
    servers whose GPUs an arrival needs, the arrivals, then the leaving servers that wait for
    the arrivals to be ready (`Change.after`). Servers that leave go to sleep where they can
    (started with sleep mode) at the level host memory allows; a sleeping server the target
    wants is woken, not started."""
    awake = [r for r in residents if r.awake]
    asleep = [r for r in residents if not r.awake]
    out: list[Change] = []
    keep = [t for t in target if any(same_server(r.deployment, t) for r in awake)]
    leaving = [r for r in awake if not any(same_server(r.deployment, t) for t in keep)]
    # Host memory each node's level-1 sleepers use already.
    held: dict[str, int] = {}
    for r in asleep:
        if r.level == 1:
            held[r.deployment.node] = held.get(r.deployment.node, 0) + _host_share(r.deployment)
    arriving = [t for t in target if t not in keep]
    for r in leaving:
        d = r.deployment
        after = not any(overlaps(d, t) for t in arriving)
        if not _sleeps(d):
            why = "not in the target; started without sleep mode"
            out.append(Change("stop", d, 0.0, why=why, after=after))
            continue
        need = _host_share(d)
        if held.get(d.node, 0) + need <= costs.host_bytes(d.node):
            held[d.node] = held.get(d.node, 0) + need
            why = "not in the target; weights to host memory"
            out.append(Change("sleep", d, 0.0, 1, why, after))
        else:
            out.append(Change("sleep", d, 0.0, 2, "not in the target; host memory is full", after))
    for t in target:
        if t in keep:
            continue
        sleeper = next((r for r in asleep if same_server(r.deployment, t)), None)
        if sleeper is not None:  # the sleeper itself wakes, its command as it was started
            level = sleeper.level
            d = sleeper.deployment
            seconds = costs.wake_s(d, level)
            out.append(Change("wake", d, seconds, level, f"asleep at level {level} on its GPUs"))
        else:
            out.append(Change("start", t, costs.start_s(t), why="no server of it on its GPUs"))
    return sorted(out, key=lambda c: (c.after, c.deployment.node, ORDER[c.kind]))


def _host_share(d: Deployment) -> int:
    """Host bytes a level-1 sleep of `d` keeps: its weights (the whole group's, on its node)."""
    return d.server.weights_bytes


def _sleeps(d: Deployment) -> bool:
    """Whether `d` runs with --enable-sleep-mode (only then can it sleep)."""
    return "--enable-sleep-mode" in d.vllm_args


def conflicts(target: Sequence[Deployment]) -> list[tuple[Deployment, Deployment]]:
    """Pairs of target servers that would share a GPU awake: a target must not have any."""
    found = []
    for i, a in enumerate(target):
        for b in target[i + 1 :]:
            if overlaps(a, b):
                found.append((a, b))
    return found
