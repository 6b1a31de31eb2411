"""`plan --what-if TRACE` and `apply --gate TRACE`: the fleet as it runs beside the candidate
plan, both simulated on the same trace, and the gate's verdict on them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from fleetctl.base.tables import Col, Records
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.sim.workload import WorkItem
from fleetctl.whatif.predict import DEFAULT_POLICY, Figures, Verdict, judge, what_if


def load_traffic(inv: Inventory, path: Path) -> dict[str, list[WorkItem]]:
    """Each inventory model's requests in the trace at `path`, at the trace's own times."""
    from fleetctl.cli.traffic import traces_from

    return traces_from(inv, path)


@dataclass(frozen=True)
class WhatIf:
    trace: Path
    current: Figures
    candidate: Figures

    def to_json(self) -> dict[str, Any]:
        return {
            "trace": str(self.trace),
            "policy": DEFAULT_POLICY,
            "requests": self.current.requests,
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
    calibration: Any = None,
    show_progress: bool = False,
) -> WhatIf:
    """The state's deployments and the plan's on the same requests (a bar on a terminal)."""
    from fleetctl.base.progress import progress

    now, plan = "what-if: simulating what runs now", "what-if: simulating the plan"
    with progress(now, 2, enabled=show_progress) as bar:
        running = what_if(
            inv, current, traffic, calibration=calibration, progress=lambda f: bar.update(f, now)
        )
        bar.update(1, plan)
        planned = what_if(
            inv,
            candidate,
            traffic,
            calibration=calibration,
            progress=lambda f: bar.update(1 + f, plan),
        )
    return WhatIf(trace, running, planned)


# (label, key, format): the rows of the side-by-side table.
ROWS = [
    ("TTFT p50", "ttft_p50_s", "s"),
    ("TTFT p99", "ttft_p99_s", "s"),
    ("TPOT p50", "tpot_p50_ms", "ms"),
    ("TPOT p99", "tpot_p99_ms", "ms"),
    ("e2e p99", "e2e_p99_s", "s"),
    ("SLO attainment", "slo_attainment", "%"),
    ("GPUs", "gpus", "n"),
    ("cost, $/h", "cost_per_hour", "$"),
    ("cost, $ per million output tokens on this trace", "cost_per_million_output_tokens", "$"),
]


def _cell(v: float | int | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v:,.3f} s"
    if unit == "ms":
        return f"{v:,.1f} ms"
    if unit == "%":
        return f"{v:.1%}"
    if unit == "$":
        return f"${v:,.2f}"
    return f"{v:,}"


def _change(a: float | int | None, b: float | int | None, unit: str) -> str:
    if a is None or b is None:
        return ""
    if unit == "%":
        return f"{(b - a) * 100:+.1f} pts"
    if unit == "n":
        return f"{b - a:+,}" if b != a else ""
    return f"{b / a - 1:+.0%}" if a else ""


def render(w: WhatIf, verdict: Verdict | None = None) -> RenderableType:
    """The comparison table, what it rests on, and the gate's verdict when there is one."""
    cur, cand = w.current.to_json(), w.candidate.to_json()
    rows = [
        [label, _cell(cur[k], u), _cell(cand[k], u), _change(cur[k], cand[k], u)]
        for label, k, u in ROWS
    ]
    table = Records(
        f"What if: {w.current.requests:,} requests from {_trace_name(w.trace)}, at the trace's "
        f"own times, routed {DEFAULT_POLICY}",
        [
            Col("", head=True),
            Col("now", numeric=True),
            Col("plan", numeric=True),
            Col("change", numeric=True),
        ],
        rows,
        caption="SLO attainment: requests that finished within their model's TTFT and TPOT "
        "objectives; '-': unknown (no price, no request finished, nothing runs)",
    )
    parts: list[RenderableType] = [table]
    for side, f in (("now", w.current), ("plan", w.candidate)):
        parts += [Text(f"{side}: {n}") for n in f.notes]
    if verdict is not None:
        parts += [Text(f"gate: {n}") for n in verdict.notes]
        if verdict.passed:
            parts.append(Text("gate: passed", style="green"))
        else:
            parts += [Text(f"gate: refused: {r}", style="red") for r in verdict.reasons]
    return Group(*parts)


def _trace_name(path: Path) -> str:
    """The trace as a quoted name, a folder with its slash: route-serve's log folder is
    called `requests`, and "197 requests of requests" read as a doubled word."""
    return f"'{path.name}/'" if path.is_dir() else f"'{path.name}'"


def gate_verdict(inv: Inventory, w: WhatIf) -> Verdict:
    g = inv.spec.apply.gate
    return judge(w.current, w.candidate, g.max_ttft_p99_rise, g.max_slo_drop, g.max_tpot_p99_rise)
