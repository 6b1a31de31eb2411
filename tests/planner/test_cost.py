"""Prices and SLOs in the planner: node prices, plan --objective cost, the plan's cost figures."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.prices import gpus_cost_per_hour, node_cost_per_hour, per_million_tokens
from fleetctl.fleet.state import State
from fleetctl.model.catalog import Catalog
from fleetctl.planner import plan_fleet
from tests.conftest import DATA, REPO, seed_nodes, write

FLEET = (
    "ssh: {user: ubuntu}\n"
    + seed_nodes()
    + """\
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
    max_context: 8192
    workload: {requests_per_s: 8, mean_prompt_tokens: 1500, mean_output_tokens: 300}
"""
)


def inventory(tmp_path: Path, catalog: Catalog, text: str = FLEET):  # type: ignore[no-untyped-def]
    return load_inventory(write(tmp_path, text), catalog)


def priced(a100: float, rtx: float, text: str = FLEET) -> str:
    text = text.replace(
        "gpus: {type: A100-SXM4-80GB, count: 1}",
        f"gpus: {{type: A100-SXM4-80GB, count: 1}}\n    cost_per_hour: {a100}",
    )
    return text.replace(
        "gpus: {type: RTX-4090, count: 1}",
        f"gpus: {{type: RTX-4090, count: 1}}\n    cost_per_hour: {rtx}",
    )


def test_a_node_costs_its_entry_price_else_its_gpus_profile_default(tmp_path, catalog):
    text = FLEET.replace(
        "gpus: {type: A100-SXM4-80GB, count: 1}",
        "gpus: {type: A100-SXM4-80GB, count: 2}\n    cost_per_hour: 5.0",
    )
    inv = inventory(tmp_path, catalog, text)
    a100 = next(n for n in inv.nodes if n.name == "a100-3")
    rtx = next(n for n in inv.nodes if n.name == "rtx-8")
    assert a100.cost_per_hour == 5.0  # per node of the range, not per entry
    assert node_cost_per_hour(a100) == 5.0
    assert gpus_cost_per_hour(a100, 1) == 2.5
    default = catalog.gpu("RTX-4090").cost_per_hour
    assert default is not None and node_cost_per_hour(rtx) == default
    bare = dataclasses.replace(rtx, gpu=rtx.gpu.model_copy(update={"cost_per_hour": None}))
    assert node_cost_per_hour(bare) is None and gpus_cost_per_hour(bare, 1) is None


def test_every_gpu_profile_names_where_its_default_price_comes_from(catalog):
    for gpu in catalog.gpus.values():
        assert gpu.cost_per_hour is not None and gpu.cost_per_hour > 0, gpu.name
        assert any(s.startswith("cost_per_hour:") and "2025" in s for s in gpu.sources), gpu.name


def test_cost_per_million_output_tokens_is_the_hourly_price_over_an_hours_tokens():
    assert per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)  # 3.6M tokens an hour
    assert per_million_tokens(None, 1000.0) is None
    assert per_million_tokens(3.6, 0.0) is None


def test_the_cost_objective_meets_the_workload_on_cheaper_gpus(tmp_path, catalog):
    inv = inventory(tmp_path, catalog)
    fast = plan_fleet(inv, objective="throughput")
    cheap = plan_fleet(inv, objective="cost")
    assert fast.cost_per_hour is not None and cheap.cost_per_hour is not None
    assert cheap.cost_per_hour < fast.cost_per_hour
    m = cheap.models[0]
    assert m.capacity_rps * inv.spec.planner.target_utilization >= 8.0
    assert m.shortfall_rps == 0
    assert cheap.solver["objective"] == "cost"
    assert cheap.cost_per_hour == pytest.approx(
        sum(d.server.cost_per_hour for d in cheap.deployments)
    )  # type: ignore[misc]


@pytest.mark.parametrize(
    ("a100", "rtx", "wanted"),
    [(1.0, 1.0, "A100-SXM4-80GB"), (20.0, 0.2, "RTX-4090")],
)
def test_the_cost_objective_follows_the_prices(tmp_path, catalog, a100, rtx, wanted):
    """An A100 serves ~3x a 4090's requests: at equal prices it wins; at 100x it loses."""
    plan = plan_fleet(inventory(tmp_path, catalog, priced(a100, rtx)), objective="cost")
    used = Counter(d.gpu_type for d in plan.deployments)
    assert used.most_common(1)[0][0] == wanted, used
    assert plan.models[0].shortfall_rps == 0


def test_a_workload_the_fleet_cannot_carry_is_reported_as_a_shortfall(cli, tmp_path):
    inv = write(tmp_path, FLEET.replace("requests_per_s: 8", "requests_per_s: 500"))
    r = cli("plan", inv, "--objective", "cost", "--json", "--state-dir", tmp_path / "s")
    assert r.code == 0, r.err
    plan = json.loads(r.out)
    model = plan["models"][0]
    assert model["shortfall_rps"] > 400
    assert len(plan["deployments"]) == 12  # every GPU, and still short
    assert any("covers" in w and "500 req/s" in w for w in plan["warnings"])
    r = cli("plan", inv, "--objective", "cost", "--state-dir", tmp_path / "s")
    assert "short" in r.out


def test_plan_json_carries_cost_per_hour_on_top_and_per_deployment(cli, tmp_path):
    inv = write(tmp_path, priced(2.0, 0.5))
    r = cli("plan", inv, "--json", "--state-dir", tmp_path / "s")
    assert r.code == 0, r.err
    plan = json.loads(r.out)
    prices = {d["gpu_type"]: d["cost_per_hour"] for d in plan["deployments"]}
    assert prices == {"A100-SXM4-80GB": 2.0, "RTX-4090": 0.5}
    assert plan["cost_per_hour"] == pytest.approx(4 * 2.0 + 8 * 0.5)
    assert plan["objective"] == "throughput"
    m = plan["models"][0]
    assert m["cost_per_hour"] == plan["cost_per_hour"]
    assert m["output_tokens_per_s"] == 8 * 300  # the workload's, which capacity covers
    assert m["cost_per_million_output_tokens"] == pytest.approx(12.0 / (2400 * 3600) * 1e6, 1e-3)
    r = cli("plan", inv, "--state-dir", tmp_path / "s")
    assert "Cost: $12.00/h (objective throughput), $1.39 per million output tokens" in r.out


def no_price_profiles(tmp_path: Path) -> Path:
    """A profiles folder whose RTX-4090 and A100 have no default price."""
    folder = tmp_path / "profiles" / "gpus"
    folder.mkdir(parents=True)
    for name in ("rtx-4090", "a100-sxm4-80gb"):
        text = (REPO / "profiles" / "gpus" / f"{name}.yaml").read_text()
        lines = [x for x in text.splitlines() if not x.startswith("cost_per_hour:")]
        (folder / f"{name}.yaml").write_text("\n".join(lines) + "\n")
    return tmp_path / "profiles"


def test_without_prices_the_plan_shows_none_and_the_cost_objective_says_what_to_set(cli, tmp_path):
    inv = write(tmp_path, FLEET)
    profiles = no_price_profiles(tmp_path)
    r = cli("plan", inv, "--profiles", profiles, "--json", "--state-dir", tmp_path / "s")
    assert r.code == 0, r.err
    plan = json.loads(r.out)
    assert plan["cost_per_hour"] is None and plan["cost_per_million_output_tokens"] is None
    assert all(d["cost_per_hour"] is None for d in plan["deployments"])
    assert plan["models"][0]["cost_per_hour"] is None
    r = cli("plan", inv, "--profiles", profiles, "--state-dir", tmp_path / "s")
    assert r.code == 0 and "Cost" not in r.out and "cost" not in r.out
    r = cli("plan", inv, "--profiles", profiles, "--objective", "cost")
    assert r.code == 2
    line = r.err.strip()
    assert "\n" not in line
    assert "a100-1" in line and "cost_per_hour" in line and "inventory.yaml:3" in line


def test_bad_prices_and_slos_name_the_field(cli, tmp_path):
    bad = FLEET.replace(
        "gpus: {type: RTX-4090, count: 1}",
        "gpus: {type: RTX-4090, count: 1}\n    cost_per_hour: -1",
    )
    r = cli("validate", write(tmp_path, bad))
    line = bad.splitlines().index("    cost_per_hour: -1") + 1
    assert r.code == 2 and "cost_per_hour" in r.err and f"inventory.yaml:{line}:" in r.err
    bad = FLEET + "    slo: {ttft_p99_s: 0}\n"
    r = cli("validate", write(tmp_path, bad))
    assert r.code == 2 and "ttft_p99_s" in r.err
    r = cli("plan", write(tmp_path, FLEET), "--objective", "cheapest")
    assert r.code == 2 and "--objective throughput or cost" in r.err


def test_a_tpot_slo_caps_capacity_and_an_impossible_ttft_places_nothing(tmp_path, catalog):
    # At one step budget, vLLM's default: a tighter objective also chooses a smaller one,
    # which serves more (tests/planner/test_step_budget.py).
    pinned = "planner: {max_num_batched_tokens: 2048}\n" + FLEET
    base = plan_fleet(inventory(tmp_path, catalog, pinned), objective="throughput")
    tight = plan_fleet(
        inventory(tmp_path, catalog, pinned + "    slo: {tpot_p99_ms: 40}\n"),
        objective="throughput",
    )
    rtx = {d.gpu_type: d.capacity_rps for d in base.deployments}
    capped = {d.gpu_type: d.capacity_rps for d in tight.deployments}
    assert capped["A100-SXM4-80GB"] < rtx["A100-SXM4-80GB"]
    # Capped at the rate whose p99 TPOT (the same perf model, the mean request, prefill
    # interference counted: planner/disaggregate.py) stays within the objective, 40 ms.
    from fleetctl.model.perf import EnginePerf
    from fleetctl.planner.disaggregate import Pool, colocated

    a100 = next(d for d in tight.deployments if d.gpu_type == "A100-SXM4-80GB")
    perf = EnginePerf(
        catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3-8b"), catalog.format("bf16"), 1
    )
    kv = a100.server.kv_budget_tokens
    pool = Pool(0, "", 1, perf, kv, a100.server.max_num_seqs, None)
    held = colocated(pool, 1500, 300, 0.040).rate
    assert 0 < a100.capacity_rps <= held < perf.capacity_rps(1500, 300, kv, 256)
    never = plan_fleet(
        inventory(tmp_path, catalog, FLEET + "    slo: {ttft_p99_s: 0.001}\n"), objective="cost"
    )
    assert not never.deployments and [u.model for u in never.unplaced] == ["llama-3-8b"]
    why = never.unplaced[0].reason
    assert "slo" in why and "ttft_p99_s 0.001" in why and "relax the slo" in why, why
    assert any("idle: no model benefits" in w for w in never.warnings), never.warnings


def test_plan_objective_cost_through_the_cli_uses_cheaper_gpus(cli, tmp_path):
    """The example fleet: the cost objective runs 2 of its 28 GPUs, throughput all of them."""
    args = ("plan", "example:cost-mixed", "--json", "--state-dir", tmp_path / "s")
    fast = json.loads(cli(*args).out)
    r = cli(*args, "--objective", "cost")
    assert r.code == 0, r.err
    cheap = json.loads(r.out)
    assert cheap["objective"] == "cost" and fast["objective"] == "throughput"
    assert cheap["cost_per_hour"] < fast["cost_per_hour"] / 4
    assert sum(len(d["gpu_indices"]) for d in cheap["deployments"]) < sum(
        len(d["gpu_indices"]) for d in fast["deployments"]
    )
    assert cheap["models"][0]["shortfall_rps"] == 0
    h100 = [d for d in cheap["deployments"] if d["gpu_type"] == "H100-SXM-80GB"]
    assert all(d["cost_per_hour"] == pytest.approx(10.76 / 4) for d in h100)  # the entry's price


def test_a_cost_plan_moves_only_where_the_saving_pays_back_its_warm_up(tmp_path, catalog):
    """planner.payback_hours: three A100s run the workload within its derived SLO; at 4.00
    an A100-hour, one of them and five RTX 4090s at 1.00 carry it for 3.00 an hour less
    (their step budgets keep every decode step within the TPOT objective). That pays back
    their warm-ups within a day (the default), not within 36 seconds."""
    first = plan_fleet(inventory(tmp_path, catalog, priced(1.0, 1.0)), objective="cost")
    assert {d.gpu_type for d in first.deployments} == {"A100-SXM4-80GB"}
    state = State(1, first.deployments)

    def replan(payback: float | None) -> Counter[str]:
        text = priced(4.0, 1.0)
        if payback is not None:
            text += f"planner:\n  payback_hours: {payback}\n"
        inv = inventory(tmp_path, catalog, text)
        return Counter(a.op for a in plan_fleet(inv, state, objective="cost").actions)

    assert replan(None) == Counter(create=5, delete=2, keep=1)
    assert replan(0.01) == Counter(keep=3)


# Two length buckets (Melange's request sizes): 40% short chats, 60% long prompts. The mean
# request (1,840-token prompt) takes 0.34 s to prefill on a 4090, over half the 0.64 s TTFT
# objective, so one mean shape rules the 4090 out; a 100-token prompt takes 0.02 s there.
# Each bucket is weighed by its goodput at the SLO: one A100 carries 1.44 req/s of the long
# prompts within it at 80% (the rate here is sized to that).
BUCKETED = (
    priced(2.5, 1.0, "ssh: {user: ubuntu}\n" + seed_nodes())
    + """\
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
    max_context: 8192
    slo: {ttft_p99_s: 0.64}
    workload:
      requests_per_s: 2.4
      mean_prompt_tokens: 1840
      mean_output_tokens: 180
      buckets:
        - {share: 0.4, mean_prompt_tokens: 100, mean_output_tokens: 300, max_tokens: 800}
        - {share: 0.6, mean_prompt_tokens: 3000, mean_output_tokens: 100, max_tokens: 6200}
"""
)


def mean_only(text: str) -> str:
    return text[: text.index("      buckets:")]


def with_buckets(text: str, *buckets: str) -> str:
    """FLEET's workload (8 req/s, 1500/300) with these buckets."""
    flow = "    workload: {requests_per_s: 8, mean_prompt_tokens: 1500, mean_output_tokens: 300}\n"
    block = (
        "    workload:\n      requests_per_s: 8\n      mean_prompt_tokens: 1500\n"
        "      mean_output_tokens: 300\n      buckets:\n"
        + "".join(f"        - {{{b}}}\n" for b in buckets)
    )
    assert flow in text
    return text.replace(flow, block)


def test_length_buckets_put_short_requests_on_cheap_gpus_and_long_ones_on_large(tmp_path, catalog):
    """Fails before length buckets (the inventory had no `buckets`): the mean-shape plan
    runs A100s alone (7.50 an hour); sized per bucket, one RTX 4090 carries the short
    requests and an A100 the long ones (3.50)."""
    mean = plan_fleet(inventory(tmp_path, catalog, mean_only(BUCKETED)), objective="cost")
    assert {d.gpu_type for d in mean.deployments} == {"A100-SXM4-80GB"}
    plan = plan_fleet(inventory(tmp_path, catalog, BUCKETED), objective="cost")
    assert plan.cost_per_hour is not None and mean.cost_per_hour is not None
    assert plan.cost_per_hour < mean.cost_per_hour
    assert plan.cost_per_hour == pytest.approx(3.5)
    m = plan.models[0]
    short, long = m.buckets
    assert {k for k, _ in short.served_by} == {"RTX-4090 bf16 TP=1"}
    assert {k for k, _ in long.served_by} == {"A100-SXM4-80GB bf16 TP=1"}
    assert sum(r for _, r in short.served_by) == pytest.approx(0.96)
    assert sum(r for _, r in long.served_by) == pytest.approx(1.44)
    assert m.shortfall_rps == 0
    # Each server's capacity is for the requests it carries, and covers them at 80%.
    caps = {d.gpu_type: d.capacity_rps for d in plan.deployments}
    assert caps["RTX-4090"] * 0.8 >= 0.96 and caps["A100-SXM4-80GB"] * 0.8 >= 1.44 - 1e-9
    rtx = next(d for d in plan.deployments if d.gpu_type == "RTX-4090")
    assert any("carry: 100/300 100%" in r for r in rtx.server.reasons), rtx.server.reasons
    data = plan.to_json()["models"][0]["buckets"]
    assert data[0]["served_by"] == {"RTX-4090 bf16 TP=1": 0.96}
    # The throughput objective plans the mean shape, buckets or not.
    fast = plan_fleet(inventory(tmp_path, catalog, BUCKETED), objective="throughput")
    assert not fast.models[0].buckets
    assert {d.gpu_type for d in fast.deployments} == {"A100-SXM4-80GB"}


def test_a_mean_only_workload_plans_as_one_bucket_of_its_mean(tmp_path, catalog):
    """Without buckets the program is the one it always was; one bucket of the mean shape
    carries the same workload. Each server's capacity for a bucket is its share of the
    goodput at the SLO on the bucket's requests, as its capacity is on the whole workload:
    one bucket of the mean request gets the figure the plain program weighs it by (by its
    mean request at saturation, capped by the SLO, it got 17% more on the A100s)."""
    plain = plan_fleet(inventory(tmp_path, catalog), objective="cost")
    assert plain.models[0].buckets == () and plain.to_json()["models"][0]["buckets"] == []
    one = with_buckets(
        FLEET, "share: 1, mean_prompt_tokens: 1500, mean_output_tokens: 300, max_tokens: 8192"
    )
    same = plan_fleet(inventory(tmp_path, catalog, one), objective="cost")
    assert plain.models[0].capacity_basis == "goodput" and plain.models[0].shortfall_rps == 0
    assert plain.models[0].capacity_rps * 0.8 >= 8.0
    (bucket,) = same.models[0].buckets
    assert sum(r for _, r in bucket.served_by) == pytest.approx(8.0)
    assert same.models[0].shortfall_rps == 0
    from fleetctl.planner.candidates import candidates, node_classes

    inv = inventory(tmp_path, catalog, one)
    found, _ = candidates(inv, node_classes(inv))
    assert found and all(k.slo is not None for k in found)
    for k in found:
        assert k.bucket_capacity == (pytest.approx(k.capacity_rps),), k.cls.gpu.name


def test_a_bucket_longer_than_a_servers_max_model_len_never_lands_there(tmp_path, catalog):
    """min_context: the 4090s hold 4 sequences of 11264 tokens, not of 32768. Even at a
    tenth of a cent an hour they take the short bucket only; the bucket whose requests run
    to 20,000 tokens goes to A100s at 10.00."""
    text = (
        with_buckets(
            priced(10.0, 0.001, FLEET),
            "share: 0.85, mean_prompt_tokens: 600, mean_output_tokens: 200, max_tokens: 4000",
            "share: 0.15, mean_prompt_tokens: 9000, mean_output_tokens: 300, max_tokens: 20000",
        )
        .replace(
            "    max_context: 8192\n",
            "    max_context: 32768\n    min_context: 4096\n    min_sequences: 4\n",
        )
        .replace("profile: llama-3-8b", "profile: llama-3.1-8b")
    )
    plan = plan_fleet(inventory(tmp_path, catalog, text), objective="cost")
    lengths = {d.gpu_type: d.server.max_model_len for d in plan.deployments}
    assert lengths["RTX-4090"] < 20000 <= lengths["A100-SXM4-80GB"]
    short, long = plan.models[0].buckets
    assert all(k.startswith("A100") for k, _ in long.served_by), long.served_by
    assert sum(r for _, r in long.served_by) == pytest.approx(0.15 * 8)
    assert any(k.startswith("RTX-4090") for k, _ in short.served_by), short.served_by
    rtx = next(d for d in plan.deployments if d.gpu_type == "RTX-4090")
    assert any("not 9000/300: requests longer than max_model_len" in r for r in rtx.server.reasons)


def test_bucket_shares_must_add_up(cli, tmp_path):
    bad = with_buckets(
        FLEET, "share: 0.5, mean_prompt_tokens: 100, mean_output_tokens: 10, max_tokens: 200"
    )
    r = cli("validate", write(tmp_path, bad))
    assert r.code == 2 and "add up to 0.500" in r.err, r.err


def test_workload_from_traffic_splits_it_into_length_buckets(cli, tmp_path):
    """`plan --workload-from`: four buckets (prompt halves x output halves) whose shares
    add up to 1 and whose rates the cost plan places."""
    trace = DATA / "azure_conv_slice.csv"
    args = ("plan", write(tmp_path, FLEET), "--state-dir", tmp_path / "s", "--json")
    r = cli(*args, "--workload-from", trace, "--objective", "cost")
    assert r.code == 0, r.err
    plan = json.loads(r.out)
    derived = plan["workloads"]["llama-3-8b"]["buckets"]
    assert len(derived) == 4 and sum(b["share"] for b in derived) == pytest.approx(1)
    assert derived[0]["mean_prompt_tokens"] < derived[2]["mean_prompt_tokens"]
    assert derived[0]["mean_output_tokens"] < derived[1]["mean_output_tokens"]
    used = plan["models"][0]["buckets"]
    assert len(used) == 4 and plan["models"][0]["shortfall_rps"] == 0
    rate = plan["models"][0]["demand_rps"]
    assert sum(b["requests_per_s"] for b in used) == pytest.approx(rate, rel=1e-3)
    for b in used:
        assert sum(b["served_by"].values()) == pytest.approx(b["requests_per_s"], rel=1e-2)
