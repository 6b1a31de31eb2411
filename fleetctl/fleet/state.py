"""State: what fleetctl has deployed, as recorded in `.fleetctl/state.json` (fleet/statedir.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from fleetctl.base import documents, names
from fleetctl.fleet.plan import Deployment, DeploymentRecord
from fleetctl.fleet.slo import Slo, SloRecord, recorded_slos

STATE_FORMAT = 1

SleepLevel = Literal[1, 2]  # vLLM's: 1 keeps the weights in host memory, 2 drops them


@dataclass(frozen=True)
class Sleeper:
    """A server resident but asleep (vLLM's sleep mode): its process holds its port and,
    at level 1, its weights in host memory; its GPUs are free for the slot's awake server,
    and a wake gives them back to it in seconds."""

    deployment: Deployment
    level: SleepLevel = 1

    @property
    def name(self) -> str:
        return server_name(self.deployment)


def server_name(d: Deployment) -> str:
    """A server's name in state.json's `draining` list: its node and port, which are unique
    where the GPUs are not (a sleeper shares its slot's GPUs)."""
    return f"{d.node}:{d.port}"


@dataclass(frozen=True)
class State:
    serial: int = 0
    deployments: tuple[Deployment, ...] = field(default_factory=tuple)
    # Each model's SLO as the plan applied was made by (fleetctl/fleet/slo.py): route-serve
    # and simulate judge by it.
    slo: Mapping[str, Slo] = field(default_factory=dict)
    # Servers resident but asleep (the autopilot's), and the awake ones being drained before
    # they sleep or stop: route-serve sends a draining server nothing new, and a sleeping one
    # nothing while an awake one can meet the objective. `deployments` stays what is awake,
    # one server per slot, so a plan's diff, drift and health read it as before.
    asleep: tuple[Sleeper, ...] = ()
    draining: frozenset[str] = frozenset()  # server_name()s of `deployments`

    def to_json(self) -> dict[str, Any]:
        records = tuple(d.record() for d in self.deployments)
        slos = {name: slo.record() for name, slo in self.slo.items()}
        asleep = tuple(SleeperRecord(s.deployment.record(), s.level) for s in self.asleep)
        f = StateFile(self.serial, records, slos, asleep, tuple(sorted(self.draining)))
        out = documents.dump(f, STATE_FORMAT)
        for key in ("asleep", "draining"):  # a fleet without sleep mode writes what it did
            if not out[key]:
                del out[key]
        return out

    @classmethod
    def from_json(cls, raw: object) -> State:
        """Raises DocumentError naming the field that is wrong, or a format it does not read."""
        f = documents.parse(raw, StateFile, reads=(STATE_FORMAT,), default_format=STATE_FORMAT)
        # A slot (node, GPUs) holds one server; every reader keys deployments by it, so a
        # second record of one would be merged into the first without a word.
        first: dict[tuple[str, tuple[int, ...]], int] = {}
        for i, r in enumerate(f.deployments):
            j = first.setdefault((r.node, r.gpu_indices), i)
            if j != i:
                gpus = ",".join(map(str, r.gpu_indices))
                raise documents.DocumentError(
                    f"deployments[{i}]: node {r.node} GPUs {gpus} is recorded twice "
                    f"(first at deployments[{j}])"
                )
        awake = tuple(Deployment.of(r) for r in f.deployments)
        asleep = tuple(Sleeper(Deployment.of(r.deployment), r.level) for r in f.asleep)
        _check_residents(awake, asleep, f.draining)
        where = f"the applied plan (state serial {f.serial})"
        return cls(f.serial, awake, recorded_slos(f.slo, where), asleep, frozenset(f.draining))


def _check_residents(
    awake: tuple[Deployment, ...], asleep: tuple[Sleeper, ...], draining: tuple[str, ...]
) -> None:
    """Each server's node and port once among the awake and the asleep (two processes
    cannot hold one port), and each draining name an awake server's."""
    seen: dict[str, str] = {}
    for where, d in [
        *((f"deployments[{i}]", d) for i, d in enumerate(awake)),
        *((f"asleep[{i}]", s.deployment) for i, s in enumerate(asleep)),
    ]:
        first = seen.setdefault(server_name(d), where)
        if first != where:
            raise documents.DocumentError(
                f"{where}: node {d.node} port {d.port} is recorded twice (first at {first})"
            )
    names_awake = {server_name(d) for d in awake}
    for i, name in enumerate(draining):
        if name not in names_awake:
            raise documents.DocumentError(
                f"draining[{i}]: {name} is not an awake server in deployments "
                f"(write node:port of one of them)"
            )


@dataclass(frozen=True)
class SleeperRecord:
    """A sleeping server in state.json: its deployment's record and its sleep level."""

    deployment: DeploymentRecord
    level: SleepLevel = 1


@dataclass(frozen=True)
class StateFile:
    """state.json: the serial apply counts up, and each deployment's record."""

    serial: Annotated[int, Field(ge=0)] = 0
    deployments: tuple[DeploymentRecord, ...] = ()
    # Absent from state written before plans recorded their SLO.
    slo: dict[Annotated[str, AfterValidator(names.model_name)], SloRecord] = field(
        default_factory=dict
    )
    # Absent from state written before sleep mode.
    asleep: tuple[SleeperRecord, ...] = ()
    draining: tuple[str, ...] = ()
