"""One server's reading during `fleetctl calibrate`, for the command's table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetctl.base import documents
from fleetctl.model.calibration.figures import Figures
from fleetctl.model.calibration.key import Key
from fleetctl.model.calibration.window import Sample


@dataclass(frozen=True)
class ServerReading:
    """What one calibration run read from one server: its figures beside the model's, or why
    it could not be read."""

    url: str
    node: str
    key: Key | None = None
    samples: tuple[Sample, ...] = ()
    kv_tokens: int | None = None
    figures: Figures = field(default_factory=Figures)
    gpu_memory_utilization: float | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """`calibrate --json`'s line for the server: its figures as the file keeps an entry's,
        and how many samples it gave rather than the samples."""
        return {
            "url": self.url,
            "node": self.node,
            "key": None if self.key is None else documents.data(self.key),
            "error": self.error,
            "n_samples": len(self.samples),
            **documents.data(self.figures),
        }
