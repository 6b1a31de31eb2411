"""The planner's capacity is goodput at the SLO on the workload's lengths and bursts
(fleetctl/planner/queueing.py), derived from traffic by `plan --workload-from`."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.perf import EnginePerf
from fleetctl.planner import plan_fleet
from fleetctl.planner.candidates import candidates, node_classes
from fleetctl.planner.queueing import Group, Traffic, goodput
from fleetctl.sim.workload import WorkItem, burstiness, derive_workload
from tests.conftest import seed_nodes, write

SLO = "    slo: {ttft_p99_s: 2.0, tpot_p99_ms: 60}\n"


def model(
    workload: str, max_context: int = 8192, extra: str = "", profile: str = "llama-3-8b"
) -> str:
    return (
        "ssh: {user: ubuntu}\n"
        + seed_nodes()
        + f"models:\n  - name: llama-3-8b\n    profile: {profile}\n"
        + "    variants: {bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}}\n"
        + f"    max_context: {max_context}\n{extra}"
        + f"    workload: {{{workload}}}\n"
        + SLO
    )


MEANS = "requests_per_s: 10, mean_prompt_tokens: 1200, mean_output_tokens: 250"
LENGTHS = (
    ", prompt_tokens_p50: 1000, prompt_tokens_p90: 2500, prompt_tokens_p99: 4100"
    ", output_tokens_p50: 200, output_tokens_p90: 430, output_tokens_p99: 600"
)


def one_server(catalog, gpu: str = "A100-SXM4-80GB") -> tuple[EnginePerf, int]:
    perf = EnginePerf(catalog.gpu(gpu), catalog.model("llama-3-8b"), catalog.format("bf16"), 1)
    return perf, 400_000


def test_goodput_falls_as_arrivals_burst_and_as_the_tail_grows(catalog):
    perf, kv = one_server(catalog)
    group = Group(4, perf, kv, 256, 8192)
    base = [(0.5, 800, 250), (0.4, 1800, 250), (0.1, 4000, 250)]

    def rate(burst: float, stretch: float = 1.0) -> float:
        points = tuple((s, round(p * (stretch if p > 1000 else 1)), o) for s, p, o in base)
        return goodput([group], Traffic(points, burst, (), ((1.0, 250),)), 2.0, 0.060)

    bursts = [rate(b) for b in (1, 5, 20, 100, 400)]
    assert all(a > b for a, b in itertools.pairwise(bursts)), bursts
    assert bursts[-1] < 0.7 * bursts[0]
    tails = [rate(1, s) for s in (1, 1.5, 2)]
    assert all(a > b for a, b in itertools.pairwise(tails)), tails


def test_without_objectives_a_mean_request_is_served_at_saturation(catalog):
    """The limit where it should be today's figure: no objective, smooth arrivals, every
    request the mean shape: the capacity is the perf model's saturation throughput."""
    perf, kv = one_server(catalog)
    traffic = Traffic(((1.0, 1500, 300),), 1.0, (), ((1.0, 300),))
    for servers in (1, 8):
        got = goodput([Group(servers, perf, kv, 256, 8192)], traffic, None, None)
        assert got == pytest.approx(servers * perf.capacity_rps(1500, 300, kv, 256), rel=1e-3)


def test_plan_json_capacity_falls_for_a_bursty_workload_and_says_what_it_assumed(cli, tmp_path):
    capacity = {}
    for name, workload in (("means", MEANS), ("smooth", MEANS + LENGTHS), ("bursty", None)):
        text = model(workload or MEANS + LENGTHS + ", burstiness: 60")
        r = cli("plan", write(tmp_path, text, f"{name}.yaml"), "--json")
        assert r.code == 0, r.err
        (m,) = json.loads(r.out)["models"]
        assert m["capacity_basis"] == "goodput"
        capacity[name] = m["capacity_rps"]
        if name == "means":
            assert "Poisson arrivals" in m["assumed"]
            assert "every prompt the mean length" in m["assumed"]
        else:
            assert "every prompt the mean length" not in m["assumed"]
    assert capacity["bursty"] < 0.8 * capacity["smooth"], capacity
    assert 0 < capacity["smooth"] < capacity["means"], capacity


def test_a_tail_only_one_class_holds_is_bounded_by_that_class(tmp_path, catalog):
    """max_context 16K, min_sequences 8: the RTX 4090s run 6K-odd, so the prompts past that
    (a tenth or more here) go to the four A100s only, and the model's capacity is bounded by
    what the A100s serve of that tail within the SLO."""
    tail = (
        "requests_per_s: 5, mean_prompt_tokens: 3500, mean_output_tokens: 250"
        ", prompt_tokens_p50: 1000, prompt_tokens_p90: 7000, prompt_tokens_p99: 12000"
        ", max_prompt_tokens: 15000, output_tokens_p50: 200, output_tokens_p90: 430"
        ", output_tokens_p99: 600"
    )
    inv = load_inventory(
        write(
            tmp_path,
            model(tail, 16384, "    min_context: 4096\n    min_sequences: 8\n", "llama-3.1-8b"),
        ),
        catalog,
    )
    plan = plan_fleet(inv)
    lens = {d.gpu_type: d.server.max_model_len for d in plan.deployments}
    assert lens["RTX-4090"] < 7000 <= lens["A100-SXM4-80GB"], lens
    (summary,) = plan.models
    assert summary.capacity_basis == "goodput"
    # The A100s alone, given only the requests longer than the 4090s hold: their goodput
    # on that tail over its share of all requests bounds the whole.
    from fleetctl.planner.candidates import traffic_of

    feasible, _ = candidates(inv, node_classes(inv))
    a100 = next(k for k in feasible if k.cls.gpu.name == "A100-SXM4-80GB")
    traffic = traffic_of(inv.models[0], (3500, 250))
    long = [(s, p, o) for s, p, o in traffic.points if p + o > lens["RTX-4090"]]
    share = sum(s for s, _, _ in long)
    assert 0.05 < share < 0.3
    only = Traffic(tuple((s / share, p, o) for s, p, o in long), 1.0, (), traffic.outputs)
    group = Group(
        4,
        a100.perf,
        a100.budget.kv_tokens,
        a100.max_num_seqs,
        a100.max_model_len,
        max_num_batched_tokens=a100.max_num_batched_tokens,
    )
    bound = goodput([group], only, 2.0, 0.060) / share
    # ... and the tail is carried there, not lost: the 4090s take the rest.
    assert 0.3 * bound < summary.capacity_rps <= bound * 1.01, (summary.capacity_rps, bound)
    # The same lengths all within the 4090s' reach: more capacity.
    short = tail.replace("7000", "4000").replace("12000", "4500").replace("15000", "4800")
    inv2 = load_inventory(
        write(
            tmp_path,
            model(short, 16384, "    min_context: 4096\n    min_sequences: 8\n", "llama-3.1-8b"),
            "short.yaml",
        ),
        catalog,
    )
    assert plan_fleet(inv2).models[0].capacity_rps > summary.capacity_rps


def test_derived_workloads_carry_quantiles_and_burstiness():
    rng = random.Random(3)
    t, poisson = 0.0, []
    for i in range(5000):
        t += rng.expovariate(5.0)
        poisson.append(WorkItem(i, t, 100 + i % 1000, 50 + i % 100, "m"))
    assert 0.7 < burstiness([w.arrival for w in poisson]) < 1.4
    # The same requests in clumps of 20 at one instant, the clumps Poisson: about twenty
    # times the dispersion.
    t, clumped = 0.0, []
    for w in poisson:
        if w.id % 20 == 0:
            t += rng.expovariate(5.0 / 20)
        clumped.append(WorkItem(w.id, t, w.prompt, w.output, "m"))
    assert burstiness([w.arrival for w in clumped]) > 10
    derived = derive_workload(poisson, 4096)
    assert derived is not None
    assert derived.prompt_quantiles == (600, 1000, 1090)
    assert derived.max_prompt_tokens == 1099
    assert derived.output_quantiles[0] == 100


def test_quantiles_that_fall_are_one_clear_line(cli, tmp_path):
    bad = model(MEANS + ", prompt_tokens_p50: 3000, prompt_tokens_p90: 2000")
    r = cli("validate", write(tmp_path, bad))
    assert r.code == 2 and "prompt_tokens_p90 2000 is below prompt_tokens_p50 3000" in r.err
    assert "\n" not in r.err.strip()
