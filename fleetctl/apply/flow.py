"""An apply or a destroy from start to end, for whoever drives it (the command line, the
autopilot): a saved plan read and checked, the state locked, the plan made against it, gated,
confirmed, carried out, its start-ups recorded. What is shown and asked is the driver's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple, Protocol

from fleetctl.apply.book import StateBook
from fleetctl.apply.credentials import load_secrets
from fleetctl.apply.execute import ApplyOptions, Outcome, apply_fleet, destroy_fleet
from fleetctl.apply.gate import Gate, GateResult
from fleetctl.apply.lock import StateLock
from fleetctl.apply.warmup import Disruption, for_plan, record_startups
from fleetctl.base import documents
from fleetctl.base.documents import DocumentError
from fleetctl.base.errors import Location, UserError, shown
from fleetctl.base.text import plural
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import PLAN_FORMAT, Action, Deployment, Plan, SavedPlan
from fleetctl.fleet.slo import Slo, recorded_slos
from fleetctl.fleet.ssh import SshOptions
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir
from fleetctl.planner import lora
from fleetctl.planner.diff import diff


@dataclass(frozen=True)
class Access:
    """How the nodes are reached and where their state is kept."""

    known_hosts: Path | None
    accept_new: bool
    timeout_s: float
    parallel: int
    state_dir: Path | None


def options(
    inv: Inventory,
    access: Access,
    secrets_file: Path | None = None,
    needs: tuple[str, ...] | None = None,
) -> ApplyOptions:
    """What apply's machinery needs; `needs` narrows the secrets read to those a command uses
    (status only sends VLLM_API_KEY, destroy none), so it never asks for one it won't send."""
    a = inv.spec.apply
    names = a.secrets if needs is None else [n for n in a.secrets if n in needs]
    return ApplyOptions(
        ssh=SshOptions(
            access.known_hosts, access.accept_new, inv.spec.ssh.connect_timeout_s, access.timeout_s
        ),
        parallel=access.parallel,
        vllm_command=a.vllm_command,
        supervisor=a.supervisor,
        health_timeout_s=a.health_timeout_s,
        stop_timeout_s=a.stop_timeout_s,
        secrets=load_secrets(names, secrets_file),
        dcgm_port=inv.spec.router.dcgm_exporter_port,
        gpu_memory={n.name: n.gpu.memory_bytes for n in inv.nodes},
    )


class PlanFile(NamedTuple):
    """A plan saved by `plan -o`: where, the state serial it was made against, its servers,
    and each model's SLO as planned."""

    path: Path
    serial: int | None
    deployments: list[Deployment]
    slos: dict[str, Slo]


def is_plan_file(arg: str) -> bool:
    return arg.endswith(".json")


def read_plan_file(path: Path) -> tuple[str, int | None, list[Deployment], dict[str, Slo]]:
    """(inventory path, state serial it was made against, deployments, each model's SLO as
    planned) of a saved plan."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}", None, "check the path") from None
    try:
        saved = documents.load(text, SavedPlan, reads=(PLAN_FORMAT,), default_format=PLAN_FORMAT)
    except DocumentError as e:
        raise UserError(
            f"not a plan fleetctl wrote: {e}",
            Location(str(path)),
            "make one with `fleetctl plan INVENTORY -o plan.json`",
        ) from None
    slos = recorded_slos(saved.slo, f"the plan {path.name}")
    return saved.inventory, saved.state_serial, [Deployment.of(r) for r in saved.deployments], slos


def check_saved_plan(path: Path, deployments: list[Deployment], inv: Inventory) -> None:
    """A saved plan is a file anyone could have edited: each server in it must be one the
    inventory could have planned (its node, host, model, source and environment), before
    anything reaches a node. Its ports, GPU indices, names and arguments were checked as it
    was read (DeploymentRecord's schema)."""
    nodes = {n.name: n for n in inv.nodes}
    models = {m.name: m for m in inv.models}
    for i, d in enumerate(deployments):
        where = Location(str(path), None, f"deployments[{i}]")
        node, model = nodes.get(d.node), models.get(d.model)
        problem = None
        if node is None or node.host != d.host:
            problem = f"node {shown(d.node)} at {shown(d.host)} is not in the inventory"
        elif model is None or d.server.source not in {v.source for v in model.variants}:
            problem = f"model {shown(d.model)} with its source is not in the inventory"
        elif dict(d.server.env) != {**model.spec.env, **lora.env_of(model, d.gpu_type)}:
            problem = "its environment differs from the inventory's"
        if problem:
            raise UserError(
                f"{problem}: this plan was not made from {inv.path}",
                where,
                "make a new plan with `fleetctl plan INVENTORY -o plan.json`",
            )


@dataclass(frozen=True)
class Proposal:
    """What an apply is about to do, before it is gated and confirmed."""

    plan: Plan | None  # None: a saved plan, carried out as it was read
    deployments: list[Deployment]
    actions: list[Action]
    disruption: Disruption
    stale_lock: str | None  # a lock left by a process that is gone, taken over

    @property
    def changes(self) -> list[Action]:
        return [a for a in self.actions if a.op != "keep"]


class NodeEvents(Protocol):
    """Progress while the nodes are worked on (apply_fleet's emit, started and done)."""

    def emit(self, node: str, msg: str) -> None: ...

    def started(self, nodes: int) -> None: ...

    def done(self, node: str) -> None: ...


class Driver(Protocol):
    """What the one who runs an apply or a destroy sees and decides; each is called with the
    state locked."""

    def proposed(self, proposal: Proposal) -> None: ...

    def gated(self, result: GateResult) -> None: ...

    def confirm(self, question: str) -> bool:
        """Whether to go on (not asked of an apply that changes nothing: it checks the nodes
        for drift, starting only what is missing)."""
        ...

    def progress(self, what: str) -> AbstractContextManager[NodeEvents]: ...

    def warn(self, msg: str) -> None: ...


Ended = Literal["done", "refused", "declined", "interrupted"]


@dataclass(frozen=True)
class Run:
    """How an apply or a destroy ended: `done` (the nodes were worked on; each outcome says
    how), `refused` by the gate, `declined` at the confirmation, or `interrupted`."""

    ended: Ended
    proposal: Proposal | None = None
    gate: GateResult | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    serial: int = 0  # the state's serial after it


def apply_plan(
    inv: Inventory,
    sdir: StateDir,
    opts: ApplyOptions,
    make_plan: Callable[[State], Plan],
    plan_file: PlanFile | None,
    driver: Driver,
    gate: Gate | None = None,
) -> Run:
    """Lock the state, plan against it (or take the saved plan, if the state has not changed
    since it was made), gate it, confirm it, make the nodes run it, record the start-ups."""
    with StateLock(sdir, "apply") as lock:
        state = sdir.load_state()
        plan: Plan | None = None
        if plan_file is not None:
            path, serial, deployments, slos = plan_file
            if serial != state.serial:
                raise UserError(
                    f"the state changed since this plan was made (serial {serial}, now "
                    f"{state.serial})",
                    Location(str(path)),
                    "make a new plan with `fleetctl plan INVENTORY -o plan.json`",
                )
            actions = list(diff(deployments, state.deployments))
        else:
            plan = make_plan(state)
            deployments, actions = list(plan.deployments), list(plan.actions)
            slos = plan.slos
        disruption = _disruption(inv, sdir, deployments, state)
        proposal = Proposal(plan, deployments, actions, disruption, lock.stale_note())
        driver.proposed(proposal)
        checked = None
        if gate is not None:
            checked = gate(list(state.deployments), deployments, state.slo)
            driver.gated(checked)
            if checked.refused is not None:
                return Run("refused", proposal, checked, serial=state.serial)
        changes = proposal.changes
        if changes and not driver.confirm(f"Apply {plural(len(changes), 'change')}?"):
            return Run("declined", proposal, checked, serial=state.serial)
        # The SLO the plan was made by is kept beside its servers: route-serve judges by it.
        book = StateBook(sdir, dataclasses.replace(state, slo=slos))
        book.record_slo(state)
        try:
            with driver.progress("applying") as p:
                outcomes = apply_fleet(inv, deployments, book, opts, p.emit, p.started, p.done)
            _record_startups(sdir, inv, deployments, outcomes, driver)
        except KeyboardInterrupt:
            return Run("interrupted", proposal, checked, serial=book.serial)
    return Run("done", proposal, checked, outcomes, book.serial)


def destroy(inv: Inventory, sdir: StateDir, opts: ApplyOptions, driver: Driver) -> Run:
    """Lock the state, confirm, stop every server fleetctl started on the inventory's nodes."""
    with StateLock(sdir, "destroy"):
        state = sdir.load_state()
        n = len(state.deployments)
        question = (
            f"Stop {plural(n, 'recorded server')} and anything else fleetctl started on "
            f"{plural(len(inv.nodes), 'node')}?"
        )
        if not driver.confirm(question):
            return Run("declined", serial=state.serial)
        book = StateBook(sdir, state)
        with driver.progress("destroying") as p:
            outcomes = destroy_fleet(inv, book, opts, p.emit, p.started, p.done)
    return Run("done", outcomes=outcomes, serial=book.serial)


def _disruption(
    inv: Inventory, sdir: StateDir, deployments: Sequence[Deployment], state: State
) -> Disruption:
    """What the plan costs the running fleet in warm-up (fleetctl/apply/warmup.py); the start-ups
    measured so far, when the calibration file can be read."""
    try:
        cal = sdir.load_calibration()
    except UserError:
        cal = None
    return for_plan(inv, deployments, state, cal)


def _record_startups(
    sdir: StateDir,
    inv: Inventory,
    deployments: list[Deployment],
    outcomes: list[Outcome],
    driver: Driver,
) -> None:
    """Each server's measured start-up joins the calibration (warm-up: fleetctl/apply/warmup.py);
    a calibration file that cannot be read or written is a warning, not a failed apply."""
    try:
        record_startups(sdir, inv, deployments, outcomes)
    except (UserError, OSError) as e:
        driver.warn(f"start-up times not recorded: {e}")
