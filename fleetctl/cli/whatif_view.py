"""`plan --what-if TRACE` and `apply --gate TRACE` on a terminal: the fleet as it runs beside
the candidate plan (fleetctl/whatif/compare.py), and the gate's verdict, as one table."""

from __future__ import annotations

from pathlib import Path

from rich.console import Group, RenderableType
from rich.text import Text

from fleetctl.base.tables import Col, Records
from fleetctl.whatif.compare import WhatIf
from fleetctl.whatif.predict import DEFAULT_POLICY, Verdict

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
    parts += [
        Text(f"SLO of {model}: {slo.describe()}", style="dim")
        for model, slo in w.slos.items()
        if slo is not None
    ]
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
