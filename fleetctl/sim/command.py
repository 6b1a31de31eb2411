"""`fleetctl simulate`: workload in, one row of latency figures per policy out."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from fleetctl.errors import Location, UserError
from fleetctl.inventory import Inventory
from fleetctl.routing.policy import POLICIES
from fleetctl.routing.scheduler import Aging
from fleetctl.sim.run import Comparison, compare
from fleetctl.sim.workload import Synthetic, WorkItem, load_trace, parse_spec


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
) -> tuple[dict[str, Any], RenderableType]:
    from fleetctl.planner import plan_fleet
    from fleetctl.state import load_state

    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise UserError(
            f"unknown policy '{unknown[0]}'", None, f"choose from {', '.join(POLICIES)}"
        )
    if (workload is None) == (trace is None):
        raise UserError("give exactly one of --workload and --trace", None, "see --help")
    target = _target_model(inv, model)
    items = _items(inv, target, workload, trace, limit, seed)
    if not items:
        raise UserError("the workload has no requests", None, "raise its rate or duration")
    plan = plan_fleet(inv, load_state(inv.state_dir))
    if not any(d.model == target for d in plan.deployments):
        raise UserError(
            f"the plan places no server for {target}",
            Location(str(inv.path)),
            "run `fleetctl plan` to see why",
        )
    spec = inv.spec.router.aging
    aging = Aging(spec.factor, spec.window_s, spec.enabled and not no_aging)
    run = {"load": load, "seed": seed, "aging": aging}
    if show_progress:
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task("simulating", total=len(names))

            def step(name: str) -> None:
                bar.update(task, description=f"simulating {name}", completed=names.index(name))

            result = compare(inv, plan, target, items, names, progress=step, **run)  # type: ignore[arg-type]
    else:
        result = compare(inv, plan, target, items, names, **run)  # type: ignore[arg-type]
    if plot is not None:
        write_plot(result, plot)
    return result.to_json(), render(result)


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
) -> list[WorkItem]:
    if trace is not None:
        return load_trace(trace, model, limit)
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


COLUMNS = [
    ("TTFT mean", "ttft_mean_s", 1e3),
    ("p50", "ttft_p50_s", 1e3),
    ("p90", "ttft_p90_s", 1e3),
    ("p99", "ttft_p99_s", 1e3),
    ("TPOT", "tpot_mean_s", 1e3),
    ("e2e p99", "e2e_p99_s", 1e3),
    ("req/s", "throughput_rps", 1),
    ("preempt", "preemptions", 1),
    ("done", "completed", 1),
    ("starved", "starved", 1),
    ("rejected", "rejected", 1),
]


def render(result: Comparison) -> RenderableType:
    t = Table(
        title=f"Simulated {result.model}: {len(result.items):,} requests over "
        f"{len(result.servers)} servers, offered {result.offered_rps:.1f} req/s "
        f"({result.offered_rps / result.capacity_rps:.0%} of capacity)",
        title_justify="left",
        header_style="bold",
        caption="times in ms; TPOT = time per output token",
        caption_justify="left",
    )
    t.add_column("policy")
    for title, _, _ in COLUMNS:
        t.add_column(title, justify="right")
    summaries = {name: r.summary() for name, r in result.results.items()}
    best_p99 = min((s["ttft_p99_s"] for s in summaries.values()), default=math.nan)
    for name, s in summaries.items():
        cells = []
        for _, key, scale in COLUMNS:
            v = s[key]
            if isinstance(v, float) and math.isnan(v):
                cells.append("-")
            elif scale == 1e3:
                cells.append(f"{v * 1e3:,.0f}")
            elif isinstance(v, float):
                cells.append(f"{v:.2f}")
            else:
                cells.append(f"{v:,}")
        style = "bold green" if s["ttft_p99_s"] == best_p99 else None
        t.add_row(name, *cells, style=style)
    parts: list[RenderableType] = [t]
    base = summaries.get("hardware-aware")
    if base:
        for name, s in summaries.items():
            if name != "hardware-aware" and base["ttft_p99_s"] > 0:
                parts.append(
                    Text(
                        f"{name}: p99 TTFT {s['ttft_p99_s'] / base['ttft_p99_s']:.1f}x and mean "
                        f"{s['ttft_mean_s'] / base['ttft_mean_s']:.1f}x hardware-aware's"
                    )
                )
    return Group(*parts)


def write_plot(result: Comparison, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib", None, "pip install 'fleetctl[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in result.results.items():
        ttft = sorted(
            o.first_token - o.item.arrival for o in r.outcomes if o.first_token is not None
        )
        if ttft:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"TTFT CDF: {result.model}, {len(result.items):,} requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
