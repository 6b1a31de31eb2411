"""`fleetctl autopilot`: the autopilot's decisions carried out on the live fleet, one interval
at a time.

Each interval reads the new lines of route-serve's request log (autopilot/traffic.py), asks
the autopilot for a decision (autopilot/decide.py: the same code the simulator runs) and
carries its changes out in their order, each on its own: a fault is that change's, and the
rest go on. It talks to route-serve only through state.json (written under the state folder's
write lock, atomically) and route-serve's /metrics:
- sleep: the server is marked draining in state.json (route-serve sends it nothing new), its
  requests in flight at route-serve are waited for (up to the drain timeout), it is put to
  sleep (`POST /sleep?level=N`) and moved from `deployments` to `asleep`;
- wake: `GET /is_sleeping`, `POST /wake_up` (a wake that fails, out of memory among others,
  is a fault and the server stays asleep), then back to `deployments`;
- start and stop are apply's (a server's process over SSH): the live loop does not carry them
  out yet; they are logged as such, and so are the sleeps that would free GPUs for a start.
The whole change set runs under apply's state lock, so that apply and the autopilot never
change one fleet at once. A stop (SIGINT, SIGTERM) abandons a drain under way (the server is
no longer draining, and stays awake) and leaves every server as it is.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetctl.apply import sleepmode
from fleetctl.apply.lock import StateLock
from fleetctl.apply.sleepmode import SleepModeError
from fleetctl.autopilot import edge
from fleetctl.autopilot.changes import Change, Resident, same_server
from fleetctl.autopilot.decide import Autopilot, Decision, Settings
from fleetctl.autopilot.simulated import GATE_INTERVALS, default_costs
from fleetctl.autopilot.traffic import Interval, LogTail
from fleetctl.base.errors import OperationError
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.fleet.state import Sleeper, State, server_name
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.calibration import Calibration

NOT_LIVE = "not carried out live yet: run `fleetctl apply` for starts and stops"
OUTCOMES = ("moved", "held", "gated", "dry_run", "idle")


@dataclass(frozen=True)
class LiveOptions:
    router: str  # route-serve's base URL
    request_log: Path  # its request log: the folder, or one file
    audit_log: Path | None = None
    dry_run: bool = False
    once: bool = False
    drain_timeout_s: float = 120.0
    poll_s: float = 0.2  # how often a drain or a wake is looked at


class Stopped(Exception):
    """A stop arrived while a change waited."""


class Live:
    """One fleet's autopilot, carried out on its servers."""

    def __init__(
        self,
        inv: Inventory,
        sdir: StateDir,
        options: LiveOptions,
        settings: Settings,
        calibration: Calibration | None = None,
        stop: threading.Event | None = None,
    ):
        self.inv, self.sdir, self.options, self.settings = inv, sdir, options, settings
        self.stop = stop or threading.Event()
        state = sdir.load_state()
        self.pilot = Autopilot(
            inv, default_costs(inv, calibration), settings, _residents(state, []), calibration
        )
        self.tail = LogTail(options.request_log, GATE_INTERVALS * settings.interval_s)
        self.first = True

    def run(self, report: Callable[[dict[str, Any]], None]) -> None:
        """Decide and carry out each interval until a stop (or once)."""
        while not self.stop.is_set():
            report(self.tick(time.time()))
            if self.options.once:
                return
            self.stop.wait(self.settings.interval_s)

    def tick(self, now: float) -> dict[str, Any]:
        """One interval: read, decide, carry out, log. The record the audit log keeps."""
        state = self.sdir.load_state()
        self.pilot.residents = _residents(state, self.pilot.residents)
        seen = self.tail.interval(now, self.settings.interval_s, state.slo, self.first)
        self.first = False
        self.pilot.record(seen.counts, seen.met)
        decision = self.pilot.decide(now, seen.recent)
        results = self._carry_out(decision)
        done = [c for c, r in zip(decision.changes, results, strict=True) if r["result"] == "done"]
        if not self.options.dry_run:
            self.pilot.carried_out(dataclasses.replace(decision, changes=done))
        record = _record(decision, seen, results, self.options.dry_run)
        if self.options.audit_log is not None:
            append_audit(self.options.audit_log, record)
        return record

    # --- carrying a decision out -------------------------------------------------------------

    def _carry_out(self, decision: Decision) -> list[dict[str, Any]]:
        changes = decision.changes
        if self.options.dry_run or not changes:
            return [_result(c, "dry_run", f"would {c.kind}: {c.why}") for c in changes]
        try:
            with StateLock(self.sdir, "autopilot"):
                return self._each(changes)
        except OperationError as e:
            return [_result(c, "fault", f"not carried out: {e}") for c in changes]

    def _each(self, changes: list[Change]) -> list[dict[str, Any]]:
        starts = [c for c in changes if c.kind == "start"]
        failed: set[str] = set()  # models an arrival of which did not arrive
        out: list[dict[str, Any]] = []
        for c in changes:
            d = c.deployment
            if self.stop.is_set():
                out.append(_result(c, "abandoned", "the autopilot was stopped"))
            elif c.kind in ("start", "stop"):
                failed.update([d.model] if c.kind == "start" else [])
                out.append(_result(c, "skipped", NOT_LIVE))
            elif c.kind == "sleep" and not c.after and any(_frees(c, s) for s in starts):
                out.append(_result(c, "skipped", f"it would free its GPUs for a start; {NOT_LIVE}"))
            elif c.kind == "sleep" and c.after and d.model in failed:
                why = "held: an arrival for its model is not ready, so it keeps serving"
                out.append(_result(c, "skipped", why))
            else:
                r = self._one(c)
                if c.kind == "wake" and r["result"] != "done":
                    failed.add(d.model)
                out.append(r)
        return out

    def _one(self, c: Change) -> dict[str, Any]:
        try:
            if c.kind == "sleep":
                return self._sleep(c)
            return self._wake(c)
        except Stopped:
            return _result(c, "abandoned", "stopped while draining; the server stays awake")
        except SleepModeError as e:
            return _result(c, "fault", str(e))

    def _sleep(self, c: Change) -> dict[str, Any]:
        d, name = c.deployment, server_name(c.deployment)
        with self.sdir.write_lock():
            state = self.sdir.load_state()
            if not any(server_name(x) == name for x in state.deployments):
                raise SleepModeError(f"{name} is no longer an awake server in state.json")
            self.sdir.save_state(dataclasses.replace(state, draining=state.draining | {name}))
        try:
            note = self._drain(d)
            sleepmode.sleep(d, c.level)
        except (Stopped, SleepModeError):
            self._update(lambda s: dataclasses.replace(s, draining=s.draining - {name}))
            raise

        def asleep(s: State) -> State:
            mine = next((x for x in s.deployments if server_name(x) == name), d)
            awake = tuple(x for x in s.deployments if server_name(x) != name)
            slept = (*s.asleep, Sleeper(mine, 1 if c.level == 1 else 2))
            return dataclasses.replace(
                s, deployments=awake, asleep=slept, draining=s.draining - {name}
            )

        self._update(asleep)
        return _result(c, "done", f"asleep at level {c.level}{note}")

    def _drain(self, d: Deployment) -> str:
        """Wait until route-serve has nothing in flight at `d`, or the drain timeout."""
        end = time.monotonic() + self.options.drain_timeout_s
        while True:
            left = edge.outstanding(self.options.router, d)
            if left == 0:
                return ""
            if time.monotonic() >= end:
                return f" (drain timed out with {left} request(s) in flight; vLLM aborts them)"
            if self.stop.wait(self.options.poll_s):
                raise Stopped

    def _wake(self, c: Change) -> dict[str, Any]:
        d, name = c.deployment, server_name(c.deployment)
        note = ""
        if sleepmode.is_sleeping(d):
            sleepmode.wake(d)
        else:
            note = " (it was awake already)"

        def awake(s: State) -> State:
            mine = next((x for x in s.asleep if x.name == name), None)
            back = mine.deployment if mine is not None else d
            clash = [x for x in s.deployments if x.key == back.key]
            if clash:
                raise SleepModeError(
                    f"woken, but state.json has {server_name(clash[0])} awake on its GPUs"
                )
            asleep = tuple(x for x in s.asleep if x.name != name)
            return dataclasses.replace(s, deployments=(*s.deployments, back), asleep=asleep)

        self._update(awake)
        return _result(c, "done", f"awake{note}")

    def _update(self, change: Callable[[State], State]) -> None:
        with self.sdir.write_lock():
            self.sdir.save_state(change(self.sdir.load_state()))


def _frees(leave: Change, start: Change) -> bool:
    a, b = leave.deployment, start.deployment
    return a.node == b.node and bool(set(a.gpu_indices) & set(b.gpu_indices))


def _residents(state: State, known: list[Resident]) -> list[Resident]:
    """What state.json says runs, as residents; a server the autopilot knew keeps its
    Deployment (the autopilot counts its unneeded intervals by it)."""

    def known_as(d: Deployment) -> Deployment:
        return next((r.deployment for r in known if same_server(r.deployment, d)), d)

    return [Resident(known_as(d)) for d in state.deployments] + [
        Resident(known_as(s.deployment), s.level) for s in state.asleep
    ]


def _result(c: Change, result: str, detail: str) -> dict[str, Any]:
    d = c.deployment
    return {
        "kind": c.kind,
        "server": server_name(d),
        "model": d.model,
        "result": result,
        "detail": detail,
    }


def outcome(decision: Decision, dry_run: bool) -> str:
    """moved, held, gated, dry_run or idle: what became of a decision."""
    if decision.changes:
        return "dry_run" if dry_run else "moved"
    if any(h.startswith("gate:") for h in decision.held):
        return "gated"
    return "held" if decision.held else "idle"


def _record(
    decision: Decision, seen: Interval, results: list[dict[str, Any]], dry_run: bool
) -> dict[str, Any]:
    at = dt.datetime.fromtimestamp(decision.at, dt.UTC).isoformat(timespec="seconds")
    return {
        "at": at,
        "outcome": outcome(decision, dry_run),
        "requests": seen.counts,
        "met": {m: list(v) for m, v in seen.met.items()},
        **decision.to_json(),
        "carried_out": results,
    }


def append_audit(path: Path, record: Mapping[str, Any]) -> None:
    """One line on the audit log (0600; never through a link)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
    finally:
        os.close(fd)
