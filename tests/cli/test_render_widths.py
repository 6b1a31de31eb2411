"""Every table fleetctl prints fits 80, 100 and 160 columns, and every number in it survives whole.

Each case renders real data (the bundled example plans, a short simulation, facts, health and
status rows) and lists the numbers that data holds, formatted as the table formats them. At each
width no line may be wider than the console, and each number must appear unbroken: not cut,
not ellipsized, not folded across lines. Adding a table is one line in CASES.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterable, Iterator
from functools import cache

import pytest
from rich.console import Console, RenderableType

from fleetctl.base.resources import examples
from fleetctl.base.text import rate
from fleetctl.fleet.inventory import Inventory, load_inventory
from fleetctl.fleet.plan import Plan
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet

WIDTHS = (80, 100, 160)
_NUMBER = re.compile(r"\d(?:[\d,.]*\d)?")

Case = tuple[RenderableType, list[str]]  # what to print, the numbers it must show whole


def render_at(renderable: RenderableType, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()


def shows_whole(number: str, text: str) -> bool:
    """`number` appears with no digit, and no `,digit` or `.digit`, glued to either side."""
    return re.search(rf"(?<![\d,.]){re.escape(number)}(?!\d|[.,]\d)", text) is not None


def numbers_in(prose: str) -> list[str]:
    return _NUMBER.findall(prose)


@cache
def inventory(name: str) -> Inventory:
    return load_inventory(examples()[name], load_catalog())


@cache
def plan_of(name: str) -> Plan:
    return plan_fleet(inventory(name))


def plan_numbers(plan: Plan) -> Iterator[str]:
    for d in plan.deployments:
        s = d.server
        yield str(d.tensor_parallel_size)
        yield str(s.max_model_len)
        yield f"{s.kv_budget_tokens:,}"
        yield str(s.max_sequences_at_max_len)
        yield f"{s.predicted_decode_tok_s:.0f}"
        yield f"{d.capacity_rps:.2f}"
    for m in plan.models:
        yield str(m.replicas)
        yield str(m.gpus)
        yield f"{m.capacity_rps:.2f}"
        if m.demand_rps:
            yield rate(m.demand_rps)


def plan_cases(explain: bool) -> Iterator[Case]:
    from fleetctl.cli.render import render_plan

    for name in examples():
        plan = plan_of(name)
        numbers = list(plan_numbers(plan))
        if explain:
            for d in plan.deployments:
                for reason in d.server.reasons:
                    numbers += numbers_in(reason)
        yield render_plan(plan, explain), numbers


def profiles_cases() -> Iterator[Case]:
    from fleetctl.cli.render import profiles_table

    cat = load_catalog()
    numbers = []
    for g in cat.gpus.values():
        numbers += [f"{g.memory_mib / 1024:.1f}", f"{g.memory_bandwidth_gb_s:g}"]
        numbers.append(f"{g.tflops.bf16 or g.tflops.fp16:g}")
        if g.tflops.fp8:
            numbers.append(f"{g.tflops.fp8:g}")
    for m in cat.models.values():
        numbers += [f"{m.params_total / 1e9:.1f}", str(m.num_layers), str(m.max_context)]
        numbers.append(f"{2 * m.num_layers * m.num_kv_heads * m.head_dim * 2 / 1024:g}")
    for f in cat.formats.values():
        numbers.append(f"{f.weight_bytes_per_param:g}")
    yield profiles_table(cat), numbers


FACTS = {
    "format": 2,
    "nodes": {
        "a100-inference-node-1": {
            "host": "10.20.30.41",
            "hostname": "a100-inference-node-1.us-east-2.compute.internal",
            "driver_version": "535.104.05",
            "cuda_version": "12.2",
            "vllm": "0.6.3.post1",
            "interconnect": "nvlink",
            "gpus": [{"index": i, "name": "NVIDIA A100-SXM4-80GB"} for i in range(8)],
        },
        "rtx-12": {
            "host": "10.20.31.12",
            "hostname": "rtx-12",
            "driver_version": "550.54.14",
            "cuda_version": "12.4",
            "gpus": [{"index": 0, "name": "NVIDIA GeForce RTX 4090"}],
            "gpu_error": {"kind": "nvml-mismatch", "message": "driver/library mismatch"},
        },
        "rtx-13": {
            "host": "10.20.31.13",
            "error": {"kind": "unreachable", "message": "connection timed out"},
        },
    },
}


def facts_cases() -> Iterator[Case]:
    from fleetctl.cli.render import facts_table
    from fleetctl.fleet.facts import Facts

    numbers = ["535.104.05", "12.2", "0.6.3.post1", "550.54.14", "12.4", "8", "1"]
    yield facts_table(Facts.from_json(FACTS)), numbers


def health_cases() -> Iterator[Case]:
    from fleetctl.cli.render import health_table
    from fleetctl.fleet.health import Check

    checks = [
        Check("reachable", "a100-inference-node-1", "ok", "ssh answered in 0.21 s"),
        Check(
            "vllm-version",
            "rtx-12",
            "warn",
            "vLLM 0.6.3.post1 here, 0.6.4 on 7 other nodes of class rtx: upgrade to 0.6.4",
        ),
        Check("gpu-memory", "h100-4", "fail", "GPU 3 has 81,559 MiB, 12,288 MiB in use"),
    ]
    numbers = [n for c in checks for n in numbers_in(c.detail)]
    yield health_table(checks), numbers


def status_cases() -> Iterator[Case]:
    from fleetctl.apply.status import ServerStatus
    from fleetctl.cli.render import status_table

    rows = [
        ServerStatus("a100-inference-node-1", "llama-3-8b", (0,), 8000, "running", "ready"),
        ServerStatus(
            "h100-4",
            "mixtral-8x7b-instruct",
            (4, 5, 6, 7),
            18001,
            "failed",
            "exited with status 137 after 1,204 s",
        ),
        ServerStatus("rtx-13", "llama-3-8b", (0,), 8000, "unreachable", "timed out"),
    ]
    numbers = ["8000", "18001", "4,5,6,7", *numbers_in(rows[1].detail)]
    yield status_table(rows), numbers


@cache
def comparison():  # type: ignore[no-untyped-def]
    from fleetctl.sim.compare import compare
    from fleetctl.sim.workload import parse_spec

    inv = inventory("seed-mixed-8b")
    model = inv.models[0].name
    items = parse_spec("rate=20,duration=120,max_context=8192", model).generate(0)
    # Above capacity, so queueing makes TTFT run to tens of seconds: five-digit milliseconds.
    return compare(inv, plan_of("seed-mixed-8b"), model, items, load=1.5)


def simulate_cases() -> Iterator[Case]:
    from fleetctl.sim.command import render

    result = comparison()
    numbers = [f"{len(result.items):,}", str(len(result.servers))]
    for s in (r.summary() for r in result.results.values()):
        for key in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p99_s"):
            numbers.append(f"{s[key] * 1e3:,.0f}")
        numbers.append(f"{s['throughput_rps']:.2f}")
        numbers += [f"{s[k]:,}" for k in ("preemptions", "completed", "starved", "rejected")]
    yield render(result), numbers


def estimate_cases() -> Iterator[Case]:
    from fleetctl.cli.render import estimate_table
    from fleetctl.model.catalog import load_catalog
    from fleetctl.model.estimate import Settings, Workload, estimate, fits_instead

    cat = load_catalog()
    e = estimate(
        cat.gpu("H100-SXM-80GB"),
        cat.model("mixtral-8x7b"),
        cat.format("fp8"),
        Settings(tensor_parallel_size=2, vllm_version="0.6.3.post1"),
        Workload(batch=64, context=2000, prompt=4096),
    )
    j = e.to_json()
    numbers = [
        f"{j['kv_cache_tokens']:,}",
        f"{j['weights_gib_per_gpu']:.2f}",
        f"{j['decode_tok_s_total']:,.1f}",
        f"{j['prefill_tok_s']:,.0f}",
        f"{j['step_time_ms']:.2f}",
        "0.6.3.post1",
    ]
    yield estimate_table(e), numbers
    # One that does not fit: what its memory leaves, and what fits instead.
    short = estimate(cat.gpu("A100-SXM4-80GB"), cat.model("llama-3-70b"), cat.format("bf16"))
    instead = fits_instead(short, list(cat.formats.values()))
    numbers = [f"{f.kv_cache_tokens:,}" for f in instead] + [f"{short.max_model_len:,}"]
    yield estimate_table(short, instead), numbers


def example_texts() -> dict[str, str]:
    from fleetctl.base.resources import example_description

    return {name: example_description(path) for name, path in examples().items()}


def examples_cases() -> Iterator[Case]:
    from fleetctl.cli.render import examples_table

    texts = example_texts()
    yield examples_table(texts), [n for text in texts.values() for n in numbers_in(text)]


CASES: dict[str, Callable[[], Iterable[Case]]] = {
    "examples": examples_cases,
    "estimate": estimate_cases,
    "plan": lambda: plan_cases(explain=False),
    "plan --explain": lambda: plan_cases(explain=True),
    "profiles": profiles_cases,
    "facts": facts_cases,
    "health": health_cases,
    "status": status_cases,
    "simulate": simulate_cases,
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("table", list(CASES))
def test_every_table_fits_and_keeps_its_numbers_whole(table: str, width: int) -> None:
    for renderable, numbers in CASES[table]():
        assert numbers, "a case with no numbers checks nothing"
        text = render_at(renderable, width)
        too_wide = [line for line in text.splitlines() if len(line) > width]
        assert not too_wide, f"{table} at {width}: lines over {width} columns:\n{text}"
        broken = sorted(n for n in set(numbers) if not shows_whole(n, text))
        assert not broken, f"{table} at {width}: {broken} not shown whole in:\n{text}"


def test_the_check_catches_a_cut_number() -> None:
    """The whole-number check itself: what rich's ellipsis and folding do to a number fails it."""
    assert shows_whole("1,629,296", "KV 1,629,296 tokens")
    assert not shows_whole("1,629,296", "KV 1,629,2… tokens")
    assert not shows_whole("56,234", "│ 56,2 │\n│ 34   │")
    assert not shows_whole("12.2", "CUDA 12.24")
    assert shows_whole("12.2", "CUDA 12.2.")


def test_the_compact_layouts_take_over_only_below_a_width() -> None:
    """A table while one fits: the seed plan at 100 columns, simulate as one table at 160 and
    as two (latency, outcomes) at 100; one block per record only where no table fits."""
    from fleetctl.cli.render import plan_table

    def tables(text: str) -> int:
        return sum(line.startswith("┏") for line in text.splitlines())

    plan = plan_table(plan_of("seed-mixed-8b"))
    assert tables(render_at(plan, 100)) == 1 and tables(render_at(plan, 160)) == 1
    blocks = render_at(plan, 80)
    assert tables(blocks) == 0 and "+ a100-[1:4] llama-3-8b bf16" in blocks
    assert "KV tokens 486,304" in blocks
    [(sim, _)] = simulate_cases()
    assert tables(render_at(sim, 160)) == 1 and tables(render_at(sim, 100)) == 2


def test_examples_fits_the_terminal_and_wraps_each_description_whole() -> None:
    """`fleetctl examples` at COLUMNS=80: no line over 80, and each example's first sentence
    is there in full (wrapped at word breaks), not cut at its file's first line."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80"}
    p = subprocess.run(
        [sys.executable, "-m", "fleetctl", "examples"], capture_output=True, text=True, env=env
    )
    assert p.returncode == 0, p.stderr
    assert max(len(line) for line in p.stdout.splitlines()) <= 80, p.stdout
    flowed = " ".join(p.stdout.split())
    for name, text in example_texts().items():
        assert text.endswith(".") and f"example:{name} {text}" in flowed, (text, p.stdout)
