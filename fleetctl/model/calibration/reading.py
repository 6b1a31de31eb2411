"""One server's reading during `fleetctl calibrate`, for the command's table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetctl.model.calibration.figures import Figure, Figures
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
        f = self.figures

        def fig(x: Figure | None) -> dict[str, Any] | None:
            return None if x is None else x.to_json()

        return {
            "url": self.url,
            "node": self.node,
            "key": None if self.key is None else self.key.to_json(),
            "error": self.error,
            "n_samples": len(self.samples),
            "kv_tokens": fig(f.kv_tokens),
            "step": None if f.step is None else f.step.to_json(),
            "step_at_batch_s": fig(f.step_at_batch),
            "prefill_tok_s": fig(f.prefill_tok_s),
            "ttft_s": fig(f.ttft_s),
        }
