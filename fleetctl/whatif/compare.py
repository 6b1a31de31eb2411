"""What runs now beside a candidate plan, both simulated on the same trace (`plan --what-if`,
`apply --gate`), and the gate's verdict on them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.model.calibration import Calibration
from fleetctl.routing.goodput import Slo
from fleetctl.sim.workload import WorkItem
from fleetctl.whatif.predict import DEFAULT_POLICY, Figures, Verdict, judge, judged_by, what_if


@dataclass(frozen=True)
class WhatIf:
    trace: Path
    current: Figures
    candidate: Figures
    # Per model, the SLO both sides' attainment is judged by (None: no server could hold it).
    slos: Mapping[str, Slo | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "trace": str(self.trace),
            "policy": DEFAULT_POLICY,
            "requests": self.current.requests,
            "slo": {m: None if s is None else s.to_json() for m, s in self.slos.items()},
            "current": self.current.to_json(),
            "candidate": self.candidate.to_json(),
            "notes": {"current": list(self.current.notes), "candidate": list(self.candidate.notes)},
        }


def compare(
    inv: Inventory,
    current: Sequence[Deployment],
    candidate: Sequence[Deployment],
    trace: Path,
    traffic: dict[str, list[WorkItem]],
    calibration: Calibration | None = None,
    show_progress: bool = False,
    recorded: Mapping[str, Slo] | None = None,
) -> WhatIf:
    """The state's deployments and the plan's on the same requests (a bar on a terminal),
    both judged by the SLO in force: the inventory's, else the one the applied plan was made
    by (`recorded`, state.json's), else the one derived from this traffic (`judged_by`)."""
    from fleetctl.base.progress import progress

    slos = judged_by(inv, traffic, recorded or {}, calibration)

    now, plan = "what-if: simulating what runs now", "what-if: simulating the plan"
    with progress(now, 2, enabled=show_progress) as bar:
        running = what_if(
            inv,
            current,
            traffic,
            calibration=calibration,
            progress=lambda f: bar.update(f, now),
            slos=slos,
        )
        bar.update(1, plan)
        planned = what_if(
            inv,
            candidate,
            traffic,
            calibration=calibration,
            progress=lambda f: bar.update(1 + f, plan),
            slos=slos,
        )
    return WhatIf(trace, running, planned, slos)


def gate_verdict(inv: Inventory, w: WhatIf) -> Verdict:
    g = inv.spec.apply.gate
    return judge(w.current, w.candidate, g.max_ttft_p99_rise, g.max_slo_drop, g.max_tpot_p99_rise)
