"""How apply and destroy run for a person at a terminal: what they show, the confirmation, the
report; the run itself is fleetctl/apply/flow.py's."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetctl.apply.execute import Outcome
from fleetctl.apply.flow import Access, PlanFile, Proposal, apply_plan, destroy, options
from fleetctl.apply.gate import Gate, GateResult
from fleetctl.base.errors import UserError
from fleetctl.base.jsonout import print_json
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Plan
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir


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

    def access(self) -> Access:
        return Access(
            self.known_hosts, self.accept_new, self.timeout_s, self.parallel, self.state_dir
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


class Terminal:
    """apply and destroy at a terminal (or piped, with --json): what fleetctl/apply/flow.py
    shows and asks, printed and asked here."""

    def __init__(self, c: Common, console: Any) -> None:
        self.c, self.console = c, console
        self.unchanged = False

    def proposed(self, p: Proposal) -> None:
        self.unchanged = not p.changes
        if self.c.as_json:
            return
        from fleetctl.cli.render import render_plan, summary_line

        if p.stale_lock:
            self.console.print(f"[yellow]warning:[/] {p.stale_lock}")
        self.console.print(render_plan(p.plan) if p.plan is not None else summary_line(p.actions))
        if p.disruption.line():
            self.console.print(p.disruption.line(), highlight=False)

    def gated(self, result: GateResult) -> None:
        if self.c.as_json:
            return
        from rich.console import Group

        from fleetctl.cli.whatif_view import render

        shown: list[Any] = [render(result.what_if, result.verdict)]
        if result.forced:
            shown.append("gate: --force: applying anyway")
        self.console.print(Group(*shown))

    def confirm(self, question: str) -> bool:
        if confirm(question, self.c.yes):
            return True
        self.console.print("Nothing changed.")
        return False

    def progress(self, what: str) -> NodeProgress:
        if self.unchanged and what == "applying" and not self.c.as_json:
            self.console.print("No changes planned; checking the nodes for drift.")
        return NodeProgress(self.console, what, self.c.as_json)

    def warn(self, msg: str) -> None:
        if not self.c.as_json:
            self.console.print(f"[yellow]warning:[/] {msg}")


def run_apply(
    inv: Inventory,
    c: Common,
    make_plan: Callable[[State], Plan],
    plan_file: PlanFile | None,
    secrets_file: Path | None,
    console: Any,
    after: Callable[[], tuple[dict[str, Any], list[str]]] | None = None,
    gate: Gate | None = None,
) -> int:
    """Plan (or read the plan), show it, confirm, carry it out; then, when nothing failed,
    `after` (its JSON fields and text lines join the report). Returns the exit code.

    `gate(running, planned, the SLOs state.json recorded)`, before anything is confirmed: a
    refusal ends the apply with exit 1."""
    sdir = StateDir.of(inv, c.state_dir)
    opts = options(inv, c.access(), secrets_file)  # bad secrets fail before anything is locked
    run = apply_plan(inv, sdir, opts, make_plan, plan_file, Terminal(c, console), gate)
    if run.ended == "refused":
        assert run.gate is not None and run.gate.refused is not None
        if c.as_json:
            print_json({"ok": False, **run.gate.to_json()})
        sys.stderr.write(
            f"apply refused by --gate: {run.gate.refused} (pass --force to apply anyway)\n"
        )
        return 1
    if run.ended == "declined":
        return 0
    if run.ended == "interrupted":
        sys.stderr.write(
            "interrupted: servers that were starting keep running and the state records "
            "what was confirmed; run apply again to adopt or replace them\n"
        )
        return 130
    assert run.proposal is not None
    fields = {
        **(run.gate.to_json() if run.gate is not None else {}),
        "disruption": run.proposal.disruption.to_json(),
    }
    return report(run.outcomes, run.serial, c, console, "apply", after, fields)


def run_destroy(inv: Inventory, c: Common, console: Any) -> int:
    sdir = StateDir.of(inv, c.state_dir)
    opts = options(inv, c.access(), needs=())
    run = destroy(inv, sdir, opts, Terminal(c, console))
    if run.ended == "declined":
        return 0
    return report(run.outcomes, run.serial, c, console, "destroy")


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
    serial: int,
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
            "state_serial": serial,
            "outcomes": [o.to_json() for o in outcomes],
            **(extra or {}),
            **fields,
        }
        print_json(doc)
    else:
        console.print(summary(what, outcomes, serial), highlight=False)
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
