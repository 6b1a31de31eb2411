"""Carrying a plan out on the nodes, node by node in parallel: apply and destroy.

One SSH connection per node does everything there: inspect what runs, stop what must go
first, start the new servers, wait for their /health and /v1/models (polled from here, the
way the router will reach them), then stop what they replace. state.json is rewritten for a
node as soon as something there changed, under one in-process lock, so an apply killed at any
moment leaves a state that a re-run (which reconciles against the nodes) converges from.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from fleetctl.apply.adapters import Upload, read_uploads, uploads_for
from fleetctl.apply.book import StateBook
from fleetctl.apply.node import NodeAgent, StartError, Supervisor, server_id
from fleetctl.apply.sleepmode import SleepModeError, check_room, wake, wake_bytes
from fleetctl.apply.steps import Step, node_steps, sleepers_under
from fleetctl.base.names import natural_key
from fleetctl.base.text import plural
from fleetctl.fleet import http
from fleetctl.fleet.http import HttpError
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.fleet.probe import target
from fleetctl.fleet.ssh import NodeError, SshOptions, SshSession, Target

Emit = Callable[[str, str], None]  # (node, message): progress for the operator
Started = Callable[[int], None]  # how many nodes this run works on
Done = Callable[[str], None]  # a node is finished


def _nothing(*_: object) -> None:
    pass


LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class ApplyOptions:
    ssh: SshOptions
    parallel: int = 32
    vllm_command: str = "vllm"
    supervisor: Supervisor = "auto"
    health_timeout_s: float = 900.0
    stop_timeout_s: int = 30
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    # Where a wake's room is read before it is tried (apply/sleepmode.py check_room): the
    # nodes' dcgm-exporter port, and each node's GPU memory in bytes.
    dcgm_port: int | None = None
    gpu_memory: dict[str, int] = field(default_factory=dict)

    @property
    def api_key(self) -> str | None:
        return self.secrets.get("VLLM_API_KEY")


@dataclass(frozen=True)
class Outcome:
    """What happened to one server (or one node, when `model` is empty)."""

    node: str
    action: str
    status: Literal["ok", "failed"]
    model: str = ""
    gpus: tuple[int, ...] = ()
    port: int | None = None
    detail: str = ""
    log_tail: str = ""
    # A server this apply started and saw healthy: seconds from its start command to a
    # healthy /health and /v1/models, and the phases its vLLM log named (fleetctl/apply/warmup.py).
    startup_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["gpus"] = list(self.gpus)
        if self.startup_s is not None:
            d["startup_s"] = round(self.startup_s, 2)
        d["phases"] = dict(self.phases)
        return d


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def ready(d: Deployment, api_key: str | None, timeout_s: float = 3.0) -> tuple[bool, str]:
    """Is the server up: /health answers 200 and /v1/models lists the served model?"""
    try:
        r = http.get(d.url("/health"), timeout_s)
        if r.status != 200:
            return False, f"/health answered {r.status}"
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
        r = http.get(d.url("/v1/models"), timeout_s, auth)
        if r.status != 200:
            return False, f"/v1/models answered {r.status}"
        ids = [m.get("id") for m in r.json().get("data", [])]
    except (HttpError, ValueError, AttributeError) as e:
        return False, f"no answer ({e})"
    if d.model not in ids:
        return False, f"/v1/models lists {ids}, not {d.model}"
    return True, "healthy"


def node_targets(inv: Inventory, extra: Iterable[Deployment]) -> dict[str, Target]:
    """Every inventory node, plus nodes only state remembers (removed from the inventory)."""
    out = {n.name: target(inv, n) for n in inv.nodes}
    ssh = inv.spec.ssh
    for d in extra:
        if d.node not in out:
            out[d.node] = Target(
                d.node, d.host, ssh.port, ssh.user, ssh.identity_file, ssh.proxy_jump
            )
    return out


# Set on Ctrl-C: node workers stop waiting for health and return; what they started keeps
# running and is adopted by the next apply.
CANCEL = threading.Event()


def _each_node(
    names: Sequence[str],
    parallel: int,
    work: Callable[[str], list[Outcome]],
    started: Started = _nothing,
    done: Done = _nothing,
) -> list[Outcome]:
    CANCEL.clear()
    started(len(names))

    def one(name: str) -> list[Outcome]:
        try:
            return work(name)
        finally:
            done(name)

    pool = ThreadPoolExecutor(max_workers=max(1, min(parallel, len(names) or 1)))
    try:
        results = list(pool.map(one, names))
    except KeyboardInterrupt:
        CANCEL.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    return [o for r in results for o in r]


# --- apply -------------------------------------------------------------------------------------


def apply_fleet(
    inv: Inventory,
    deployments: Sequence[Deployment],
    book: StateBook,
    opts: ApplyOptions,
    emit: Emit = _nothing,
    started: Started = _nothing,
    done: Done = _nothing,
) -> list[Outcome]:
    """Make the nodes run exactly `deployments`; one outcome per server touched."""
    want: dict[str, list[Deployment]] = {}
    for d in deployments:
        want.setdefault(d.node, []).append(d)
    recorded = [d for n in list(book.by_node) for d in book.recorded(n)]
    targets = node_targets(inv, recorded)
    names = sorted(set(want) | {d.node for d in recorded}, key=natural_key)
    base = inv.spec.planner.port_base
    read = read_uploads(inv)
    files = {id(d): uploads_for(inv, d, read) for d in deployments}

    def one(name: str) -> list[Outcome]:
        return _apply_node(targets[name], want.get(name, []), book, opts, emit, base, files)

    return _each_node(names, opts.parallel, one, started, done)


def _apply_node(
    t: Target,
    want: list[Deployment],
    book: StateBook,
    opts: ApplyOptions,
    emit: Emit,
    port_base: int,
    files: Mapping[int, list[Upload]] | None = None,
) -> list[Outcome]:
    node = t.name
    try:
        with SshSession(t, opts.ssh) as session:
            agent = NodeAgent(session, opts.vllm_command, opts.ssh.command_timeout_s)
            return _converge(node, agent, want, book, opts, emit, port_base, files or {})
    except NodeError as e:
        # Not emitted here: the report lists each failure once, after the node's progress.
        why = _unreachable(e)
        if not want:
            return [Outcome(node, "stop", "failed", detail=why)]
        return [Outcome(node, "apply", "failed", d.model, d.gpu_indices, d.port, why) for d in want]


def _converge(
    node: str,
    agent: NodeAgent,
    want: list[Deployment],
    book: StateBook,
    opts: ApplyOptions,
    emit: Emit,
    port_base: int,
    files: Mapping[int, list[Upload]] | None = None,
) -> list[Outcome]:
    recorded = book.recorded(node)
    outcomes: list[Outcome] = []
    want, asleep = _sleepers(node, agent, want, book, opts, emit, outcomes)
    # A sleeper's process is not the plan's to stop: it holds its port and its host memory.
    live = [s for s in agent.inspect() if s.args_hash not in asleep]
    steps = node_steps(node, want, live, recorded, port_base)
    running: dict[str, Deployment] = {}  # server folder -> what runs there at the end
    recorded_by_sid = {server_id(d): d for d in recorded}

    for st in steps:
        if st.kind == "keep" and st.deployment is not None:
            running[server_id(st.deployment)] = st.deployment
            outcomes.append(_outcome(st, "ok", "unchanged"))

    # 1. Servers in the way of a new one stop first; the record drops them at once.
    first = [sid for st in steps if st.stop_first for sid in st.stop]
    if first:
        for st in steps:
            if st.stop_first and st.stop:
                emit(node, f"stopping {', '.join(st.stop)}" + (f" ({st.note})" if st.note else ""))
        agent.stop(first, opts.stop_timeout_s)
        book.set_node(node, [d for sid, d in recorded_by_sid.items() if sid not in first])

    # 2. Start every new server, then 3. wait for all of them together.
    waiting: dict[str, Step] = {}
    began: dict[str, float] = {}  # when each server's start command was sent
    refused: set[str] = set()  # servers that could not even start
    copied: set[str] = set()  # adapters put on this node by this apply
    for st in steps:
        d = st.deployment
        if d is None or st.kind == "keep":
            continue
        if st.kind == "adopt":
            waiting[server_id(d)] = st
            continue
        t0 = time.monotonic()
        try:
            _copy(node, agent, (files or {}).get(id(d), []), copied, emit)
            sid, how = agent.start(d, opts.secrets, _now(), opts.supervisor)
        except StartError as e:
            outcomes.append(_outcome(st, "failed", f"{e.kind}: {e.detail}"))
            refused.add(server_id(d))
            continue
        note = f"; {st.note}" if st.note else ""
        what = f"{d.model} {d.variant} on GPUs {_gpus(d)}, port {d.port}"
        emit(node, f"{st.kind}: {what} ({how}{note})")
        waiting[sid] = st
        began[sid] = t0
    healthy, failed = _wait(node, agent, waiting, opts, emit, began)
    for sid, (st, took) in healthy.items():
        assert st.deployment is not None
        running[sid] = st.deployment
        phases = agent.startup_phases(sid) if took is not None else {}
        done = _outcome(st, "ok", st.note or "healthy")
        outcomes.append(dataclasses.replace(done, startup_s=took, phases=phases))
    for st, why, tail in failed.values():
        outcomes.append(_outcome(st, "failed", why, tail))
    # Recorded servers not stopped yet still run (some stop in step 4): keep them listed.
    still = {sid: d for sid, d in recorded_by_sid.items() if sid not in first}
    if healthy or failed:
        book.set_node(node, {**still, **running}.values())
    if CANCEL.is_set():
        for sid, st in waiting.items():
            if sid not in healthy and sid not in failed:
                why = "interrupted while it started; the next apply adopts it"
                outcomes.append(_outcome(st, "failed", why))
        book.set_node(node, {**still, **running}.values())
        return outcomes

    # 4. What the new servers replace, and what the plan no longer has, stops last.
    last: list[str] = []
    for st in steps:
        if st.stop_first or not st.stop:
            continue
        new = st.deployment
        if st.kind == "replace" and new is not None and server_id(new) in {*failed, *refused}:
            # The new server failed: the old one goes on serving.
            for d in st.replaced:
                running[server_id(d)] = d
            continue
        last.extend(st.stop)
        if st.kind == "stop":
            emit(node, f"stopping {', '.join(st.stop)} ({st.note})")
            outcomes.append(Outcome(node, "stop", "ok", detail=f"{', '.join(st.stop)}: {st.note}"))
    if last:
        agent.stop(last, opts.stop_timeout_s)
    if first or last or healthy or failed or set(running) != set(recorded_by_sid):
        book.set_node(node, running.values())
    return outcomes


def _copy(node: str, agent: NodeAgent, uploads: list[Upload], done: set[str], emit: Emit) -> None:
    """Put each adapter's files on the node once per apply, before a server that loads it
    starts (vLLM refuses to start when a --lora-modules path is missing)."""
    for u in uploads:
        if u.name in done:
            continue
        emit(node, f"copying adapter {u.name} to {u.dest}")
        for name, data in u.files:
            agent.put_file(u.dest, name, data)
        done.add(u.name)


def _sleepers(
    node: str,
    agent: NodeAgent,
    want: list[Deployment],
    book: StateBook,
    opts: ApplyOptions,
    emit: Emit,
    outcomes: list[Outcome],
) -> tuple[list[Deployment], set[str]]:
    """The node's sleepers under the plan: those whose GPUs it gives to another server stop,
    those it wants awake are woken (a failed wake keeps one asleep and out of this apply),
    the rest stay asleep. What the plan still wants started, and the args hashes of the
    servers that stay asleep."""
    sleepers = book.sleeping(node)
    if not sleepers:
        return want, set()
    fate = sleepers_under(want, book.recorded(node), sleepers)
    left = list(fate.keep)
    if fate.stop:
        sids = [server_id(s.deployment) for s in fate.stop]
        emit(node, f"stopping {', '.join(sids)} (asleep; the plan gives its GPUs to another)")
        agent.stop(sids, opts.stop_timeout_s)
        for s in fate.stop:
            d = s.deployment
            why = "asleep; the plan gives its GPUs to another server"
            outcomes.append(Outcome(node, "stop", "ok", d.model, d.gpu_indices, d.port, why))
    for s in fate.wake:
        d = s.deployment
        try:
            memory = opts.gpu_memory.get(node)
            if opts.dcgm_port is not None and memory is not None:
                check_room(d, opts.dcgm_port, wake_bytes(d, memory))
            wake(d)
        except SleepModeError as e:
            left.append(s)
            want = [w for w in want if w.args_hash != d.args_hash]
            why = f"asleep, and its wake failed: {e}"
            outcomes.append(Outcome(node, "wake", "failed", d.model, d.gpu_indices, d.port, why))
            continue
        emit(node, f"woke {d.model} on port {d.port}")
    if len(left) != len(sleepers):
        book.set_asleep(node, left)
    return want, {s.deployment.args_hash for s in left}


def _wait(
    node: str,
    agent: NodeAgent,
    waiting: dict[str, Step],
    opts: ApplyOptions,
    emit: Emit,
    began: dict[str, float] | None = None,
) -> tuple[dict[str, tuple[Step, float | None]], dict[str, tuple[Step, str, str]]]:
    """Poll every started server until healthy, exited, or out of time. Each healthy one
    comes with its start-up seconds since `began` (None for one this apply did not start)."""
    began = began or {}
    healthy: dict[str, tuple[Step, float | None]] = {}
    failed: dict[str, tuple[Step, str, str]] = {}
    start = time.monotonic()
    last_check, last_why = start, {sid: "" for sid in waiting}
    pending = dict(waiting)
    while pending and not CANCEL.is_set():
        for sid, st in list(pending.items()):
            assert st.deployment is not None
            ok, why = ready(st.deployment, opts.api_key)
            last_why[sid] = why
            if ok:
                now = time.monotonic()
                took = now - began[sid] if sid in began else None
                healthy[sid] = (pending.pop(sid), took)
                emit(
                    node,
                    f"healthy: {st.deployment.model} on port {st.deployment.port} "
                    f"after {now - began.get(sid, start):.0f} s",
                )
        if not pending:
            break
        now = time.monotonic()
        if now - last_check >= 2.0:  # a server that exited will never answer: say so early
            last_check = now
            for sid, alive in agent.alive(list(pending)).items():
                if not alive and sid in pending:
                    failed[sid] = (pending.pop(sid), "exited before it was healthy", "")
        if now - start > opts.health_timeout_s:
            for sid in list(pending):
                why = f"not healthy after {opts.health_timeout_s:g} s (last: {last_why[sid]})"
                failed[sid] = (pending.pop(sid), why, "")
        time.sleep(0.5)
    for sid, (st, why, _) in list(failed.items()):
        tail = agent.log_tail(sid, LOG_TAIL_LINES)
        failed[sid] = (st, why, tail)  # the report prints it with its log's tail
    if failed:
        agent.stop(list(failed), opts.stop_timeout_s)
    return healthy, failed


def _unreachable(e: NodeError) -> str:
    """Why a node's servers failed when the node could not be reached: kind, address, what
    to do (the report puts the node and each server before it)."""
    where = f" ({e.where})" if e.where else ""
    return f"{e.kind}{where}: {e.detail}"


def _gpus(d: Deployment) -> str:
    return ",".join(map(str, d.gpu_indices))


def _outcome(st: Step, status: Literal["ok", "failed"], detail: str, tail: str = "") -> Outcome:
    d = st.deployment
    assert d is not None
    return Outcome(st.node, st.kind, status, d.model, d.gpu_indices, d.port, detail, tail)


# --- destroy -----------------------------------------------------------------------------------


def destroy_fleet(
    inv: Inventory,
    book: StateBook,
    opts: ApplyOptions,
    emit: Emit = _nothing,
    started: Started = _nothing,
    done: Done = _nothing,
) -> list[Outcome]:
    """Stop every server fleetctl started on the inventory's nodes and those state names,
    asleep ones too."""
    recorded = [d for n in list(book.by_node) for d in book.recorded(n)]
    recorded += [s.deployment for n in list(book.asleep) for s in book.sleeping(n)]
    targets = node_targets(inv, recorded)

    def one(name: str) -> list[Outcome]:
        try:
            with SshSession(targets[name], opts.ssh) as session:
                agent = NodeAgent(session, opts.vllm_command, opts.ssh.command_timeout_s)
                sids = [s.sid for s in agent.inspect()]
                if sids:
                    emit(name, f"stopping {', '.join(sids)}")
                agent.stop(sids, opts.stop_timeout_s)
                left = agent.inspect()
        except NodeError as e:
            return [Outcome(name, "destroy", "failed", detail=_unreachable(e))]
        if left:
            return [Outcome(name, "destroy", "failed", detail=f"still there: {left[0].sid}")]
        book.set_node(name, [])
        if book.sleeping(name):
            book.set_asleep(name, [])
        return [Outcome(name, "destroy", "ok", detail=f"stopped {plural(len(sids), 'server')}")]

    return _each_node(sorted(targets, key=natural_key), opts.parallel, one, started, done)
