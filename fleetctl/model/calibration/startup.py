"""How long a server takes from start to healthy: apply's timings per class key, and the
phases vLLM's start-up log names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fleetctl.model.calibration.key import Key
from fleetctl.model.calibration.rules import CalibrationError, is_num

KEEP_STARTUPS = 16  # start-ups an entry keeps per key, newest last

_SECONDS = r"([0-9]+(?:\.[0-9]+)?)\s*(?:s|secs?|seconds)\b"
# (phase, pattern): the first match of each counts; later lines of the same phase (one per
# tensor-parallel rank) took as long, in parallel.
_STARTUP_PHASES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("model_init_s", re.compile(r"Initializing model took " + _SECONDS)),
    ("weights_s", re.compile(r"Loading weights took " + _SECONDS)),
    # The GPU runner: the whole load (init and weights) in one line.
    ("model_load_s", re.compile(r"Model loading took [0-9.]+ GiB (?:memory )?and " + _SECONDS)),
    ("compile_s", re.compile(r"torch\.compile takes " + _SECONDS + r" in total")),
    ("graphs_s", re.compile(r"Graph capturing finished in " + _SECONDS)),
    ("engine_init_s", re.compile(r"init engine (?:\([^)]*\) )?took " + _SECONDS)),
)


def parse_startup_log(text: str) -> dict[str, float]:
    """The start-up phases a vLLM server's log names, in seconds: model_init_s, weights_s,
    model_load_s (GPU runner), compile_s, graphs_s, engine_init_s (profile, KV cache and
    warm-up; it includes compile and graphs). A phase the log does not name is left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name, pattern in _STARTUP_PHASES:
            if name in out:
                continue
            m = pattern.search(line)
            if m:
                out[name] = float(m.group(1))
    return out


@dataclass(frozen=True)
class Startup:
    """How long servers of one key took from the start command to a healthy /health and
    /v1/models, as apply timed them (`seconds`, newest last), and the phases the newest
    one's log named. The figure used is the median: the first start on a node may include
    a download, or a cold page cache, that later ones do not."""

    key: Key
    measured_at: str
    seconds: tuple[float, ...]
    phases: tuple[tuple[str, float], ...] = ()
    servers: tuple[str, ...] = ()

    @property
    def median_s(self) -> float:
        xs = sorted(self.seconds)
        mid = len(xs) // 2
        return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2

    def describe(self) -> str:
        """`measured by apply over 3 starts, 2026-12-01 10:20`."""
        n = len(self.seconds)
        when = self.measured_at[:16].replace("T", " ")
        return f"measured by apply over {n} start{'s' if n != 1 else ''}, {when}"

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key.to_json(),
            "measured_at": self.measured_at,
            "median_s": round(self.median_s, 3),
            "seconds": [round(s, 3) for s in self.seconds],
            "phases": dict(self.phases),
            "servers": list(self.servers),
        }

    @classmethod
    def from_json(cls, raw: object, where: str) -> Startup:
        if not isinstance(raw, dict):
            raise CalibrationError(f"{where}: not an object")
        key = Key.from_json(raw.get("key"), f"{where}.key")
        at = raw.get("measured_at")
        if not isinstance(at, str) or not at:
            raise CalibrationError(f"{where}.measured_at: not a timestamp")
        seconds = raw.get("seconds")
        if not isinstance(seconds, list) or not seconds or not all(is_num(s) for s in seconds):
            raise CalibrationError(f"{where}.seconds: not a list of numbers")
        if any(s < 0 for s in seconds):
            raise CalibrationError(f"{where}.seconds: a negative time")
        phases = raw.get("phases", {})
        if not isinstance(phases, dict) or not all(
            isinstance(k, str) and is_num(v) for k, v in phases.items()
        ):
            raise CalibrationError(f"{where}.phases: not an object of numbers")
        servers = raw.get("servers", [])
        if not isinstance(servers, list) or not all(isinstance(s, str) for s in servers):
            raise CalibrationError(f"{where}.servers: not a list of names")
        return cls(
            key,
            at,
            tuple(float(s) for s in seconds),
            tuple((k, float(v)) for k, v in phases.items()),
            tuple(servers),
        )
