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
- wake: `GET /is_sleeping`; where the inventory names a dcgm-exporter port, the node's free
  memory on the server's GPUs (DCGM_FI_DEV_FB_FREE) against what the wake takes back; `POST
  /wake_up` (a wake refused for memory, or one that fails, is a fault and the server stays
  asleep), then back to `deployments`;
- start and stop go through apply's code (apply/flow.py, over SSH, as `fleetctl apply` with a
  plan given): the nodes converge to what runs, less what leaves, plus what starts; a server
  in the way of a start is drained first, one that leaves once the arrivals are ready stops
  after they are healthy (apply's start before stop). A sleep that only frees GPUs for a
  start is carried out as a stop (apply puts one server on a GPU group). Without a way to
  the nodes (`LiveOptions.apply`), they are logged as not carried out.
Every change runs under apply's state lock, so that an apply and the autopilot never change
one fleet at once. A stop (SIGINT, SIGTERM) abandons a drain under way (the server is
no longer draining, and stays awake) and leaves every server as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetctl.apply import sleepmode
from fleetctl.apply.execute import ApplyOptions, Outcome
from fleetctl.apply.flow import PlanFile, apply_plan
from fleetctl.apply.lock import StateLock
from fleetctl.apply.node import server_id
from fleetctl.apply.sleepmode import SleepModeError
from fleetctl.autopilot import edge
from fleetctl.autopilot.changes import Change, Resident, same_server
from fleetctl.autopilot.decide import Autopilot, Decision, Settings
from fleetctl.autopilot.simulated import GATE_INTERVALS, default_costs
from fleetctl.autopilot.traffic import Interval, LogTail
from fleetctl.base.errors import OperationError, UserError
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment, Plan
from fleetctl.fleet.state import Sleeper, State, server_name
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.calibration import Calibration

NOT_LIVE = "not carried out: the autopilot was given no way to the nodes (run `fleetctl apply`)"
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
    apply: ApplyOptions | None = None  # how starts and stops reach the nodes; None: they don't


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
        woken = [] if self.options.dry_run else self._woken_by_router(state)
        if woken:
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
        if woken:
            record["woken_by_router"] = woken
        if self.options.audit_log is not None:
            append_audit(self.options.audit_log, record)
        return record

    # --- carrying a decision out -------------------------------------------------------------

    def _carry_out(self, decision: Decision) -> list[dict[str, Any]]:
        """Each change's result, in the changes' order. Sleeps and wakes go first (under the
        state lock), then the starts and stops through apply (which takes the lock itself),
        then the servers that leave once their model's arrivals are ready."""
        changes = decision.changes
        if self.options.dry_run or not changes:
            return [_result(c, "dry_run", f"would {c.kind}: {c.why}") for c in changes]
        starts = [c for c in changes if c.kind == "start"]
        # A sleep that only frees GPUs for a start is a stop: apply puts one server on a GPU
        # group (a sleeper whose GPUs a plan gives away is stopped by it).
        by_apply = [
            c
            for c in changes
            if c.kind in ("start", "stop")
            or (c.kind == "sleep" and not c.after and any(_frees(c, s) for s in starts))
        ]
        results: dict[int, dict[str, Any]] = {}
        first = [c for c in changes if c not in by_apply and not c.after]
        last = [c for c in changes if c not in by_apply and c.after]
        failed: set[str] = set()  # models an arrival of which did not arrive
        self._locked(first, failed, results)
        if by_apply:
            for c, r in zip(by_apply, self._apply(by_apply), strict=True):
                results[id(c)] = r
                if c.kind == "start" and r["result"] != "done":
                    failed.add(c.deployment.model)
        self._locked(last, failed, results)
        return [results[id(c)] for c in changes]

    def _locked(
        self, changes: list[Change], failed: set[str], results: dict[int, dict[str, Any]]
    ) -> None:
        """Sleeps and wakes one by one under the state lock."""
        if not changes:
            return
        try:
            with StateLock(self.sdir, "autopilot"):
                for c in changes:
                    results[id(c)] = self._guarded(c, failed)
        except OperationError as e:
            for c in changes:
                results.setdefault(id(c), _result(c, "fault", f"not carried out: {e}"))

    def _guarded(self, c: Change, failed: set[str]) -> dict[str, Any]:
        if self.stop.is_set():
            return _result(c, "abandoned", "the autopilot was stopped")
        if c.after and c.deployment.model in failed:
            return _result(c, "skipped", "held: an arrival for its model is not ready")
        r = self._one(c)
        if c.kind == "wake" and r["result"] != "done":
            failed.add(c.deployment.model)
        return r

    def _apply(self, changes: list[Change]) -> list[dict[str, Any]]:
        """Starts and stops (and sleeps that only free GPUs for a start, as stops) through
        apply's code: the nodes converge to what runs, less what leaves, plus what starts."""
        opts = self.options.apply
        if opts is None:
            return [_result(c, "skipped", NOT_LIVE) for c in changes]
        if self.stop.is_set():
            return [_result(c, "abandoned", "the autopilot was stopped") for c in changes]
        leaving = [c.deployment for c in changes if c.kind != "start"]
        # Those in the way of a start stop first: drained, so that nothing is cut.
        for c in changes:
            if c.kind != "start" and not c.after:
                try:
                    self._mark_draining(c.deployment)
                    self._drain(c.deployment)
                except Stopped:
                    self._undrain(leaving)
                    return [_result(x, "abandoned", "the autopilot was stopped") for x in changes]
                except SleepModeError as e:
                    self._undrain(leaving)
                    return [_result(x, "fault", f"not drained: {e}") for x in changes]
        state = self.sdir.load_state()
        gone = {server_name(d) for d in leaving}
        target = [d for d in state.deployments if server_name(d) not in gone]
        target += [c.deployment for c in changes if c.kind == "start"]
        plan = PlanFile(self.sdir.state_path, state.serial, target, dict(state.slo))
        try:
            run = apply_plan(self.inv, self.sdir, opts, _no_plan, plan, _Unattended())
        except (UserError, OperationError) as e:
            self._undrain(leaving)
            return [_result(c, "fault", f"apply: {e}") for c in changes]
        self._undrain(leaving)
        return [_applied(c, run.outcomes) for c in changes]

    def _mark_draining(self, d: Deployment) -> None:
        name = server_name(d)
        self._update(lambda s: dataclasses.replace(s, draining=s.draining | {name}))

    def _undrain(self, ds: list[Deployment]) -> None:
        names = {server_name(d) for d in ds}
        self._update(lambda s: dataclasses.replace(s, draining=s.draining - names))

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
            port = self.inv.spec.router.dcgm_exporter_port
            gpu = next((n.gpu for n in self.inv.nodes if n.name == d.node), None)
            if port is not None and gpu is not None:
                note = sleepmode.check_room(d, port, sleepmode.wake_bytes(d, gpu.memory_bytes))
            sleepmode.wake(d)
        else:
            note = " (it was awake already)"

        self._update(lambda s: _awake(s, name, d))
        return _result(c, "done", f"awake{note}")

    def _woken_by_router(self, state: State) -> list[str]:
        """The sleepers route-serve woke itself (a request found its model with no awake
        server, or every awake one would miss), moved to the awake servers in state.json so
        the autopilot decides on what runs. One that does not answer stays as it is."""
        woken = []
        for s in state.asleep:
            try:
                if sleepmode.is_sleeping(s.deployment):
                    continue
                self._update(functools.partial(_awake, name=s.name, d=s.deployment))
            except SleepModeError:
                continue  # unreachable now: the next interval asks again
            woken.append(s.name)
        return woken

    def _update(self, change: Callable[[State], State]) -> None:
        with self.sdir.write_lock():
            self.sdir.save_state(change(self.sdir.load_state()))


def _awake(s: State, name: str, d: Deployment) -> State:
    """`s` with the sleeper `name` (else `d`) among the awake servers."""
    mine = next((x for x in s.asleep if x.name == name), None)
    back = mine.deployment if mine is not None else d
    clash = [x for x in s.deployments if x.key == back.key]
    if clash:
        raise SleepModeError(f"woken, but state.json has {server_name(clash[0])} awake on its GPUs")
    asleep = tuple(x for x in s.asleep if x.name != name)
    return dataclasses.replace(s, deployments=(*s.deployments, back), asleep=asleep)


def _frees(leave: Change, start: Change) -> bool:
    a, b = leave.deployment, start.deployment
    return a.node == b.node and bool(set(a.gpu_indices) & set(b.gpu_indices))


def _no_plan(state: State) -> Plan:
    raise AssertionError("the autopilot's target is carried out as given, never re-planned")


class _Unattended:
    """apply's driver for the autopilot: nothing to show, every change confirmed (the
    autopilot decided it), progress not shown (the audit log keeps the outcomes)."""

    def proposed(self, proposal: object) -> None:
        pass

    def gated(self, result: object) -> None:
        pass

    def confirm(self, question: str) -> bool:
        return True

    @contextlib.contextmanager
    def progress(self, what: str) -> Iterator[_Unattended]:
        yield self

    def warn(self, msg: str) -> None:
        pass

    def emit(self, node: str, msg: str) -> None:
        pass

    def started(self, nodes: int) -> None:
        pass

    def done(self, node: str) -> None:
        pass


def _applied(c: Change, outcomes: list[Outcome]) -> dict[str, Any]:
    """A start's or a stop's result from apply's outcomes."""
    d = c.deployment
    if c.kind == "start":
        mine = [
            o
            for o in outcomes
            if o.node == d.node and tuple(o.gpus) == d.gpu_indices and o.action != "stop"
        ]
    else:
        sid = server_id(d)
        mine = [
            o
            for o in outcomes
            if o.node == d.node
            and (sid in o.detail or (o.action == "replace" and set(o.gpus) & set(d.gpu_indices)))
        ]
    if not mine:
        return _result(c, "fault", "apply did not report it")
    o = mine[0]
    if o.status != "ok":
        return _result(c, "fault", f"apply: {o.action} failed: {o.detail}")
    took = f" after {o.startup_s:.0f} s" if o.startup_s is not None else ""
    return _result(c, "done", f"apply: {o.action} ({o.detail}){took}")


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


def outcome(decision: Decision, results: list[dict[str, Any]], dry_run: bool) -> str:
    """moved, held, gated, dry_run or idle: what became of a decision. One whose changes were
    all refused on the way (faults, a stop) moved nothing: held, its results say why."""
    if decision.changes:
        if dry_run:
            return "dry_run"
        return "moved" if any(r["result"] == "done" for r in results) else "held"
    if any(h.startswith("gate:") for h in decision.held):
        return "gated"
    return "held" if decision.held else "idle"


def _record(
    decision: Decision, seen: Interval, results: list[dict[str, Any]], dry_run: bool
) -> dict[str, Any]:
    at = dt.datetime.fromtimestamp(decision.at, dt.UTC).isoformat(timespec="seconds")
    return {
        "at": at,
        "outcome": outcome(decision, results, dry_run),
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
