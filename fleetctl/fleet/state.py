"""State: what fleetctl has deployed, as recorded in `.fleetctl/state.json` (fleet/statedir.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from fleetctl.base import documents, names
from fleetctl.fleet.plan import Deployment, DeploymentRecord
from fleetctl.fleet.slo import Slo, SloRecord, recorded_slos

STATE_FORMAT = 1


@dataclass(frozen=True)
class State:
    serial: int = 0
    deployments: tuple[Deployment, ...] = field(default_factory=tuple)
    # Each model's SLO as the plan applied was made by (fleetctl/fleet/slo.py): route-serve
    # and simulate judge by it.
    slo: Mapping[str, Slo] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        records = tuple(d.record() for d in self.deployments)
        slos = {name: slo.record() for name, slo in self.slo.items()}
        return documents.dump(StateFile(self.serial, records, slos), STATE_FORMAT)

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
        where = f"the applied plan (state serial {f.serial})"
        return cls(
            f.serial, tuple(Deployment.of(r) for r in f.deployments), recorded_slos(f.slo, where)
        )


@dataclass(frozen=True)
class StateFile:
    """state.json: the serial apply counts up, and each deployment's record."""

    serial: Annotated[int, Field(ge=0)] = 0
    deployments: tuple[DeploymentRecord, ...] = ()
    # Absent from state written before plans recorded their SLO.
    slo: dict[Annotated[str, AfterValidator(names.model_name)], SloRecord] = field(
        default_factory=dict
    )
