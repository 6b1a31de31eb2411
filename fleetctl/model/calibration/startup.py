"""How long a server takes from start to healthy: apply's timings per class key, and the
phases vLLM's start-up log names."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field, FiniteFloat

from fleetctl.model.calibration.key import Key
from fleetctl.model.calibration.rules import Name, rounded

KEEP_STARTUPS = 16  # start-ups an entry keeps per key, newest last

# A start-up's time: never negative, kept to the millisecond.
Seconds = Annotated[FiniteFloat, Field(ge=0), rounded(3)]

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
    measured_at: Name
    seconds: Annotated[tuple[Seconds, ...], Field(min_length=1)]
    phases: dict[str, FiniteFloat] = field(default_factory=dict)  # seconds by phase name
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
