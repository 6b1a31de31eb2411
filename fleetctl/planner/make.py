"""A fleet's plan from everything fleetctl knows of it: probed facts over the inventory's GPUs,
the state folder's calibration, and, for the cost objective, each model's SLO checked by the
simulator (whatif/slo_check.py); what `plan` and `apply` run."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

from fleetctl.fleet.facts import apply_facts
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Plan
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.catalog import Catalog
from fleetctl.planner import plan_fleet
from fleetctl.sim.workload import WorkItem


def plan_with_facts(
    inv: Inventory,
    catalog: Catalog,
    sdir: StateDir,
    facts: Path | None,
    state: State,
    calibrated: bool = True,
    traces: Mapping[str, Sequence[WorkItem]] | None = None,
) -> Plan:
    """The plan, with probed GPUs over declared ones (--facts, else the saved facts when there
    are any); each disagreement leads the warnings. With `calibrated`, the state folder's
    calibration (when there is one) replaces the model's KV and speed where it matches.
    A cost plan is checked by the simulator against each model's SLO, on its trace in
    `traces` or on synthetic traffic, and re-solved with more capacity where one is missed.
    `plan`, `apply` and whatever else plans a fleet plan through here."""
    found = sdir.load_facts(facts)
    notes: list[str] = []
    if found is not None:
        inv, notes = apply_facts(inv, found, catalog)
    calibration = sdir.load_calibration() if calibrated else None
    if inv.spec.planner.objective == "cost":
        # The simulator loads only for the objective that runs it: a throughput plan stays quick.
        from fleetctl.whatif.slo_check import plan_within_slos

        planned = inv
        result = plan_within_slos(
            inv,
            lambda headroom: plan_fleet(planned, state, calibration, headroom=headroom),
            traces,
            calibration,
        )
    else:
        result = plan_fleet(inv, state, calibration)
    return dataclasses.replace(result, warnings=(*notes, *result.warnings)) if notes else result
