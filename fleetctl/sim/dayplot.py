"""The picture of a simulated day: one HTML page of inline SVG drawn from a run's timeline."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

WIDTH, HEIGHT = 960, 220
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 12, 28
# Colour-blind-safe (Okabe-Ito), one a model; asleep GPUs in the same colour, faded.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000")
STYLE = """body{font:14px system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:18px}h2{font-size:15px;margin:18px 0 4px}p{margin:4px 0}
svg{display:block;background:#fafafa;border:1px solid #ddd}
.key span{display:inline-block;margin-right:14px}.key i{display:inline-block;width:12px;
height:12px;margin-right:4px;vertical-align:-1px}text{font-size:11px;fill:#555}"""


def page(title: str, runs: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """A whole HTML page: `title`, then per run (its heading, the fleet's figures with their
    `timeline`) its three panels: demand, GPUs awake and asleep, the share within the
    objectives. No script, no fetch: it opens from a file, anywhere."""
    body = [f"<h1>{escape(title)}</h1>"]
    for heading, fleet in runs:
        body += _run(heading, fleet)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def headline(fleet: Mapping[str, Any]) -> str:
    """The fleet's figures in a line: GPU-hours, minutes within the objectives, actions."""
    acts = ", ".join(f"{n} {k}" for k, n in fleet.get("actions", {}).items()) or "none"
    return (
        f"{fleet['gpu_hours']:,.1f} GPU-hours, {fleet['slo_minutes']:.1%} of "
        f"{fleet['minutes']:,} minutes within the objectives; actions: {acts}"
    )


def _run(heading: str, fleet: Mapping[str, Any]) -> list[str]:
    t = fleet["timeline"]
    models = list(t["models"])
    colour = {m: PALETTE[k % len(PALETTE)] for k, m in enumerate(sorted({*models, *t["gpus"]}))}
    minutes = int(t["minutes"])
    demand = [(m, [float(v) for v in t["models"][m]["requests"]]) for m in models]
    shares = [
        (m, [mt / n if n else None for mt, n in zip(s["met"], s["requests"], strict=True)])
        for m, s in t["models"].items()
    ]
    layers = [
        (f"{m}{'' if role == 'both' else ' ' + role} {state}", m, state, series[state])
        for m, roles in t["gpus"].items()
        for role, series in roles.items()
        for state in ("awake", "asleep")
    ]
    return [
        f"<h2>{escape(heading)}</h2><p>{escape(headline(fleet))}</p>",
        "<p>Demand per model (requests arriving per minute)</p>",
        _key([(m, colour[m], 1.0) for m in models]),
        _lines(
            "demand",
            demand,
            colour,
            minutes,
            _nice(max((max(v, default=0.0) for _, v in demand), default=0.0)),
        ),
        "<p>GPUs per model and role: awake (solid) and asleep (faded), stacked</p>",
        _key([(n, colour[m], 1.0 if s == "awake" else 0.3) for n, m, s, _ in layers]),
        _stack("gpus", layers, colour, minutes),
        "<p>Share of each model's requests within its objectives, per minute; below, each "
        "minute within the objectives for every model (green) or not (red)</p>",
        _key([(m, colour[m], 1.0) for m in models]),
        _lines("share", shares, colour, minutes, 1.0, held=[bool(h) for h in t["held"]]),
    ]


def _key(items: Sequence[tuple[str, str, float]]) -> str:
    spans = "".join(
        f'<span><i style="background:{c};opacity:{o}"></i>{escape(n)}</span>' for n, c, o in items
    )
    return f'<p class="key">{spans}</p>'


def _x(k: float, minutes: int) -> float:
    return LEFT + (WIDTH - LEFT - RIGHT) * k / max(1, minutes)


def _y(v: float, top: float) -> float:
    return TOP + (HEIGHT - TOP - BOTTOM) * (1 - v / top) if top > 0 else HEIGHT - BOTTOM


def _frame(panel: str, minutes: int, top: float, percent: bool, inner: list[str]) -> str:
    """An SVG with its axes: ticks at 0, half and the top; hours along the bottom."""
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" data-panel="{panel}" width="{WIDTH}" '
        f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}">'
    ]
    for v in (0.0, top / 2, top):
        y = _y(v, top)
        label = f"{v:.0%}" if percent else f"{v:,.4g}"
        out.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>'
        )
    step = _tick_minutes(minutes)
    for k in range(0, minutes + 1, step):
        x = _x(k, minutes)
        out.append(
            f'<text x="{x:.1f}" y="{HEIGHT - 8}" text-anchor="middle">{k // 60}:{k % 60:02d}</text>'
        )
    return "".join([*out, *inner, "</svg>"])


def _tick_minutes(minutes: int) -> int:
    """A round number of minutes giving at most a dozen labels."""
    for step in (1, 5, 10, 15, 30, 60, 120, 180, 360, 720):
        if minutes / step <= 12:
            return step
    return 1440 * math.ceil(minutes / 1440 / 12)


def _lines(
    panel: str,
    series: Sequence[tuple[str, Sequence[float | None]]],
    colour: Mapping[str, str],
    minutes: int,
    top: float,
    held: Sequence[bool] = (),
) -> str:
    """One polyline a series, a point mid-minute; a minute with no value breaks the line."""
    inner = []
    for name, values in series:
        runs: list[list[str]] = [[]]
        for k, v in enumerate(values):
            if v is None:
                runs.append([])
            else:
                runs[-1].append(f"{_x(k + 0.5, minutes):.1f},{_y(v, top):.1f}")
        data = ",".join("" if v is None else f"{v:g}" for v in values)
        inner.append(
            f'<g data-series="{escape(name)}" data-values="{data}">'
            + "".join(
                f'<polyline fill="none" stroke="{colour[name]}" stroke-width="1.5" '
                f'points="{" ".join(r)}"/>'
                for r in runs
                if r
            )
            + "</g>"
        )
    if held:
        inner.append(f'<g data-series="held" data-values="{",".join(str(int(h)) for h in held)}">')
        for k, h in enumerate(held):
            x0, x1 = _x(k, minutes), _x(k + 1, minutes)
            inner.append(
                f'<rect x="{x0:.1f}" y="{HEIGHT - BOTTOM + 2}" width="{x1 - x0:.2f}" height="5" '
                f'fill="{"#2a9d3a" if h else "#d62728"}"/>'
            )
        inner.append("</g>")
    return _frame(panel, minutes, top, panel == "share", inner)


def _stack(
    panel: str,
    layers: Sequence[tuple[str, str, str, Sequence[float]]],
    colour: Mapping[str, str],
    minutes: int,
) -> str:
    """The layers stacked in order, each a step-shaped area over its minutes."""
    base = [0.0] * minutes
    tops = [sum(vs) for vs in zip(*(v for *_, v in layers), strict=True)] if layers else []
    top = _nice(max(tops, default=0.0))
    inner = []
    for name, model, state, values in layers:
        upper = [b + v for b, v in zip(base, values, strict=True)]
        edge = [(k, upper[k]) for k in range(minutes)]
        back = [(k, base[k]) for k in reversed(range(minutes))]
        points = [f"{_x(k + d, minutes):.1f},{_y(v, top):.1f}" for k, v in edge for d in (0, 1)] + [
            f"{_x(k + d, minutes):.1f},{_y(v, top):.1f}" for k, v in back for d in (1, 0)
        ]
        data = ",".join(f"{v:g}" for v in values)
        inner.append(
            f'<g data-series="{escape(name)}" data-values="{data}"><polygon '
            f'fill="{colour[model]}" fill-opacity="{1.0 if state == "awake" else 0.3}" '
            f'points="{" ".join(points)}"/></g>'
        )
        base = upper
    return _frame(panel, minutes, top, False, inner)


def _nice(v: float) -> float:
    """The next round number at or above `v`: an axis top."""
    if v <= 0:
        return 1.0
    scale = 10 ** math.floor(math.log10(v))
    return next(m * scale for m in (1, 2, 2.5, 5, 10) if m * scale >= v)
