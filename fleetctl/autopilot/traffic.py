"""The live autopilot's view of the traffic: route-serve's request log read as it grows, each
interval's requests per model, whether the finished ones met their objectives, and the recent
requests the gate replays.

The log's rows are read by the simulator's trace reader (sim/workload.py `trace_row`), so a
row means the same to `simulate`, `plan --trace` and the autopilot. A file is read from where
the last read stopped, up to its last whole line (route-serve appends whole batches, but a
read may meet one half written); a file that shrank was replaced and is read again from its
start; files that rotated away are forgotten.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from fleetctl.fleet.slo import Slo
from fleetctl.sim.workload import WorkItem, trace_row

CLIENT_LEFT = 499  # the client went away: no verdict on the fleet


@dataclass(frozen=True)
class Finished:
    """One finished request: its row as a WorkItem (arrival in seconds since the Unix epoch),
    and whether it met its model's objectives (None: no verdict)."""

    item: WorkItem
    met: bool | None


@dataclass(frozen=True)
class Interval:
    """What an interval's reading gives the autopilot (`Autopilot.record` and `decide`)."""

    counts: dict[str, float]
    met: dict[str, tuple[int, int]]
    recent: dict[str, list[WorkItem]]
    bad_lines: int  # lines that were not a request row (left out)


def verdict(row: Mapping[str, object], slo: Slo | None) -> bool | None:
    """Whether a logged request met `slo` from its `status`, `ttft_s`, `e2e_s` and
    `output_length` (TPOT: the time after the first token over the tokens after it)."""
    status = row.get("status")
    if not isinstance(status, int) or status == CLIENT_LEFT:
        return None
    if status != 200:
        return False
    if slo is None:
        return True
    ttft, e2e, out = row.get("ttft_s"), row.get("e2e_s"), row.get("output_length")
    if not isinstance(ttft, int | float):
        return False
    tpot = None
    if isinstance(e2e, int | float) and isinstance(out, int) and out > 1:
        tpot = max(0.0, (e2e - ttft) / (out - 1))
    return slo.met(float(ttft), tpot)


class LogTail:
    """route-serve's request log (its folder, or one file), read as it grows."""

    def __init__(self, path: Path, keep_s: float):
        self.path, self.keep_s = path, keep_s
        self.offsets: dict[Path, int] = {}
        self.window: deque[Finished] = deque()  # the last keep_s seconds' requests
        self.bad_lines = 0

    def files(self) -> list[Path]:
        if not self.path.is_dir():
            return [self.path] if self.path.exists() else []
        return sorted(p for p in self.path.iterdir() if p.suffix == ".jsonl" and p.is_file())

    def read(self, slos: Mapping[str, Slo]) -> list[Finished]:
        """The rows written since the last read, judged by `slos`."""
        out: list[Finished] = []
        files = self.files()
        self.offsets = {p: n for p, n in self.offsets.items() if p in files}
        for f in files:
            out += self._read_file(f, slos)
        return out

    def _read_file(self, f: Path, slos: Mapping[str, Slo]) -> list[Finished]:
        try:
            fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return []  # rotated away between the listing and the open
        with os.fdopen(fd, "rb") as handle:
            start = self.offsets.get(f, 0)
            if os.fstat(fd).st_size < start:
                start = 0  # the file was replaced
            handle.seek(start)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self.offsets[f] = start + end
        out = []
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                model = row["model"]
                item = trace_row(row, model)
            except (ValueError, KeyError, TypeError, AttributeError):
                self.bad_lines += 1
                continue
            if item is not None:
                out.append(Finished(item, verdict(row, slos.get(model))))
        return out

    def interval(
        self, now: float, interval_s: float, slos: Mapping[str, Slo], first: bool
    ) -> Interval:
        """The interval ending at `now` (seconds since the Unix epoch): the requests read since
        the last call (on the `first`, those that arrived in the last `interval_s`), and the
        recent ones of the last `keep_s`, their arrivals from the window's start."""
        bad = self.bad_lines
        new = self.read(slos)
        since = now - self.keep_s
        # The window takes everything recent (the gate replays it from the first interval on);
        # the first interval counts only what arrived in it.
        self.window.extend(new)
        kept = sorted((f for f in self.window if f.item.arrival >= since), key=_arrival)
        self.window = deque(kept)
        if first:
            new = [f for f in new if f.item.arrival >= now - interval_s]
        counts: dict[str, float] = {}
        met: dict[str, tuple[int, int]] = {}
        for f in new:
            m = f.item.model
            counts[m] = counts.get(m, 0.0) + 1
            if f.met is not None:
                good, total = met.get(m, (0, 0))
                met[m] = (good + f.met, total + 1)
        recent: dict[str, list[WorkItem]] = {}
        for f in self.window:
            mine = recent.setdefault(f.item.model, [])
            mine.append(replace(f.item, id=len(mine), arrival=max(0.0, f.item.arrival - since)))
        return Interval(counts, met, recent, self.bad_lines - bad)


def _arrival(f: Finished) -> float:
    return f.item.arrival
