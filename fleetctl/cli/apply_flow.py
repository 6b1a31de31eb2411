"""How apply and destroy run for a person at a terminal: load, lock, confirm, run, report."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetctl.apply.credentials import load_secrets
from fleetctl.apply.execute import ApplyOptions, Outcome, StateBook, apply_fleet, destroy_fleet
from fleetctl.apply.lock import StateLock
from fleetctl.base import documents
from fleetctl.base.documents import DocumentError
from fleetctl.base.errors import Location, UserError, shown
from fleetctl.base.jsonout import print_json
from fleetctl.base.text import plural
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import PLAN_FORMAT, Deployment, Plan, SavedPlan
from fleetctl.fleet.slo import Slo, recorded_slos
from fleetctl.fleet.ssh import SshOptions
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir
from fleetctl.planner.diff import diff


@dataclass(frozen=True)
class Common:
    """What every command that talks to the nodes takes from the command line."""

    known_hosts: Path | None
    accept_new: bool
    timeout_s: float
    parallel: int
    state_dir: Path | None
    as_json: bool
    yes: bool


def options(
    inv: Inventory,
    c: Common,
    secrets_file: Path | None = None,
    needs: tuple[str, ...] | None = None,
) -> ApplyOptions:
    """What apply's machinery needs; `needs` narrows the secrets read to those a command uses
    (status only sends VLLM_API_KEY, destroy none), so it never asks for one it won't send."""
    a = inv.spec.apply
    names = a.secrets if needs is None else [n for n in a.secrets if n in needs]
    return ApplyOptions(
        ssh=SshOptions(c.known_hosts, c.accept_new, inv.spec.ssh.connect_timeout_s, c.timeout_s),
        parallel=c.parallel,
        vllm_command=a.vllm_command,
        supervisor=a.supervisor,
        health_timeout_s=a.health_timeout_s,
        stop_timeout_s=a.stop_timeout_s,
        secrets=load_secrets(names, secrets_file),
    )


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
        elif dict(d.server.env) != dict(model.spec.env):
            problem = "its environment differs from the inventory's"
        if problem:
            raise UserError(
                f"{problem}: this plan was not made from {inv.path}",
                where,
                "make a new plan with `fleetctl plan INVENTORY -o plan.json`",
            )


def confirm(question: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise UserError(
            "refusing to change the fleet without confirmation",
            None,
            "run it in a terminal, or pass --yes",
        )
    import typer

    return typer.confirm(question, default=False)


class NodeProgress:
    """Per-node event lines, and a bar of nodes done when the output is a terminal."""

    def __init__(self, console: Any, what: str, quiet: bool):
        self.console, self.what, self.quiet = console, what, quiet
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> NodeProgress:
        if not self.quiet and self.console.is_terminal:
            from rich.progress import Progress

            self.bar = Progress(console=self.console, transient=True)
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def started(self, nodes: int) -> None:
        if self.bar is not None:
            self.task = self.bar.add_task(self.what, total=nodes)

    def done(self, node: str) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.advance(self.task)

    def emit(self, node: str, msg: str) -> None:
        if not self.quiet:
            self.console.print(f"[bold]{node}[/]: {msg}", highlight=False)


def run_apply(
    inv: Inventory,
    c: Common,
    make_plan: Any,
    plan_file: tuple[Path, int | None, list[Deployment], dict[str, Slo]] | None,
    secrets_file: Path | None,
    console: Any,
    after: Callable[[], tuple[dict[str, Any], list[str]]] | None = None,
    gate: Callable[[list[Deployment], list[Deployment]], tuple[str | None, dict[str, Any], Any]]
    | None = None,
) -> int:
    """Plan (or read the plan), show it, confirm, carry it out; then, when nothing failed,
    `after` (its JSON fields and text lines join the report). Returns the exit code.

    `gate(running, planned)`, before anything is confirmed: why it refuses the plan (None:
    it passes), its JSON fields and what to show; a refusal ends the apply with exit 1."""
    sdir = StateDir.of(inv, c.state_dir)
    opts = options(inv, c, secrets_file)  # bad secrets fail before anything is locked
    with StateLock(sdir, "apply") as lock:
        state = sdir.load_state()
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
            plan: Plan | None = None
        else:
            plan = make_plan(state)
            deployments, actions = list(plan.deployments), list(plan.actions)
            slos = plan.slos
        note = lock.stale_note()
        disruption = _disruption(inv, sdir, deployments, state)
        if not c.as_json:
            from fleetctl.cli.render import render_plan, summary_line

            if note:
                console.print(f"[yellow]warning:[/] {note}")
            console.print(render_plan(plan) if plan is not None else summary_line(actions))
            if disruption.line():
                console.print(disruption.line(), highlight=False)
        fields: dict[str, Any] = {}
        if gate is not None:
            refused, fields, shown_ = gate(list(state.deployments), deployments)
            if not c.as_json:
                console.print(shown_)
            if refused is not None:
                if c.as_json:
                    print_json({"ok": False, **fields})
                sys.stderr.write(f"apply refused by --gate: {refused}\n")
                return 1
        fields = {**fields, "disruption": disruption.to_json()}
        changes = [a for a in actions if a.op != "keep"]
        if changes and not confirm(f"Apply {plural(len(changes), 'change')}?", c.yes):
            console.print("Nothing changed.")
            return 0
        if not changes and not c.as_json:
            console.print("No changes planned; checking the nodes for drift.")
        # The SLO the plan was made by is kept beside its servers: route-serve judges by it.
        book = StateBook(sdir, dataclasses.replace(state, slo=slos))
        book.record_slo(state)
        try:
            with NodeProgress(console, "applying", c.as_json) as p:
                outcomes = apply_fleet(inv, deployments, book, opts, p.emit, p.started, p.done)
            _record_startups(sdir, inv, deployments, outcomes, console, c.as_json)
        except KeyboardInterrupt:
            sys.stderr.write(
                "interrupted: servers that were starting keep running and the state records "
                "what was confirmed; run apply again to adopt or replace them\n"
            )
            return 130
    return report(outcomes, book, c, console, "apply", after, fields)


def _disruption(inv: Inventory, sdir: StateDir, deployments: list[Deployment], state: State) -> Any:
    """What the plan costs the running fleet in warm-up (fleetctl/apply/warmup.py); the start-ups
    measured so far, when the calibration file can be read."""
    from fleetctl.apply.warmup import for_plan

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
    console: Any,
    quiet: bool,
) -> None:
    """Each server's measured start-up joins the calibration (warm-up: fleetctl/apply/warmup.py);
    a calibration file that cannot be read or written is a warning, not a failed apply."""
    from fleetctl.apply.warmup import record_startups

    try:
        record_startups(sdir, inv, deployments, outcomes)
    except (UserError, OSError) as e:
        if not quiet:
            console.print(f"[yellow]warning:[/] start-up times not recorded: {e}")


def run_destroy(inv: Inventory, c: Common, console: Any) -> int:
    sdir = StateDir.of(inv, c.state_dir)
    opts = options(inv, c, needs=())
    with StateLock(sdir, "destroy"):
        state = sdir.load_state()
        n = len(state.deployments)
        question = (
            f"Stop {plural(n, 'recorded server')} and anything else fleetctl started on "
            f"{plural(len(inv.nodes), 'node')}?"
        )
        if not confirm(question, c.yes):
            console.print("Nothing changed.")
            return 0
        book = StateBook(sdir, state)
        with NodeProgress(console, "destroying", c.as_json) as p:
            outcomes = destroy_fleet(inv, book, opts, p.emit, p.started, p.done)
    return report(outcomes, book, c, console, "destroy")


PAST = {
    "start": "started",
    "restart": "restarted",
    "replace": "replaced",
    "adopt": "adopted",
    "keep": "unchanged",
    "stop": "stopped",
    "destroy": "nodes cleaned",
}


def report(
    outcomes: list[Outcome],
    book: StateBook,
    c: Common,
    console: Any,
    what: str,
    after: Callable[[], tuple[dict[str, Any], list[str]]] | None = None,
    extra: dict[str, Any] | None = None,
) -> int:
    failed = [o for o in outcomes if o.status == "failed"]
    fields, lines = after() if after is not None and not failed else ({}, [])
    if c.as_json:
        doc = {
            "ok": not failed,
            "state_serial": book.serial,
            "outcomes": [o.to_json() for o in outcomes],
            **(extra or {}),
            **fields,
        }
        print_json(doc)
    else:
        console.print(summary(what, outcomes, book.serial), highlight=False)
        for o in failed:
            print_failure(console, o)
        for line in lines:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    return 1 if failed else 0


def summary(what: str, outcomes: list[Outcome], serial: int) -> str:
    """`apply: 2 started, 1 unchanged; 1 failed. State serial 7.`; "nothing to do" only when
    nothing was to be done, not when everything failed."""
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.status == "ok":
            counts[o.action] = counts.get(o.action, 0) + 1
    failed = sum(o.status == "failed" for o in outcomes)
    done = ", ".join(f"{n} {PAST[k]}" for k, n in sorted(counts.items()))
    if not done:
        done = "0 done" if failed else "nothing to do"
    return f"{what}: {done}; {failed} failed. State serial {serial}."


def print_failure(console: Any, o: Outcome) -> None:
    """One line per failed server (or node): node, server, why; then its log's last lines.
    The only place a failure is printed: apply and destroy do not emit them as they happen."""
    from rich.markup import escape

    server = f" {o.model} GPUs {','.join(map(str, o.gpus))}" if o.model else ""
    console.print(f"[red]failed[/] {escape(o.node + server)}: {escape(o.detail)}", highlight=False)
    if o.log_tail.strip():
        console.print("    the last lines of its log:", highlight=False)
        tail = "\n".join("    " + line for line in o.log_tail.rstrip().splitlines())
        console.print(tail, markup=False, highlight=False, soft_wrap=True)
