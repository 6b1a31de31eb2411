"""What a benchmark reports: percentiles, the machine and versions, its output folder and
results file."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp


def pct_rank(values: list[float], q: float) -> float:
    """The q-quantile (0-1) by nearest rank: a value that was measured."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def pct_linear(values: list[float], p: float) -> float:
    """The p-th percentile (0-100) by linear interpolation between closest ranks, as the
    simulator's summary computes it."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def machine() -> str:
    model = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(
            (ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), ""
        )
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"nproc {os.cpu_count()}, {model} (KVM), {mem:.0f} GiB, Linux {platform.release()}, "
        f"Python {platform.python_version()}, aiohttp {aiohttp.__version__}"
    )


def peer_version(python: Path, dist: str) -> str | None:
    """The version of `dist` installed for `python` (a peer router's venv), or None."""
    if not python.exists():
        return None
    out = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() if out.returncode == 0 else None


def out_dir(path: str) -> Path:
    """The run's output folder, created; and SIGTERM made an exit, so that the benchmark's
    finally blocks stop every process it started."""
    work = Path(path)
    work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return work


def header(script: str, took_s: float) -> list[str]:
    """The first lines of a report: the command as run, the machine, the date."""
    return [
        f"- Command: `python benchmarks/{Path(script).name} {' '.join(sys.argv[1:])}`".strip(),
        f"- Machine: {machine()}",
        f"- Date: {datetime.date.today().isoformat()}; the run took {took_s:.0f} s",
    ]


def write_json(path: Path, dump: dict[str, Any]) -> None:
    path.write_text(json.dumps(dump, indent=1, default=str))
