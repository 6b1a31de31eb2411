"""State: what fleetctl has deployed, as recorded in `.fleetctl/state.json` (fleet/statedir.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetctl.fleet.plan import Deployment

STATE_FORMAT = 1


@dataclass(frozen=True)
class State:
    serial: int = 0
    deployments: tuple[Deployment, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "serial": self.serial,
            "deployments": [d.to_json() for d in self.deployments],
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> State:
        """Raises KeyError, TypeError or ValueError for a damaged record."""
        deployments = tuple(Deployment.from_json(d) for d in raw.get("deployments", []))
        return cls(int(raw.get("serial", 0)), deployments)
