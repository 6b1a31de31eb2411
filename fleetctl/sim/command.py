"""`fleetctl simulate`: workload in, one row of latency figures per policy out."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from fleetctl.base.errors import Location, UserError
from fleetctl.base.progress import progress
from fleetctl.base.tables import Cell, Col, Records
from fleetctl.base.text import plural
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.slo import planned_unless_stated
from fleetctl.model.calibration import Calibration
from fleetctl.planner.candidates import model_slo
from fleetctl.routing.goodput import Slo
from fleetctl.routing.registry import policy_names
from fleetctl.routing.scheduler import Aging
from fleetctl.sim.capacity import search_capacity
from fleetctl.sim.compare import Comparison, compare
from fleetctl.sim.fleet import Server, rejected_reasons
from fleetctl.sim.multi import FleetRun, run_models, trace_by_model
from fleetctl.sim.workload import (
    Synthetic,
    WorkItem,
    derive_workload,
    load_trace,
    parse_spec,
    workload_spec,
)


def run_simulate(
    inv: Inventory,
    workload: str | None,
    trace: Path | None,
    policies: str,
    load: float | None,
    model: str | None,
    limit: int | None,
    seed: int,
    no_aging: bool,
    plot: Path | None,
    show_progress: bool,
    calibrated: bool = True,
    window: str | None = None,
    *,
    rate: float | None = None,
    slo: str | None = None,
    capacity: bool = False,
) -> tuple[dict[str, Any], RenderableType]:
    """Simulate `inv`'s plan under each policy; with `calibrated`, the state folder's
    calibration gives the servers of its classes their measured KV and speed, and says so.
    `rate` (requests/s) or `load` (share of capacity) rescales the arrivals; `slo`
    (`TTFT_S,TPOT_MS`) replaces the model's objectives for the run. With `capacity`, the
    rate is searched instead: the plan's goodput rate on the traffic (sim/capacity.py)."""
    from fleetctl.fleet.statedir import StateDir
    from fleetctl.planner import plan_fleet

    every_model = model is None and len(inv.models) > 1 and trace is not None
    if plot is not None:
        if every_model:
            check_day_plot(plot)
        else:
            require_matplotlib()
    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in policy_names()]
    if unknown:
        raise UserError(
            f"unknown policy '{unknown[0]}'", None, f"choose from {', '.join(policy_names())}"
        )
    if (workload is None) == (trace is None):
        raise UserError("give exactly one of --workload and --trace", None, "see --help")
    if load is not None and rate is not None:
        raise UserError("give at most one of --load and --rate", None, "drop one of them")
    if capacity and (load is not None or rate is not None):
        raise UserError(
            "--capacity searches the rate itself", None, "drop --load and --rate, or --capacity"
        )
    for flag, value in (("--load", load), ("--rate", rate)):
        if value is not None and not (0 < value < math.inf):
            raise UserError(f"{flag} must be a positive number, got {value:g}", None, "see --help")
    objectives = parse_slo(slo) if slo is not None else None
    if every_model:
        assert trace is not None
        for flag, given in (
            ("--load", load is not None),
            ("--rate", rate is not None),
            ("--capacity", capacity),
            ("--slo", slo is not None),
            ("--limit", limit is not None),
        ):
            if given:
                raise UserError(
                    f"{flag} applies to one model's traffic",
                    None,
                    "give --model with it, or drop it to simulate every model of the trace",
                )
        return _run_all_models(
            inv, trace, names, seed, no_aging, show_progress, calibrated, window, plot
        )
    target = _target_model(inv, model)
    stated = inv.model(target).spec.slo
    if objectives is not None and stated is not None:  # --slo replaces the objectives alone
        objectives = dataclasses.replace(objectives, share=stated.share)
    if window is not None and trace is None:
        raise UserError("--window cuts a trace", None, "give --trace, or leave --window out")
    cut = parse_window(window) if window is not None else None
    items = _items(inv, target, workload, trace, limit, seed, show_progress, cut)
    if not items:
        raise UserError("the workload has no requests", None, "raise its rate or duration")
    sdir = StateDir.of(inv)
    calibration = sdir.load_calibration() if calibrated else None
    state = sdir.load_state()
    plan = plan_fleet(inv, state, calibration)
    if not any(d.model == target for d in plan.deployments):
        raise UserError(
            f"the plan places no server for {target}",
            Location(str(inv.path)),
            "run `fleetctl plan` to see why",
        )
    if objectives is None:
        objectives = slo_in_force(inv, target, items, state.slo, calibration)
    spec = inv.spec.router.aging
    aging = Aging(spec.factor, spec.window_s, spec.enabled and not no_aging)
    if capacity:
        found = search_capacity(
            inv, plan, target, items, names, seed, aging, calibration, objectives, show_progress
        )
        source = trace.name if trace is not None else f"synthetic {workload}"
        line = f"{found.line(source)}. At saturation, for the mean request: "
        line += f"{found.analytic_rps:.3g} req/s."
        return {"capacity": found.to_json()}, Text(line)
    with progress("simulating", len(names), enabled=show_progress) as bar:
        result = compare(
            inv,
            plan,
            target,
            items,
            names,
            load=load,
            rate=rate,
            seed=seed,
            aging=aging,
            progress=bar.update,
            calibration=calibration,
            slo=objectives,
        )
    data = result.to_json()
    parts: list[RenderableType] = [render(result)]
    # Which servers ran at measured figures, not the model's, and from what.
    said = calibration_lines(result.servers)
    data["calibration"] = said
    data["perf"] = class_figures(result.servers)
    parts += [Text(line) for line in said]
    if plot is not None:
        source = trace.name if trace is not None else f"synthetic {workload}"
        write_plot(result, plot, fleet=_fleet_name(inv), source=source)
        data["plot"] = str(plot)
        parts.append(Text(f"Wrote the latency plot to {plot}"))
    return data, Group(*parts)


def _run_all_models(
    inv: Inventory,
    trace: Path,
    names: list[str],
    seed: int,
    no_aging: bool,
    show_progress: bool,
    calibrated: bool,
    window: str | None,
    plot: Path | None = None,
) -> tuple[dict[str, Any], RenderableType]:
    """Every model of a multi-model trace on the inventory's plan (sim/multi.py); `plot`: the
    day's picture, one run a policy (sim/dayplot.py)."""
    from fleetctl.fleet.statedir import StateDir
    from fleetctl.planner import plan_fleet

    cut = parse_window(window) if window is not None else None
    traffic = trace_by_model(trace, [m.name for m in inv.models], cut)
    if not traffic:
        raise UserError("the trace has no requests", Location(str(trace)), "check the file")
    sdir = StateDir.of(inv)
    calibration = sdir.load_calibration() if calibrated else None
    state = sdir.load_state()
    plan = plan_fleet(inv, state, calibration)
    # Each model judged as its one-model run would be (stated, applied, else derived).
    slos = {m: slo_in_force(inv, m, items, state.slo, calibration) for m, items in traffic.items()}
    spec = inv.spec.router.aging
    aging = Aging(spec.factor, spec.window_s, spec.enabled and not no_aging)
    with progress("simulating", len(names) * len(traffic), enabled=show_progress) as bar:
        run = run_models(
            inv,
            plan,
            traffic,
            names,
            slos=slos,
            seed=seed,
            aging=aging,
            calibration=calibration,
            progress=bar.update,
        )
    data = run.to_json(names)
    parts: list[RenderableType] = [render(c) for c in run.comparisons.values()]
    parts.append(_fleet_table(run, names))
    if plot is not None:
        title = f"{_fleet_name(inv)}: every model of {trace.name} on the static plan"
        runs = [(f"static plan, {name} routing", data["fleet"][name]) for name in names]
        parts.append(Text(write_day_plot(plot, title, runs)))
        data["plot"] = str(plot)
    return data, Group(*parts)


def _fleet_table(run: FleetRun, names: list[str]) -> RenderableType:
    rows: list[list[Cell]] = []
    for name in names:
        f = run.fleet(name)
        rows.append([name, f"{f['gpu_hours']:,.1f}", f"{f['slo_minutes']:.1%}"])
    return Records(
        f"The fleet: {plural(len(run.comparisons), 'model')} on {plural(run.gpus, 'GPU')} over "
        f"{run.span_s / 3600:.2f} h",
        [
            Col("policy", head=True),
            Col("GPU-hours", numeric=True),
            Col("minutes within SLO", numeric=True),
        ],
        rows,
        caption="minutes within SLO: one-minute windows in which every model's requests met "
        "both objectives for its SLO's share",
    )


def slo_in_force(
    inv: Inventory,
    model: str,
    items: list[WorkItem],
    recorded: Mapping[str, Slo],
    calibration: Calibration | None,
) -> Slo | None:
    """The SLO a run judges `model` by: the inventory's; else the one the applied plan was
    made by (state.json), as route-serve judges the fleet; else, nothing applied, the one
    `plan --workload-from` would plan by on this traffic (fleetctl/fleet/slo.py). None:
    leave it to `compare` (no server holds the model)."""
    m = inv.model(model)
    stated = Slo.of(m.spec.slo)
    if stated is not None:
        return stated
    applied = planned_unless_stated([m], recorded).get(model)
    if applied is not None:
        return applied
    derived = derive_workload(items, inv.spec.router.long_context_tokens)
    if derived is None:
        return None
    spec = m.spec.model_copy(update={"workload": workload_spec(derived, [])})
    return model_slo(inv, dataclasses.replace(m, spec=spec), calibration)


def class_figures(servers: Sequence[Server]) -> dict[str, Any]:
    """Per class of servers (`RTX-4090/bf16`, `/tp2` past TP 1), what the one calibrated
    model says of it, as plan --json and estimate --json say it."""
    out: dict[str, Any] = {}
    for s in servers:
        tp = f"/tp{s.perf.tp}" if s.perf.tp > 1 else ""
        if s.engine is not None:
            out.setdefault(f"{s.gpu_type}/{s.variant}{tp}", s.engine.figures())
    return out


def calibration_lines(servers: Sequence[Server]) -> list[str]:
    """One line per calibrated class of servers: `RTX-4090/bf16 (3 servers): calibrated ...`."""
    groups: dict[tuple[str, str, str], int] = {}
    for s in servers:
        if s.calibrated:
            k = (s.gpu_type, s.variant, s.calibrated)
            groups[k] = groups.get(k, 0) + 1
    return [
        f"{gpu}/{fmt} ({plural(n, 'server')}): {text}"
        for (gpu, fmt, text), n in sorted(groups.items())
    ]


HTML_SUFFIXES = (".html", ".htm")


def check_day_plot(path: Path) -> None:
    """Refuse a day's --plot path before any work: an HTML file in a folder that exists."""
    if path.suffix.lower() not in HTML_SUFFIXES:
        raise UserError(
            f"--plot {path}: the day's picture is an HTML page",
            None,
            "name it FILE.html; one model's run (--model) writes PNG latency tails",
        )
    if path.is_dir() or not path.parent.is_dir():
        raise UserError(
            f"--plot {path}: "
            + ("that is a folder" if path.is_dir() else f"no folder {path.parent}"),
            None,
            "give a file path in a folder that exists",
        )


def write_day_plot(path: Path, title: str, runs: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """The day's picture (sim/dayplot.py) written to `path`; the line that says so."""
    from fleetctl.sim.dayplot import page

    try:
        path.write_text(page(title, runs), encoding="utf-8")
    except OSError as e:
        raise UserError(
            f"cannot write --plot {path}: {e.strerror}", None, "give a writable path"
        ) from None
    return f"Wrote the day's picture to {path}"


def require_matplotlib() -> None:
    """Refuse --plot before any work when matplotlib is missing: a one-line error, exit 2."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError(
            "--plot needs matplotlib, which is not installed",
            None,
            "pip install matplotlib (or pip install 'fleetctl[plot]')",
        ) from None


def _fleet_name(inv: Inventory) -> str:
    return Path(inv.path).stem


def _target_model(inv: Inventory, model: str | None) -> str:
    if model is not None:
        if model not in {m.name for m in inv.models}:
            raise UserError(
                f"no model '{model}' in the inventory", Location(str(inv.path)), "check --model"
            )
        return model
    if len(inv.models) != 1:
        names = ", ".join(m.name for m in inv.models)
        raise UserError(
            "the inventory serves several models",
            Location(str(inv.path)),
            f"pick one with --model ({names})",
        )
    return inv.models[0].name


def _items(
    inv: Inventory,
    model: str,
    workload: str | None,
    trace: Path | None,
    limit: int | None,
    seed: int,
    show_progress: bool,
    window: tuple[float, float] | None = None,
) -> list[WorkItem]:
    if trace is not None:
        try:
            size = trace.stat().st_size
        except OSError:
            size = 0  # load_trace says why it cannot read it
        with progress(f"reading {trace.name}", size, enabled=show_progress) as bar:
            return load_trace(trace, model, limit, progress=bar.update, window=window)
    assert workload is not None
    path = Path(workload)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        import yaml

        data = yaml.safe_load(path.read_text()) or {}
        spec = parse_spec(",".join(f"{k}={v}" for k, v in data.items()), model)
    else:
        spec = parse_spec(workload, model)
    _default_lengths(spec, inv, model, workload)
    return spec.generate(seed)


def parse_slo(text: str) -> Slo:
    """`TTFT_S,TPOT_MS` (either may be `-`: no objective on it) -> Slo in seconds."""
    parts = [p.strip() for p in text.split(",")]
    values: list[float | None] = []
    for p in parts if len(parts) == 2 else []:
        try:
            v = None if p == "-" else float(p)
        except ValueError:
            break
        if v is not None and not (0 < v < math.inf):
            break
        values.append(v)
    if len(values) != 2 or values == [None, None]:
        raise UserError(
            f"bad --slo {text!r}",
            None,
            "write TTFT_S,TPOT_MS, e.g. 2,50 (TTFT 2 s, TPOT 50 ms); - leaves one out",
        )
    ttft, tpot_ms = values
    return Slo(ttft, None if tpot_ms is None else tpot_ms / 1000)


def parse_window(text: str) -> tuple[float, float]:
    """`START:END` seconds (END may be empty: to the end) -> (start, end)."""
    start, sep, end = text.partition(":")
    try:
        lo = float(start or 0)
        hi = float(end) if end.strip() else math.inf
    except ValueError:
        lo = hi = math.nan
    if not sep or not (0 <= lo < hi):
        raise UserError(
            f"bad --window {text!r}", None, "write START:END in seconds, e.g. 600:1200 or 600:"
        )
    return lo, hi


def _default_lengths(spec: Synthetic, inv: Inventory, model: str, text: str) -> None:
    """Unset lengths come from the model's workload in the inventory, capped by max_context."""
    m = inv.model(model).spec
    if m.workload is not None:
        if "prompt=" not in text:
            spec.prompt = m.workload.mean_prompt_tokens
        if "output=" not in text:
            spec.output = m.workload.mean_output_tokens
    if "max_context=" not in text:
        spec.max_context = m.max_context


# (header, summary key, milliseconds?) in table order; TTFT, TPOT and e2e first, then outcomes.
COLUMNS = [
    ("TTFT\nmean", "ttft_mean_s", True),
    ("TTFT\np50", "ttft_p50_s", True),
    ("TTFT\np90", "ttft_p90_s", True),
    ("TTFT\np99", "ttft_p99_s", True),
    ("TPOT\np50", "tpot_p50_s", True),
    ("TPOT\np90", "tpot_p90_s", True),
    ("TPOT\np99", "tpot_p99_s", True),
    ("e2e\np99", "e2e_p99_s", True),
    ("SLO\nmet %", "slo_attainment", False),
    ("req/s", "throughput_rps", False),
    ("preempt", "preemptions", False),
    ("prefix\nhit %", "prefix_hit_rate", False),
    ("prefill\nsaved tok", "prefill_saved_tokens", False),
    ("done", "completed", False),
    ("starved", "starved", False),
    ("rejected", "rejected", False),
]
_LATENCY = [i + 1 for i, (_, _, ms) in enumerate(COLUMNS) if ms]
_OUTCOMES = [i + 1 for i, (_, _, ms) in enumerate(COLUMNS) if not ms]


def render(result: Comparison) -> RenderableType:
    """The policies side by side; the goodput winner (or, with no SLO, the lowest p99 TTFT)
    in bold, then who won on goodput and what each trade costs."""
    summaries = {name: r.summary() for name, r in result.results.items()}
    winner = result.goodput_winner()
    if winner is None:
        best_p99 = min((s["ttft_p99_s"] for s in summaries.values()), default=math.nan)
        winner = next((n for n, s in summaries.items() if s["ttft_p99_s"] == best_p99), None)
    rows: list[list[Cell]] = []
    styles: list[str | None] = []
    for name, s in summaries.items():
        rows.append([name, *(_cell(s[key], ms, key) for _, key, ms in COLUMNS)])
        styles.append("bold green" if name == winner else None)
    load = result.offered_rps / result.capacity_rps if result.capacity_rps else math.nan
    table = Records(
        f"Simulated {result.model}: {plural(len(result.items), 'request')} over "
        f"{plural(len(result.servers), 'server')}, offered {result.offered_rps:.1f} req/s "
        f"({load:.0%} of capacity)",
        [Col("policy", head=True), *(Col(h, numeric=True) for h, _, _ in COLUMNS)],
        rows,
        styles=styles,
        caption="times in ms; TPOT = time per output token; e2e = arrival to last token; "
        "SLO met = served within both objectives",
        parts=[_LATENCY, _OUTCOMES],
    )
    lines = [goodput_line(result, summaries), *rejection_lines(result), *tradeoffs(summaries)]
    return Group(table, *(Text(line) for line in lines))


def rejection_lines(result: Comparison) -> list[str]:
    """Per policy that refused requests, how many for each reason."""
    lines = []
    for name, r in result.results.items():
        counts = rejected_reasons(r.outcomes)
        if counts:
            why = ", ".join(f"{n:,} {kind}" for kind, n in counts.items())
            lines.append(f"Rejected by {name}: {why}.")
    return lines


def goodput_line(result: Comparison, summaries: dict[str, dict[str, float | int]]) -> str:
    """Who served the most requests within both objectives, and the runner-up."""
    slo = result.slo
    winner = result.goodput_winner()
    if slo is None or winner is None:
        return (
            "No SLO to judge goodput by: set the model's slo in the inventory, or give "
            "--slo TTFT_S,TPOT_MS."
        )
    share = float(summaries[winner]["slo_attainment"])
    others = sorted(
        ((float(s["slo_attainment"]), n) for n, s in summaries.items() if n != winner),
        reverse=True,
    )
    line = f"Goodput: {winner} served {share:.1%} of requests within {slo.text()}"
    if others:
        line += f" (next: {others[0][1]} {others[0][0]:.1%})"
    if slo.derived:
        line += f"; the SLO is derived ({slo.basis}), as none is stated"
        if slo.recorded:
            line += f", and {slo.recorded} records it"
    return line + "."


def _cell(v: float | int, ms: bool, key: str = "") -> str:
    if isinstance(v, float) and math.isnan(v):
        return "-"
    if ms:
        return f"{v * 1e3:,.0f}"
    if key in ("prefix_hit_rate", "slo_attainment"):
        return f"{v:.1%}"
    return f"{v:.2f}" if isinstance(v, float) else f"{v:,}"


# What the trade-off sentences compare, lower is better, by family: a policy can win TTFT and
# lose TPOT (it sends more requests to a fast-prefilling but slower-decoding server).
TRADEOFF_METRICS = {
    "TTFT": [("p50 TTFT", "ttft_p50_s"), ("p90 TTFT", "ttft_p90_s"), ("p99 TTFT", "ttft_p99_s")],
    "TPOT": [("p50 TPOT", "tpot_p50_s"), ("p90 TPOT", "tpot_p90_s"), ("p99 TPOT", "tpot_p99_s")],
    "e2e": [("p99 e2e latency", "e2e_p99_s")],
}
SAME_WITHIN = 0.05  # changes smaller than this are noise, not a win or a loss


def tradeoffs(summaries: dict[str, dict[str, float | int]], base: str | None = None) -> list[str]:
    """One sentence per other policy: what `base` cuts and what it raises, TTFT, TPOT and e2e.

    `base` defaults to hardware-aware if it ran, else the policy with the lowest p99 TTFT.
    """
    if len(summaries) < 2:
        return []
    if base is None:
        base = (
            "hardware-aware"
            if "hardware-aware" in summaries
            else min(summaries, key=lambda n: _or_inf(summaries[n]["ttft_p99_s"]))
        )
    ours = summaries[base]
    lines = []
    for other, theirs in summaries.items():
        if other == base:
            continue
        wins: list[str] = []
        losses: list[str] = []
        for metrics in TRADEOFF_METRICS.values():
            changes = [
                (float(ours[key]) / float(theirs[key]) - 1, label)
                for label, key in metrics
                if _finite(ours[key]) and _finite(theirs[key]) and theirs[key] > 0
            ]
            best = min(changes, key=lambda c: c[0], default=None)  # ties: the first listed
            worst = max(changes, key=lambda c: c[0], default=None)
            if best is not None and best[0] <= -SAME_WITHIN:
                wins.append(f"{best[1]} {-best[0]:.0%}")
            if worst is not None and worst[0] >= SAME_WITHIN:
                losses.append(f"{worst[1]} {_rise(worst[0])}")
        if wins and losses:
            lines.append(
                f"{base} cuts {_and(wins)} vs {other}, but raises {_and(losses)}: a trade-off"
            )
        elif wins:
            lines.append(f"{base} cuts {_and(wins)} vs {other}, and is no worse elsewhere")
        elif losses:
            lines.append(f"{base} raises {_and(losses)} vs {other}, and is no better elsewhere")
        else:
            lines.append(
                f"{base} and {other} are within {SAME_WITHIN:.0%} on TTFT, TPOT and e2e latency"
            )
    return lines


def _finite(v: float | int) -> bool:
    return not (isinstance(v, float) and math.isnan(v))


def _or_inf(v: float | int) -> float:
    return float(v) if _finite(v) else math.inf


def _rise(change: float) -> str:
    return f"{change:.0%}" if change < 1 else f"{change + 1:.1f}x"


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def plot_title(result: Comparison, fleet: str, source: str) -> str:
    """Which fleet, which requests, how hard: a plot read later, away from the command line."""
    load = result.offered_rps / result.capacity_rps if result.capacity_rps else math.nan
    return (
        f"{fleet}: {result.model} on {plural(len(result.servers), 'server')}, {source}\n"
        f"{plural(len(result.items), 'request')}, offered {result.offered_rps:.1f} req/s "
        f"({load:.0%} of capacity)"
    )


def write_plot(result: Comparison, path: Path, *, fleet: str, source: str) -> None:
    """Complementary CDFs of TTFT and e2e latency per policy, both axes log: the tail shows."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    panels = [("time to first token (s)", "first_token"), ("end-to-end latency (s)", "finished")]
    for ax, (xlabel, attr) in zip(axes, panels, strict=True):
        for name, r in result.results.items():
            values = sorted(
                getattr(o, attr) - o.item.arrival
                for o in r.outcomes
                if getattr(o, attr) is not None
            )
            if values:
                n = len(values)
                # Share of requests that took at least this long: 1 at the fastest, 1/n at the
                # slowest, so the log axis spreads out the p90..p99.9 tail.
                ax.step(values, [1 - i / n for i in range(n)], where="post", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("share of requests at least this slow")
    axes[0].legend()
    fig.suptitle(plot_title(result, fleet, source))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
