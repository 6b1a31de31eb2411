"""apply's flow without the command line (fleetctl/apply/flow.py): a driver other than the
terminal is shown the proposal and the gate's typed result, decides, and gets the run back.
SSH goes to a loopback port nobody listens on, so a run past the gate fails at once."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from fleetctl.apply.flow import Access, NodeEvents, Proposal, apply_plan, options
from fleetctl.apply.gate import GateResult, trace_gate
from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.catalog import load_catalog
from fleetctl.planner.make import plan_with_facts
from tests.whatif.test_whatif import inventory, record_running, trace


class Quiet:
    def emit(self, node: str, msg: str) -> None:
        pass

    def started(self, nodes: int) -> None:
        pass

    def done(self, node: str) -> None:
        pass


class Recorder:
    """A driver that answers `yes` and notes each call, as the autopilot's will."""

    def __init__(self, yes: bool) -> None:
        self.yes = yes
        self.calls: list[str] = []
        self.proposal: Proposal | None = None
        self.gate: GateResult | None = None

    def proposed(self, proposal: Proposal) -> None:
        self.calls.append("proposed")
        self.proposal = proposal

    def gated(self, result: GateResult) -> None:
        self.calls.append("gated")
        self.gate = result

    def confirm(self, question: str) -> bool:
        self.calls.append(f"confirm: {question}")
        return self.yes

    def progress(self, what: str) -> AbstractContextManager[NodeEvents]:
        self.calls.append(what)
        return nullcontext(Quiet())

    def warn(self, msg: str) -> None:
        self.calls.append(f"warn: {msg}")


def test_a_driver_sees_the_plan_and_the_gates_verdict_and_decides(tmp_path):
    big = inventory(tmp_path, 4, name="big.yaml")
    small = inventory(tmp_path, 1)
    running = record_running(small, big)
    catalog = load_catalog()
    inv = load_inventory(small, catalog)
    sdir = StateDir.of(inv)
    opts = options(inv, Access(None, False, 60.0, 8, None))

    def make(state: State):  # the plan apply makes, against the state it holds locked
        return plan_with_facts(inv, catalog, sdir, None, state)

    t = trace(tmp_path)
    refusing = Recorder(yes=True)
    run = apply_plan(
        inv, sdir, opts, make, None, refusing, trace_gate(inv, sdir, t, False, True, False)
    )
    assert run.ended == "refused" and refusing.calls == ["proposed", "gated"]
    p = refusing.proposal
    assert p is not None and p.plan is not None and len(p.deployments) == 1
    assert {a.op for a in p.changes} >= {"delete"}  # three of the four servers go
    g = run.gate
    assert g is refusing.gate and isinstance(g, GateResult)
    assert not g.verdict.passed and not g.forced
    assert g.refused is not None and g.refused.startswith("p99 TTFT rises")
    assert g.what_if.current.gpus == 4 and g.what_if.candidate.gpus == 1
    assert g.to_json()["gate"] == {**g.verdict.to_json(), "forced": False}
    assert sdir.load_state().serial == running.serial  # nothing applied

    declining = Recorder(yes=False)
    run = apply_plan(inv, sdir, opts, make, None, declining)
    assert run.ended == "declined" and run.outcomes == []
    assert declining.calls == ["proposed", f"confirm: Apply {len(p.changes)} changes?"]

    forcing = Recorder(yes=True)
    run = apply_plan(
        inv, sdir, opts, make, None, forcing, trace_gate(inv, sdir, t, True, True, False)
    )
    assert run.ended == "done" and run.gate is not None
    assert run.gate.forced and run.gate.refused is None
    assert forcing.calls[:4] == [
        "proposed",
        "gated",
        f"confirm: Apply {len(p.changes)} changes?",
        "applying",
    ]
    assert run.outcomes and all(o.status == "failed" for o in run.outcomes)  # nobody listens
