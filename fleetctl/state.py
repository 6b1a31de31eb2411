"""The record of what fleetctl has deployed: `.fleetctl/state.json`, read and written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetctl.errors import OperationError
from fleetctl.plan import Deployment

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


def state_path(state_dir: Path) -> Path:
    return state_dir / "state.json"


def load_state(state_dir: Path) -> State:
    """The recorded state, or an empty one when nothing was applied yet."""
    path = state_path(state_dir)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return State()
    except (OSError, ValueError) as e:
        raise OperationError(f"{path}: cannot read the state file: {e}") from None
    try:
        deployments = tuple(Deployment.from_json(d) for d in raw.get("deployments", []))
        return State(int(raw.get("serial", 0)), deployments)
    except (KeyError, TypeError, ValueError) as e:
        raise OperationError(f"{path}: the state file is damaged ({e})") from None


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write via a temporary file, fsync and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_state(state_dir: Path, state: State) -> None:
    write_atomic(state_path(state_dir), json.dumps(state.to_json(), indent=2) + "\n")
