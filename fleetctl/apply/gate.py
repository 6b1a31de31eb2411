"""The gate before an apply: what runs now and the plan simulated on a trace, and whether the
plan is worse than `apply.gate`'s thresholds allow."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.fleet.statedir import StateDir
from fleetctl.routing.goodput import Slo
from fleetctl.whatif.compare import WhatIf, compare, gate_verdict
from fleetctl.whatif.predict import Verdict


@dataclass(frozen=True)
class GateResult:
    """The gate's figures, its verdict, and whether a refusal was overridden."""

    what_if: WhatIf
    verdict: Verdict
    forced: bool  # the verdict refused the plan and the caller applies it anyway

    @property
    def refused(self) -> str | None:
        """Why the apply stops here (the verdict's reasons); None: it goes on."""
        if self.verdict.passed or self.forced:
            return None
        return "; ".join(self.verdict.reasons)

    def to_json(self) -> dict[str, Any]:
        return {
            "what_if": self.what_if.to_json(),
            "gate": {**self.verdict.to_json(), "forced": self.forced},
        }


# (what runs now, the plan's deployments, the SLOs state.json recorded) -> the gate's result,
# run with the state locked.
Gate = Callable[[Sequence[Deployment], Sequence[Deployment], Mapping[str, Slo]], GateResult]


def trace_gate(
    inv: Inventory, sdir: StateDir, trace: Path, force: bool, calibrated: bool, show: bool
) -> Gate:
    """The gate on `trace`: the trace is read now (a bad one fails before anything is locked);
    the comparison runs once the plan is made, against the state apply holds locked. `force`:
    a refusal is recorded but does not stop the apply; `show`: a progress bar on a terminal."""
    from fleetctl.sim.traffic import traces_from

    traffic = traces_from(inv, trace)

    def gate(
        running: Sequence[Deployment], planned: Sequence[Deployment], recorded: Mapping[str, Slo]
    ) -> GateResult:
        calibration = sdir.load_calibration() if calibrated else None
        w = compare(inv, running, planned, trace, traffic, calibration, show, recorded)
        verdict = gate_verdict(inv, w)
        return GateResult(w, verdict, forced=force and not verdict.passed)

    return gate
