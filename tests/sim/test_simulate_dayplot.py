"""The picture of a simulated day (`simulate --plot FILE.html` on a multi-model trace): one
self-contained HTML page whose panels draw the timeline the JSON carries, minute by minute;
the timeline's GPUs awake add up to the fleet's GPU-hours and its minutes held to its
slo_minutes; a bad path is refused before any simulation."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fleetctl.sim.controls import AwakeSpans
from tests.sim.test_simulate_models import _scenario, multi  # noqa: F401 (a fixture)

RATES = {"llama-3-8b": 3.0, "llama-2-13b": 0.5, "llama-3-70b": 0.2}


class _Page(HTMLParser):
    """The page's SVG panels, each with its series (name -> the values it draws), and every
    tag and URL-bearing attribute seen."""

    def __init__(self) -> None:
        super().__init__()
        self.panels: list[tuple[str, dict[str, list[str]]]] = []
        self.tags: set[str] = set()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.add(tag)
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]
        if tag == "svg":
            self.panels.append((a["data-panel"] or "", {}))
        elif tag == "g" and "data-series" in a:
            values = a["data-values"] or ""
            self.panels[-1][1][a["data-series"] or ""] = values.split(",") if values else []


def _read(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    return page


def _numbers(values: list[str]) -> list[float | None]:
    return [None if v == "" else float(v) for v in values]


def _check_panels(panels: list[tuple[str, dict[str, list[str]]]], fleet: dict, span: float) -> None:
    """Three panels that draw `fleet`'s timeline: demand, GPUs awake and asleep, share;
    `span`: the run's seconds (its last minute may be short)."""
    t = fleet["timeline"]
    assert [p for p, _ in panels] == ["demand", "gpus", "share"]
    (_, demand), (_, gpus), (_, share) = panels
    assert t["minutes"] == fleet["minutes"] == len(t["held"])
    for model, m in t["models"].items():
        assert _numbers(demand[model]) == m["requests"]
        want = [mt / n if n else None for mt, n in zip(m["met"], m["requests"], strict=True)]
        assert _numbers(share[model]) == pytest.approx(want, rel=1e-5)
    assert _numbers(share["held"]) == [int(h) for h in t["held"]]
    drawn = {name: _numbers(v) for name, v in gpus.items()}
    for model, roles in t["gpus"].items():
        for role, series in roles.items():
            label = model if role == "both" else f"{model} {role}"
            assert drawn[f"{label} awake"] == series["awake"]
            assert drawn[f"{label} asleep"] == series["asleep"]
    # One definition of a minute within the objectives, and of GPU-hours.
    assert sum(t["held"]) / t["minutes"] == pytest.approx(fleet["slo_minutes"], abs=1e-4)
    seconds = [min(60.0, span - 60 * k) for k in range(t["minutes"])]
    awake = [r["awake"] for roles in t["gpus"].values() for r in roles.values()]
    awake_h = sum(g * s for series in awake for g, s in zip(series, seconds, strict=True)) / 3600
    assert awake_h == pytest.approx(fleet["gpu_hours"], rel=2e-3, abs=2e-3)


def test_the_autopilots_day_is_drawn_from_the_timeline_its_json_carries(cli, multi, tmp_path):  # noqa: F811
    multi.write_text(multi.read_text().replace("planner:\n", "planner:\n  sleep_mode: true\n"))
    trace = tmp_path / "day.jsonl"
    _scenario(trace, RATES, 600)
    out = tmp_path / "day.html"
    r = cli("simulate", multi, "--trace", trace, "--autopilot", "--plot", out, "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    fleet = data["fleet"]
    assert data["plot"] == str(out) and fleet["actions"].get("sleep", 0) > 0
    page = _read(out)
    assert "script" not in page.tags and page.urls == []  # opens from the file, offline
    assert len(page.panels) == 3
    _check_panels(page.panels, fleet, data["span_s"])
    text = out.read_text()
    assert "autopilot, hardware-aware routing" in text
    assert f"{fleet['gpu_hours']:,.1f} GPU-hours" in text
    # The sleeps show: some minute has GPUs asleep, and the awake ones fall below the start.
    t = fleet["timeline"]
    asleep = [sum(r["asleep"][k] for rs in t["gpus"].values() for r in rs.values())
              for k in range(t["minutes"])]  # fmt: skip
    assert asleep[0] == 0 and max(asleep) > 0


def test_the_static_run_draws_one_day_a_policy(cli, multi, tmp_path):  # noqa: F811
    trace = tmp_path / "day.jsonl"
    _scenario(trace, RATES, 150)
    out = tmp_path / "static.html"
    r = cli("simulate", multi, "--trace", trace, "--policies", "round-robin,hardware-aware",
            "--plot", out, "--json")  # fmt: skip
    assert r.code == 0, r.err
    data = json.loads(r.out)
    panels = _read(out).panels
    assert len(panels) == 6
    for k, policy in enumerate(("round-robin", "hardware-aware")):
        fleet = data["fleet"][policy]
        _check_panels(panels[3 * k : 3 * k + 3], fleet, data["span_s"])
        gpus = fleet["timeline"]["gpus"]
        assert sum(r["awake"][0] for rs in gpus.values() for r in rs.values()) == data["gpus"]


@pytest.mark.parametrize(
    ("name", "says"),
    [("day.png", "HTML page"), ("none/day.html", "no folder"), ("dir.html", "folder")],
)
def test_a_bad_plot_path_is_refused_before_simulating(cli, multi, tmp_path, name, says):  # noqa: F811
    trace = tmp_path / "day.jsonl"
    _scenario(trace, RATES, 60)
    (tmp_path / "dir.html").mkdir()
    for flag in (["--autopilot"], []):
        r = cli("simulate", multi, "--trace", trace, *flag, "--plot", tmp_path / name)
        assert r.code == 2 and says in r.err, r.err
        assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err


def test_gpus_asleep_start_when_the_drain_ends_and_stop_at_the_wake():
    """A 2-GPU server: awake from 0, put to sleep at 90 s, its drain ends at 100 s, woken at
    200 s; the run ends at 240 s."""
    spans = AwakeSpans.of({"a": 2}, ["a"])
    spans.mark("a", 90.0, "asleep")
    spans.down("a", 100.0)
    spans.mark("a", 200.0, "waking")
    spans.up("a", 200.0)
    awake, asleep = spans.per_minute(240.0)["a"]
    assert awake == pytest.approx([2, 2 * 40 / 60, 0, 2 * 40 / 60])
    assert asleep == pytest.approx([0, 2 * 20 / 60, 2, 2 * 20 / 60])
    assert sum(awake) / 60 == pytest.approx(spans.gpu_hours(240.0))
