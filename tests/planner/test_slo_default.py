"""Every model has an SLO (stated, or derived from its servers), a plan's capacity is the
goodput rate the simulator finds at it, and simulate names why it refused requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetctl.base.resources import examples
from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.slo import (
    LONG_PROMPT_FACTOR,
    MODERATE_BATCH,
    TPOT_FACTOR,
    TTFT_FACTOR,
)
from fleetctl.planner import plan_fleet
from fleetctl.routing.policy import RoutingConfig
from fleetctl.sim.fleet import servers_from_plan
from tests.conftest import DATA, REPO

SLICE = DATA / "azure_conv_slice.csv"


def test_a_model_with_no_stated_slo_gets_one_its_slowest_class_meets_idle(catalog):
    """The seed fleet states no SLO: the default is twice the RTX 4090's (the slower class's)
    idle prefill of a 4x-mean prompt and twice its decode step at batch 16, rounded up;
    every class meets both idle, and the A100 with room to spare."""
    inv = load_inventory(examples()["seed-mixed-8b"], catalog)
    assert inv.models[0].spec.slo is None
    plan = plan_fleet(inv)
    slo = plan.slos["llama-3-8b"]
    assert slo.derived and slo.source == "derived" and slo.share == 0.99
    assert (slo.ttft_s, slo.tpot_s) == (2.4, 0.052)
    assert "RTX-4090's idle prefill of 6,000 tokens" in slo.basis
    long = int(LONG_PROMPT_FACTOR * 1500)
    by_gpu = {s.gpu_type: s.perf for s in servers_from_plan(plan.deployments, inv)}
    rtx, a100 = by_gpu["RTX-4090"], by_gpu["A100-SXM4-80GB"]
    step = rtx.step_time(MODERATE_BATCH, MODERATE_BATCH * (1500 + 150))
    ttft, tpot = TTFT_FACTOR * rtx.prefill_time(long), TPOT_FACTOR * step
    assert ttft <= slo.ttft_s < ttft * 1.05 and tpot <= slo.tpot_s < tpot * 1.05
    assert a100.prefill_time(long) < rtx.prefill_time(long)
    # The router's config derives the same from the servers it is given, none without them.
    engines = [(s.model, s.perf, s.max_model_len) for s in servers_from_plan(plan.deployments, inv)]
    assert RoutingConfig.of(inv, engines).slo["llama-3-8b"] == slo
    assert RoutingConfig.of(inv).slo == {}


def _with_slo(tmp_path: Path, slo: str) -> Path:
    text = (REPO / "inventory" / "seed-mixed-8b.yaml").read_text()
    text = text.replace("    max_context: 8192", f"    max_context: 8192\n    slo: {slo}")
    path = tmp_path / "slo.yaml"
    path.write_text(text)
    return path


def test_plan_prints_and_writes_each_models_slo_stated_or_derived(cli, tmp_path):
    r = cli("plan", "example:seed-mixed-8b")
    assert r.code == 0, r.err
    assert "SLO of llama-3-8b: 99% within TTFT <= 2.4 s and TPOT <= 52 ms (derived: " in r.out
    assert "is analytic, not replayed" in r.out
    data = json.loads(cli("plan", "example:seed-mixed-8b", "--json").out)
    slo = data["slo"]["llama-3-8b"]
    assert (slo["ttft_p99_s"], slo["tpot_p99_ms"], slo["share"]) == (2.4, 52.0, 0.99)
    assert slo["source"] == "derived" and "RTX-4090" in slo["basis"]
    check = data["capacity_check"]["llama-3-8b"]
    assert check["checked"] == "analytic" and check["goodput_rps"] is None
    assert check["analytic_rps"] == data["models"][0]["capacity_rps"]
    # A stated one is printed as stated, its share with it; a share without objectives keeps
    # the derived objectives.
    stated = _with_slo(tmp_path, "{ttft_p99_s: 2, tpot_p99_ms: 60, share: 0.9}")
    r = cli("plan", stated)
    assert "SLO of llama-3-8b: 90% within TTFT <= 2 s and TPOT <= 60 ms (stated in" in r.out
    share_only = _with_slo(tmp_path, "{share: 0.95}")
    slo = json.loads(cli("plan", share_only, "--json").out)["slo"]["llama-3-8b"]
    assert (slo["ttft_p99_s"], slo["share"], slo["source"]) == (2.4, 0.95, "derived")


@pytest.mark.parametrize("bad", ["1.5", "0", "-0.1", "x"])
def test_an_slo_share_outside_0_to_1_is_one_line(cli, tmp_path, bad):
    r = cli("validate", _with_slo(tmp_path, f"{{ttft_p99_s: 2, share: {bad}}}"))
    assert r.code == 2, r.out
    assert "share" in r.err and "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1


def test_simulate_without_a_stated_slo_judges_and_routes_by_the_derived_one(cli):
    """With nothing applied, simulate derives the SLO from the traffic it replays as
    `plan --workload-from` does from it (the trace's p99 prompt, 4,088 tokens in the slice,
    on every class that can hold the model): a user reads one SLO in both. Each policy's
    attainment is counted against it and the goodput line says it was derived. (Before,
    simulate took 4x the trace's mean prompt: TTFT 1.4 s against the plan's 1.6 s.)"""
    plan = cli("plan", "example:seed-mixed-8b", "--workload-from", SLICE, "--json")
    planned = json.loads(plan.out)["slo"]["llama-3-8b"]
    assert planned["source"] == "derived" and "prefill of 4,088 tokens" in planned["basis"]
    r = cli("simulate", "example:seed-mixed-8b", "--trace", SLICE, "--load", "0.9", "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["slo"] == planned
    assert data["goodput_winner"] in data["policies"]
    for figures in data["policies"].values():
        assert 0 < figures["slo_attainment"] <= 1
    text = cli("simulate", "example:seed-mixed-8b", "--trace", SLICE, "--load", "0.9").out
    said = f"within TTFT <= {planned['ttft_p99_s']:g} s and TPOT <= {planned['tpot_p99_ms']:g} ms"
    assert said in text and "the SLO is derived" in text


def test_simulate_judges_an_applied_fleet_by_the_slo_its_plan_recorded(cli, tmp_path, catalog):
    """Once a plan is applied, state.json holds the SLO it was made by, and simulate judges
    by that one, as route-serve does, whatever traffic it replays, and says so. A stated
    SLO still wins over a recorded one."""
    from fleetctl.fleet.slo import Slo
    from fleetctl.fleet.state import State
    from fleetctl.fleet.statedir import StateDir

    path = tmp_path / "fleet.yaml"
    path.write_text((REPO / "inventory" / "seed-mixed-8b.yaml").read_text())
    inv = load_inventory(path, catalog)
    recorded = Slo(3.0, 0.07, 0.99, derived=True, basis="what the plan derived")
    StateDir(tmp_path / ".fleetctl").save_state(
        State(1, plan_fleet(inv).deployments, {"llama-3-8b": recorded})
    )
    args = ("simulate", path, "--workload", "rate=2,duration=20", "--policies", "round-robin")
    r = cli(*args, "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["slo"] == recorded.to_json()
    text = cli(*args).out
    assert "within TTFT <= 3 s and TPOT <= 70 ms" in text
    assert "and the applied plan (state serial 1) records it" in text
    stated = _with_slo(tmp_path, "{ttft_p99_s: 2, tpot_p99_ms: 60}")
    r = cli("simulate", stated, "--workload", "rate=2,duration=20", "--policies", "round-robin")
    assert "within TTFT <= 2 s and TPOT <= 60 ms" in r.out, r.out


def test_the_slo_printed_is_the_one_planned_by_where_the_slowest_class_is_left_out(cli, catalog):
    """The large mixed fleet's placement leaves out the slowest class that could hold some
    models; their SLO is still the one derived from every candidate, the one they were
    planned by, in `plan`'s text and `--json` alike (before, the plan printed one derived
    again from the servers placed: the 8B's TPOT 22 ms against the 170 ms planned by)."""
    from fleetctl.planner.candidates import candidates, node_classes

    inv = load_inventory(examples()["large-mixed-fleet"], catalog)
    feasible, _ = candidates(inv, node_classes(inv))
    planned = {k.model.name: k.slo for k in feasible if k.slo is not None}
    r = cli("plan", "example:large-mixed-fleet", "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["slo"] == {name: slo.to_json() for name, slo in planned.items()}
    placed: dict[str, set[str]] = {}
    for d in data["deployments"]:
        placed.setdefault(d["model"], set()).add(d["gpu_type"])
    # The case is there: a model whose SLO comes from a class none of its servers is on.
    left_out = [
        name
        for name, slo in planned.items()
        if not any(f"x {gpu}'s idle prefill" in slo.basis for gpu in placed[name])
    ]
    assert left_out, planned
    text = cli("plan", "example:large-mixed-fleet").out
    for name in left_out:
        slo = planned[name]
        assert f"SLO of {name}: 99% within {slo.text()} (derived: " in text


def test_simulate_capacity_finds_the_rate_the_slo_holds_at_and_not_a_quarter_above(cli):
    """`simulate --capacity` bisects the rate: replayed at the rate it found, hardware-aware
    serves the SLO's share within both objectives; at 1.25x that rate it does not."""

    def simulate(*extra):
        r = cli("simulate", "example:seed-mixed-8b", "--trace", SLICE, "--json", *extra)
        assert r.code == 0, r.err
        return json.loads(r.out)

    found = simulate("--capacity")["capacity"]
    assert found["policy"] == "hardware-aware" and found["requests"] == 400
    assert found["windows"] == 1
    assert found["slo"]["source"] == "derived" and found["tolerance"] == 0.05
    rate = found["goodput_rps"]
    assert 0 < rate < found["analytic_rps"]
    assert found["missed_at_rps"] <= rate * 1.05 + 1e-3
    assert simulate("--capacity") == {"capacity": found}  # deterministic
    share = found["slo"]["share"]
    for at, meets in ((rate, True), (1.25 * rate, False)):
        run = simulate("--rate", f"{at}", "--policies", "hardware-aware")
        assert run["slo"] == found["slo"]
        assert (run["policies"]["hardware-aware"]["slo_attainment"] >= share) is meets, at
    r = cli("simulate", "example:seed-mixed-8b", "--trace", SLICE, "--capacity", "--rate", "3")
    assert r.code == 2 and "--capacity searches the rate itself" in r.err


def test_plan_from_a_trace_prints_the_capacity_the_simulator_found(cli):
    r = cli("plan", "example:seed-mixed-8b", "--workload-from", SLICE, "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    check = data["capacity_check"]["llama-3-8b"]
    assert check["checked"] == "replayed" and check["trace"] == str(SLICE)
    assert check["analytic_rps"] == data["models"][0]["capacity_rps"]
    replay = check["replay"]
    assert check["goodput_rps"] == replay["goodput_rps"] > 0
    assert replay["slo"] == data["slo"]["llama-3-8b"]
    met = [t for t in replay["tried"] if t["attainment"] >= replay["slo"]["share"]]
    assert max(t["rate_rps"] for t in met) == replay["goodput_rps"]
    text = cli("plan", "example:seed-mixed-8b", "--workload-from", SLICE).out
    line = (
        "llama-3-8b: capacity checked by the simulator on azure_conv_slice.csv (all 400 "
        f"requests, hardware-aware): {replay['goodput_rps']:.3g} req/s with 99% within TTFT"
    )
    assert line in text
    assert "analytic, not replayed" not in text


def test_simulate_names_why_it_rejected_each_request(cli):
    """Prompts longer than any server's context, and strict int4 hints on a BF16-only fleet,
    are refused; the JSON counts each reason, the table says them."""
    spec = (
        "rate=4,duration=30,prompt=500,output=50,long_share=0.3,long_prompt=12000,"
        "max_context=20000,precision=int4:0.2;strict"
    )
    args = ("simulate", "example:seed-mixed-8b", "--workload", spec, "--policies", "hardware-aware")
    r = cli(*args, "--json")
    assert r.code == 0, r.err
    figures = json.loads(r.out)["policies"]["hardware-aware"]
    reasons = figures["rejected_reasons"]
    assert set(reasons) == {"context too long for every server", "no server of that precision"}
    assert sum(reasons.values()) == figures["rejected"] > 0
    text = cli(*args).out
    assert "Rejected by hardware-aware: " in text
    assert f"{reasons['context too long for every server']:,} context too long for every" in text


def test_a_long_trace_is_replayed_in_windows_spread_over_it(catalog):
    """Past WINDOWS x WINDOW_REQUESTS requests, the search replays one window from the start
    of each equal part, rebased to 0 and renumbered (the simulator indexes by id), and pools
    their attainment; the rate it reports is the whole trace's, time-scaled."""
    from fleetctl.sim.capacity import goodput_rate, windows
    from fleetctl.sim.workload import load_trace

    items = load_trace(SLICE, "llama-3-8b")
    parts = windows(items, 4, 50)
    assert [len(p) for p in parts] == [50] * 4
    for k, part in enumerate(parts):
        assert [w.id for w in part] == list(range(50)) and part[0].arrival == 0
        first = items[k * 100]
        assert part[-1].arrival == items[k * 100 + 49].arrival - first.arrival
        assert (part[7].prompt, part[7].output) == (
            items[k * 100 + 7].prompt,
            items[k * 100 + 7].output,
        )
    assert windows(items, 4, 100) == [items]
    inv = load_inventory(examples()["seed-mixed-8b"], catalog)
    found = goodput_rate(inv, plan_fleet(inv), "llama-3-8b", items, window=50)
    assert (found.requests, found.windows) == (200, 4)
    assert found.rate_rps > 0 and found.attainment >= found.slo.share


def test_the_search_brackets_then_bisects_to_the_tolerance():
    """Against a known cliff: the highest rate tried that meets the share is within 5% below
    the cliff, and one within 5% above it missed; a fleet that meets it at saturation is
    tried beyond; one that never meets it is halved until the steps run out."""
    from fleetctl.sim.capacity import search

    def cliff(at):
        return lambda rate: 1.0 if rate <= at else 0.5

    for at in (3.0, 17.0, 29.0, 39.0):
        tried = search(cliff(at), 40.0, 0.99, 0.05, 12)
        met = max(r for r, a in tried if a >= 0.99)
        missed = min(r for r, a in tried if a < 0.99 and r > met)
        assert met <= at < missed <= met * 1.05 + 1e-9, (at, tried)
    tried = search(cliff(100.0), 40.0, 0.99, 0.05, 12)
    assert (40.0, 1.0) in tried and max(r for r, _ in tried) > 40.0
    tried = search(cliff(0.0), 40.0, 0.99, 0.05, 6)
    assert len(tried) == 6 and all(a < 0.99 for _, a in tried)
    assert [r for r, _ in tried] == sorted((r for r, _ in tried), reverse=True)


def test_the_planner_plans_a_model_with_no_stated_slo_by_goodput_at_its_derived_one(catalog):
    """The seed states no SLO: its capacity is the goodput at the derived SLO (not the
    saturation throughput), every candidate is weighed by that SLO, and it is the one the
    plan prints (derived from the placed servers), since the slowest class is placed."""
    from fleetctl.planner.candidates import candidates, node_classes

    inv = load_inventory(examples()["seed-mixed-8b"], catalog)
    plan = plan_fleet(inv)
    (summary,) = plan.models
    assert summary.capacity_basis == "goodput"
    printed = plan.slos["llama-3-8b"]
    feasible, _ = candidates(inv, node_classes(inv))
    assert feasible and {k.slo for k in feasible} == {printed}
    saturation = sum(d.capacity_rps for d in plan.deployments)
    assert 0 < summary.capacity_rps < saturation


def test_the_slo_share_is_the_one_the_capacity_is_found_at(tmp_path, catalog):
    """`slo.share`: a capacity at which 90% of requests meet the objectives is higher than
    one at which 99% do; the explanation names the share."""
    caps = {}
    for share in (0.9, 0.99):
        inv = load_inventory(
            _with_slo(tmp_path, f"{{ttft_p99_s: 2.0, tpot_p99_ms: 60, share: {share}}}"),
            catalog,
        )
        plan = plan_fleet(inv)
        caps[share] = plan.models[0].capacity_rps
        reasons = [r for d in plan.deployments for r in d.server.reasons]
        assert any(f"({share * 100:g}% of requests within both" in r for r in reasons), reasons
    assert caps[0.9] > caps[0.99], caps


def test_the_derived_ttft_objective_uses_the_workloads_p99_prompt(tmp_path, catalog):
    """Where the workload states `prompt_tokens_p99`, the long prompt of the derived TTFT
    objective is it, not 4x the mean."""
    text = (REPO / "inventory" / "seed-mixed-8b.yaml").read_text()
    text = text.replace(
        "mean_output_tokens: 300}", "mean_output_tokens: 300, prompt_tokens_p99: 3000}"
    )
    path = tmp_path / "p99.yaml"
    path.write_text(text)
    inv = load_inventory(path, catalog)
    plan = plan_fleet(inv)
    slo = plan.slos["llama-3-8b"]
    assert "RTX-4090's idle prefill of 3,000 tokens" in slo.basis, slo.basis
    assert slo.ttft_s < 2.4  # half the 4x-mean prompt's
