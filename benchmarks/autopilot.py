"""The autopilot against a static plan and the field's reactive scaler, in the simulator.

Run (from the repository root, in the dev venv):

    python benchmarks/autopilot.py [--traces DIR] [--hours 6] [--day-hours 6] [--seed 1]
        [--interval 60] [--down-after 5]

day: a multi-model scenario over a compressed day on the seed's multi-model fleet
(`inventory/seed-multi-model.yaml`: 4 A100 pairs and 8 RTX 4090s; Llama-3 70B, Llama-2 13B,
Llama-3 8B), its servers started with sleep mode. How the scenario is made (sim/scenario.py):
- 8B chat: (prompt, output) pairs of the Azure 2023 conversation trace that fit its 8,192
  tokens; mean 5 req/s, peaking at 13:00, peak 4x the trough.
- 13B code assistant: pairs of the Azure 2023 code trace that fit its 4,096 tokens; mean 1.2
  req/s, peaking at 15:00 (work hours), 5x; a burst of 3x for 10 minutes at a quarter of
  the run.
- 70B long documents and batch: conversation pairs with prompts over 2,000 tokens; mean 0.4
  req/s, peaking at 02:00 (night), 3x.
The day is compressed into --day-hours hours (the curves' period; rates and shapes kept). Each
of the three runs the same requests: the inventory's plan left static (the static plan from
the whole trace's mean load is that inventory's workload), the reactive scaler (KEDA-like on
waiting requests, autopilot/reactive.py) and the autopilot (autopilot/decide.py).

Printed: GPU-hours, the share of minutes in which every model met its objectives, each model's
attainment, the actions taken, and the wall time of each run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fleetctl.autopilot.decide import Settings
from fleetctl.autopilot.simulated import FleetDay, run_autopilot, run_reactive, run_static
from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.sim.scenario import Burst, ModelTraffic, generate
from fleetctl.sim.workload import WorkItem, load_trace

REPO = Path(__file__).resolve().parent.parent
TRACES = REPO.parent / "shared" / "traces"
OUT = REPO / "benchmarks" / "out" / "autopilot"


def _shapes(path: Path, longest: int, shortest_prompt: int = 1) -> list[tuple[int, int]]:
    return [
        (w.prompt, w.output)
        for w in load_trace(path, "any")
        if w.prompt + w.output <= longest and w.prompt >= shortest_prompt
    ]


def _traffic(rows: list[dict[str, object]]) -> dict[str, list[WorkItem]]:
    out: dict[str, list[WorkItem]] = {}
    for r in rows:
        model = str(r["model"])
        mine = out.setdefault(model, [])
        ms, prompt, output = r["timestamp"], r["input_length"], r["output_length"]
        assert isinstance(ms, int) and isinstance(prompt, int) and isinstance(output, int)
        mine.append(WorkItem(len(mine), ms / 1000, prompt, output, model))
    return out


def _inventory(text: str, tmp: Path):  # type: ignore[no-untyped-def]
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "fleet.yaml"
    path.write_text(text)
    return load_inventory(path, load_catalog())


def _row(day: FleetDay, wall: float) -> str:
    j = day.to_json()
    f = j["fleet"]
    models = ", ".join(f"{m} {v['slo_attainment']:.1%}" for m, v in j["models"].items())
    acts = ", ".join(f"{k} {v}" for k, v in f["actions"].items()) or "none"
    return (
        f"| {day.name} | {f['gpu_hours']:.1f} | {f['slo_minutes']:.1%} | {models} | {acts} "
        f"| {wall:.0f} |"
    )


def day(args: argparse.Namespace) -> None:
    conv = args.traces / "AzureLLMInferenceTrace_conv.csv"
    code = args.traces / "AzureLLMInferenceTrace_code.csv"
    hours = args.hours
    models = [
        ModelTraffic("llama-3-8b", _shapes(conv, 8192), 5.0, peak_hour=13, swing=4),
        ModelTraffic(
            "llama-2-13b",
            _shapes(code, 4096),
            1.2,
            peak_hour=15,
            swing=5,
            bursts=[Burst(hours * 3600 / 4, 600, 3.0)],
        ),
        ModelTraffic("llama-3-70b", _shapes(conv, 8192, 2000), 0.4, peak_hour=2, swing=3),
    ]
    rows = generate(models, hours, seed=args.seed, day_hours=args.day_hours)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "day.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    traffic = _traffic(rows)
    text = (REPO / "inventory" / "seed-multi-model.yaml").read_text()
    inv = _inventory(text.replace("planner:\n", "planner:\n  sleep_mode: true\n"), OUT / "day")
    print(f"day: {len(rows):,} requests over {hours:g} h ({args.day_hours:g} h to a day): "
          + ", ".join(f"{m} {len(v):,}" for m, v in traffic.items()))  # fmt: skip
    print("| run | GPU-hours | minutes within SLO | attainment by model | actions | wall s |")
    print("|---|---|---|---|---|---|")
    settings = Settings(interval_s=args.interval, down_after=args.down_after)
    for name, run in (
        ("static", lambda: run_static(inv, traffic)),
        ("reactive", lambda: run_reactive(inv, traffic)),
        ("autopilot", lambda: run_autopilot(inv, traffic, settings)),
    ):
        t = time.time()
        result = run()
        print(_row(result, time.time() - t), flush=True)
        (OUT / f"day-{name}.json").write_text(json.dumps(result.to_json(), indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", type=Path, default=TRACES)
    p.add_argument("--hours", type=float, default=6.0)
    p.add_argument("--day-hours", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--interval", type=float, default=60.0)
    p.add_argument("--down-after", type=int, default=5)
    day(p.parse_args())


if __name__ == "__main__":
    main()
