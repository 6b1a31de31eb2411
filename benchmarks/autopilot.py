"""The autopilot against a static plan and the field's reactive scaler, in the simulator.

Run (from the repository root, in the dev venv):

    python benchmarks/autopilot.py [--traces DIR] [--hours 6] [--day-hours 6] [--seed 1]
        [--interval 60] [--down-after 5] [--burst-period 600] [--burst-hours 1]
        [--no-burst | --burst-only]

day: a multi-model scenario over a compressed day on the seed's multi-model fleet
(`inventory/seed-multi-model.yaml`: 4 A100 pairs and 8 RTX 4090s; Llama-3 70B, Llama-2 13B,
Llama-3 8B), its servers started with sleep mode. How the scenario is made (sim/scenario.py):
- 8B chat: (prompt, output) pairs of the Azure 2023 conversation trace that fit its 8,192
  tokens; mean 5 req/s, peaking at 13:00, peak 4x the trough.
- 13B code assistant: pairs of the Azure 2023 code trace that fit its 4,096 tokens; mean 1.2
  req/s, peaking at 15:00 (work hours), 5x; a burst of 3x for 10 minutes at a quarter of
  the run.
- 70B long documents and batch: conversation pairs with prompts over 2,000 tokens; mean 0.2
  req/s, peaking at 02:00 (night), 3x. (Until 2026-12-07 it was 0.4 req/s: at the derived
  SLO the planner found the 70B's night peak, 0.6 req/s of 3,500-token prompts, beyond the
  four A100 pairs, 0.49 req/s, so no policy could keep it. At 0.2 every hour's mix fits the
  fleet by the planner's figures, 7 to 16 GPUs, while the sum of the three peaks needs 15.)
The day is compressed into --day-hours hours (the curves' period; rates and shapes kept). Each
of the three runs the same requests: the inventory's plan left static (the static plan from
the whole trace's mean load is that inventory's workload), the reactive scaler (KEDA-like on
waiting requests, autopilot/reactive.py) and the autopilot (autopilot/decide.py).

Printed: GPU-hours, the share of minutes in which every model met its objectives, each model's
attainment, the actions taken, and the wall time of each run.

burst (run after the day; `--burst-only` skips the day, `--no-burst` skips this): the burst
test of a user of Dynamo's SLA planner, one model on one GPU class. The rate is a sine from
1 to 24 req/s (period --burst-period s, over --burst-hours h; sim/scenario.py's sine_burst),
every request an 8,000-token prompt and a 1,000-token output, judged by a 3 s TTFT objective
and a 50 ms TPOT objective (the user states no TPOT objective; 50 ms is the inter-token
latency Dynamo's planner itself defaults to), for the 99% share fleetctl plans by. The model
is Llama-3.1 8B (its 128K context holds the 9,000 tokens; the user's model is not said). The
fleet is sized by fleetctl's planner: the fewest A100 80GB nodes whose plan, made for the
peak (24 req/s of these shapes), covers it at the planner's target utilization, found by
doubling the node count until the planner's capacity does, then bisecting; that plan is the static run, and
the reactive scaler and the autopilot start from it with sleep mode on.
Printed: per run, the share of requests within both objectives, GPU-hours, TTFT p50/p99 and
TPOT p99. Each run's JSON (with its minute-by-minute timeline) and its picture (HTML, as
`simulate --plot` draws it) go to benchmarks/out/autopilot/.
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
from fleetctl.planner import plan_fleet
from fleetctl.sim.dayplot import page
from fleetctl.sim.scenario import Burst, ModelTraffic, generate, sine_burst
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


def _three_runs(  # type: ignore[no-untyped-def]
    args: argparse.Namespace, inv, traffic, prefix: str, row, title
) -> None:
    """The static plan, the reactive scaler and the autopilot on the same traffic: a table
    row each, and each run's JSON and day page under OUT as `prefix`-run."""
    settings = Settings(interval_s=args.interval, down_after=args.down_after)
    for name, run in (
        ("static", lambda: run_static(inv, traffic)),
        ("reactive", lambda: run_reactive(inv, traffic)),
        ("autopilot", lambda: run_autopilot(inv, traffic, settings)),
    ):
        t = time.time()
        result = run()
        print(row(result, time.time() - t), flush=True)
        data = result.to_json()
        (OUT / f"{prefix}-{name}.json").write_text(json.dumps(data, indent=1))
        (OUT / f"{prefix}-{name}.html").write_text(page(title(name), [(name, data["fleet"])]))


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
        ModelTraffic("llama-3-70b", _shapes(conv, 8192, 2000), 0.2, peak_hour=2, swing=3),
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
    _three_runs(args, inv, traffic, "day", _row, lambda name: f"The day: {name}")


BURST_MODEL = "llama-3.1-8b"
BURST_PEAK_RPS = 24.0
BURST_FLEET = """\
ssh: {{user: ubuntu, identity_file: ~/.ssh/id_ed25519}}
nodes:
  - name: a100-[1:{n}]
    host: 10.0.1.[1:{n}]
    gpus: {{type: A100-SXM4-80GB, count: 1}}
models:
  - name: llama-3.1-8b
    profile: llama-3.1-8b
    variants:
      bf16: {{source: meta-llama/Llama-3.1-8B-Instruct}}
    max_context: 16384
    workload: {{requests_per_s: {peak}, mean_prompt_tokens: 8000, mean_output_tokens: 1000}}
    slo: {{ttft_p99_s: 3, tpot_p99_ms: 50}}
planner:
  gpu_memory_utilization: 0.95
  sleep_mode: true
"""


def burst_inventory(tmp: Path):  # type: ignore[no-untyped-def]
    """The fewest A100 nodes whose plan for the peak covers it at the target utilization:
    doubled until one does, then bisected."""

    def planned(n: int):  # type: ignore[no-untyped-def]
        inv = _inventory(BURST_FLEET.format(n=n, peak=BURST_PEAK_RPS), tmp)
        plan = plan_fleet(inv, None, None)
        capacity = sum(s.capacity_rps for s in plan.models if s.model == BURST_MODEL)
        return inv, capacity, capacity >= BURST_PEAK_RPS / inv.spec.planner.target_utilization

    lo, hi = 0, 8
    while not planned(hi)[2]:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if planned(mid)[2] else (mid, hi)
    inv, capacity, _ = planned(hi)
    return inv, hi, capacity


def _burst_row(day: FleetDay, wall: float) -> str:
    s = day.by_model()[BURST_MODEL].summary()
    assert day.result.awake is not None
    gpu_hours = day.result.awake.gpu_hours(day.span_s)
    acts = ", ".join(f"{k} {v}" for k, v in sorted(day.result.awake.actions.items())) or "none"
    return (
        f"| {day.name} | {float(s['slo_attainment']):.1%} | {gpu_hours:.1f} "
        f"| {float(s['ttft_p50_s']):.2f} | {float(s['ttft_p99_s']):.2f} "
        f"| {float(s['tpot_p99_s']) * 1e3:.0f} | {acts} | {wall:.0f} |"
    )


def burst(args: argparse.Namespace) -> None:
    rows = sine_burst(
        BURST_MODEL, 1.0, BURST_PEAK_RPS, args.burst_period, 8000, 1000, args.burst_hours,
        seed=args.seed,
    )  # fmt: skip
    traffic = _traffic(rows)
    inv, n, capacity = burst_inventory(OUT / "burst")
    print(
        f"burst: {len(rows):,} requests over {args.burst_hours:g} h, a 1-{BURST_PEAK_RPS:g} "
        f"req/s sine of period {args.burst_period:g} s; fleet: {n} A100 80GB (planned "
        f"{capacity:.1f} req/s for the {BURST_PEAK_RPS:g} req/s peak)"
    )
    print("| run | within SLO | GPU-hours | TTFT p50 s | TTFT p99 s | TPOT p99 ms | actions "
          "| wall s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    _three_runs(
        args, inv, traffic, "burst", _burst_row,
        lambda name: f"The burst moved by the {name} on {n} A100s",
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", type=Path, default=TRACES)
    p.add_argument("--hours", type=float, default=6.0)
    p.add_argument("--day-hours", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--interval", type=float, default=60.0)
    p.add_argument("--down-after", type=int, default=5)
    p.add_argument("--burst-period", type=float, default=600.0)
    p.add_argument("--burst-hours", type=float, default=1.0)
    p.add_argument("--no-burst", action="store_true", help="skip the burst")
    p.add_argument("--burst-only", action="store_true", help="skip the day")
    args = p.parse_args()
    if not args.burst_only:
        day(args)
    if not args.no_burst:
        burst(args)


if __name__ == "__main__":
    main()
