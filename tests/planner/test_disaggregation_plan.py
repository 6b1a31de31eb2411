"""The planner's prefill/decode split: where it pays (a mixed fleet, long prompts, a fast
network, an SLO) it splits and says why in numbers; where it does not (a slow network and a
tight first token, short prompts, one GPU type, no SLO, no network known) it keeps the
servers colocated and says why. Roles reach plan --json, the flags and the environment."""

from __future__ import annotations

import json

import pytest

from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.fleet.state import State
from fleetctl.planner import plan_fleet
from fleetctl.planner.disaggregate import Link, Pool, colocated, decode_rate, prefill_rate
from tests.conftest import REPO, write

SEED = (REPO / "inventory" / "seed-mixed-8b.yaml").read_text()
SLOW_TTFT = "{ttft_p99_s: 1.4, tpot_p99_ms: 50}"
WORKLOAD = "    workload: {requests_per_s: 20, mean_prompt_tokens: 1500, mean_output_tokens: 300}\n"


def fleet(
    gbps: float | None = 100,
    rdma: bool = True,
    slo: str | None = "{ttft_p99_s: 4, tpot_p99_ms: 50}",
    prompt: int = 1500,
    mode: str | None = None,
) -> str:
    """The seed fleet (4 A100s, 8 RTX 4090s) with a network, an SLO and a prompt length."""
    text = SEED
    if gbps is not None:
        net = f"\n    network: {{gbps: {gbps}, rdma: {str(rdma).lower()}}}"
        for gpu in ("A100-SXM4-80GB", "RTX-4090"):
            line = f"    gpus: {{type: {gpu}, count: 1}}"
            text = text.replace(line, line + net)
    extra = f"    slo: {slo}\n" if slo else ""
    extra += f"    disaggregation: {mode}\n" if mode else ""
    workload = WORKLOAD.replace("1500", str(prompt))
    assert WORKLOAD in text
    return text.replace(WORKLOAD, workload + extra)


def planned(tmp_path, catalog, text: str):  # type: ignore[no-untyped-def]
    return plan_fleet(load_inventory(write(tmp_path, text), catalog))


def test_a_mixed_fleet_on_a_fast_network_splits_and_says_why(tmp_path, catalog, cli):
    plan = planned(tmp_path, catalog, fleet())
    roles = {(d.gpu_type, d.server.role) for d in plan.deployments}
    # The 4090s prefill (compute-bound, their small KV cache held only until it is sent);
    # the A100s decode (their large KV caches hold many sequences, no prompt stalls them).
    assert ("RTX-4090", "prefill") in roles and ("A100-SXM4-80GB", "decode") in roles
    (summary,) = plan.models
    g = summary.disaggregation
    assert g is not None and g.chosen
    assert g.prefill_servers + g.decode_servers == 12 and g.prefill_servers >= 8
    assert g.split_rps is not None and g.split_rps >= 1.2 * g.colocated_rps
    assert summary.capacity_rps == pytest.approx(g.split_rps)
    assert g.transfer_s is not None and 0 < g.transfer_s < 0.1  # 1,500 tokens over 100 Gb
    # The flags vLLM takes for each role, the side channel on the node's address.
    prefill = next(d for d in plan.deployments if d.server.role == "prefill")
    decode = next(d for d in plan.deployments if d.server.role == "decode")
    config = json.loads(prefill.vllm_args[prefill.vllm_args.index("--kv-transfer-config") + 1])
    assert config == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    assert '"kv_role":"kv_consumer"' in " ".join(decode.vllm_args)
    env = dict(prefill.env)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == prefill.host
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(prefill.port + 6000)
    # plan --json: every deployment's role; the choice with both ways' figures.
    path = write(tmp_path, fleet())
    out = json.loads(cli("plan", path, "--json").out)
    assert {d["role"] for d in out["deployments"]} == {"prefill", "decode"}
    assert out["models"][0]["disaggregation"]["chosen"] is True
    assert any(
        "NIXL side channel" in w and "authenticated or encrypted" in w for w in out["warnings"]
    )
    text = cli("plan", path, "--explain").out
    assert "prefill + " in text and "decode servers" in text and "colocated" in text
    assert "prefill server of llama-3-8b's split" in text


def test_a_split_reads_back_from_state_and_keeps_its_prefill_slots(tmp_path, catalog):
    inv = load_inventory(write(tmp_path, fleet()), catalog)
    plan = plan_fleet(inv)
    state = State(1, plan.deployments)
    back = State.from_json(json.loads(json.dumps(state.to_json())))
    for old, new in zip(plan.deployments, back.deployments, strict=True):
        assert new.server.role == old.server.role
        assert new.vllm_args == old.vllm_args and new.env == old.env
        assert new.args_hash == old.args_hash
    # Planned again against that state: nothing changes, the same slots prefill.
    again = plan_fleet(inv, back)
    assert all(a.op == "keep" for a in again.actions)
    assert {d.key for d in again.deployments if d.server.role == "prefill"} == {
        d.key for d in plan.deployments if d.server.role == "prefill"
    }


@pytest.mark.parametrize(
    ("text", "why"),
    [
        # 10 GbE without RDMA: a 3,000-token prompt's KV cache (393 MB) takes 0.45 s to move,
        # so no prefill server's first token stays within the 1.4 s objective's share (0.7 s);
        # the same fleet on 100 Gb RDMA splits (test_the_network_decides).
        (
            fleet(gbps=10, rdma=False, slo=SLOW_TTFT, prompt=3000),
            "puts the first token",
        ),
        (fleet(prompt=100, slo="{ttft_p99_s: 16, tpot_p99_ms: 100}"), "less than 1.2x"),
    ],
    ids=["slow-network", "short-prompts"],
)
def test_where_a_split_does_not_pay_the_servers_stay_colocated_and_it_says_why(
    tmp_path, catalog, text, why
):
    plan = planned(tmp_path, catalog, text)
    assert {d.server.role for d in plan.deployments} == {"both"}
    (summary,) = plan.models
    assert summary.disaggregation is not None and not summary.disaggregation.chosen
    assert why in summary.disaggregation.reason
    assert not any(d.server.kv_transfer for d in plan.deployments)


def test_a_model_with_no_stated_slo_is_split_by_its_derived_one(tmp_path, catalog):
    """Every model has an SLO: with none stated, `auto` weighs the split by the derived one
    (the planner's, from the slowest class that can hold the model), not "no SLO"."""
    plan = planned(tmp_path, catalog, fleet(slo=None))
    g = plan.models[0].disaggregation
    assert g is not None and g.chosen, g
    assert "within the SLO" in g.reason and "no SLO" not in g.reason
    assert {d.server.role for d in plan.deployments} == {"prefill", "decode"}


def test_the_network_decides(tmp_path, catalog):
    fast = planned(tmp_path, catalog, fleet(gbps=100, slo=SLOW_TTFT, prompt=3000))
    g = fast.models[0].disaggregation
    assert g is not None and g.chosen and g.transfer_s is not None and g.transfer_s < 0.1


def test_one_gpu_type_stays_colocated_unless_told(tmp_path, catalog):
    one = fleet().replace("type: RTX-4090", "type: A100-SXM4-80GB")
    plan = planned(tmp_path, catalog, one)
    assert plan.models[0].disaggregation is not None
    assert "one GPU type" in plan.models[0].disaggregation.reason
    forced = planned(
        tmp_path, catalog, fleet(mode="on").replace("type: RTX-4090", "type: A100-SXM4-80GB")
    )
    roles = [d.server.role for d in forced.deployments]
    assert roles.count("prefill") >= 1 and roles.count("decode") >= 1


def test_without_a_network_or_with_it_off_nothing_changes(tmp_path, catalog):
    """No network known: the plan is what it was before splits existed, with no choice
    weighed; `off` likewise, whatever the network."""
    before = planned(tmp_path, catalog, fleet(gbps=None))
    off = planned(tmp_path, catalog, fleet(mode="off"))
    for plan in (before, off):
        assert {d.server.role for d in plan.deployments} == {"both"}
        assert plan.models[0].disaggregation is None
    assert [d.record() for d in before.deployments] == [d.record() for d in off.deployments]


def test_the_side_channel_ports_must_fit_and_not_collide(cli, tmp_path):
    text = fleet().replace(
        "planner:\n", "planner:\n  kv_transfer: {side_channel_port_offset: 1000}\n"
    )
    r = cli("validate", write(tmp_path, text))
    assert r.code == 2 and "side_channel_port_offset 1000" in r.err, r.err
    assert "replacement server ports" in r.err


def a100_pool(catalog) -> Pool:  # type: ignore[no-untyped-def]
    """One A100 80GB server of Llama-3 8B in BF16 on a 100 Gb RDMA network."""
    from fleetctl.model.perf import EnginePerf, kv_budget

    gpu, model, fmt = (
        catalog.gpu("A100-SXM4-80GB"),
        catalog.model("llama-3-8b"),
        catalog.format("bf16"),
    )
    kv = kv_budget(gpu, model, fmt, gpu_memory_utilization=0.9).kv_tokens
    return Pool(0, "A100", 1, EnginePerf(gpu, model, fmt), kv, 256, Link(100, True))


def test_the_pools_rates_follow_the_model(catalog):
    """Prefill-only servers take prompts at their compute speed, decode-only ones at the
    batch their KV cache holds, and a colocated server within a TPOT objective less than
    either: each prompt it takes stalls its decodes."""
    pool = a100_pool(catalog)
    perf = pool.perf
    assert prefill_rate(pool, 3000) < prefill_rate(pool, 1000)
    assert decode_rate(pool, 1000, 300, 0.05) < decode_rate(pool, 1000, 300, None)
    small = Pool(0, "A100", 1, perf, 20_000, 256, Link(100, True))
    assert decode_rate(small, 1000, 300, None) < decode_rate(pool, 1000, 300, None)
    tight = colocated(pool, 3000, 300, 0.04).rate
    loose = colocated(pool, 3000, 300, 0.2).rate
    assert 0 < tight < loose
    assert Link(10).seconds(1e9) > Link(100).seconds(1e9) > Link(100, True).seconds(1e9)
    # A deployment of each role round-trips through its record.
    assert Deployment.of is not None


def test_probed_nics_give_the_network_where_the_inventory_gives_none(tmp_path, catalog, cli):
    """`probe` reads each node's fastest physical NIC that is up (/sys/class/net/*/speed, in
    Mb/s; -1 where the driver does not say) and whether it has RDMA devices; the planner
    uses them where the inventory has no network, and the inventory's wins where it has."""
    from fleetctl.fleet.facts import Facts, NodeFacts, apply_facts
    from fleetctl.fleet.facts_parse import network_gbps

    assert network_gbps("-1 25000 100000 ") == 100.0
    assert network_gbps("-1 ") is None and network_gbps(None) is None
    inv = load_inventory(write(tmp_path, fleet(gbps=None)), catalog)
    probed = {n.name: NodeFacts(network_gbps=100.0, rdma=True) for n in inv.nodes}
    with_facts, _ = apply_facts(inv, Facts(probed), catalog)
    assert all(n.network is not None and n.network.rdma for n in with_facts.nodes)
    assert plan_fleet(with_facts).models[0].disaggregation is not None
    declared = load_inventory(write(tmp_path, fleet(gbps=10, rdma=False)), catalog)
    kept, _ = apply_facts(declared, Facts(probed), catalog)
    assert {n.network.gbps for n in kept.nodes if n.network} == {10}
    # A facts file with the new keys reads back.
    doc = Facts(probed).to_json()
    assert Facts.from_json(json.loads(json.dumps(doc))).nodes["rtx-1"].network_gbps == 100.0


def test_the_diff_names_a_role_change(tmp_path, catalog):
    colo = load_inventory(write(tmp_path, fleet(mode="off")), catalog)
    before = plan_fleet(colo)
    split = load_inventory(write(tmp_path, fleet()), catalog)
    after = plan_fleet(split, State(1, before.deployments))
    changed = [a for a in after.actions if a.op == "replace"]
    assert changed and all(a.detail.startswith("role both -> ") for a in changed)
    assert any("role both -> prefill" in a.detail for a in changed)


def test_the_tpot_objective_is_held_at_its_tail_not_at_half_the_mean(catalog):
    """A colocated server's TPOT objective (a p99) holds at the tail of the prompts that stall
    a request's steps, not at half the objective on the mean: the rate it gives has a mean TPOT
    past half the objective (the old rule's cap, which planned half what the simulator serves),
    its tail within the objective, and a slightly higher rate breaks it."""
    import math

    from fleetctl.planner.disaggregate import TPOT_QUANTILE, poisson_quantile

    pool = a100_pool(catalog)
    perf = pool.perf
    prompt, output, objective = 1155, 211, 0.05  # the Azure conversation trace's mean request
    t_prefill = perf.prefill_marginal(prompt)
    ctx = prompt + output / 2

    def mean_and_tail(rate: float) -> tuple[float, float]:
        busy = rate * t_prefill
        t = perf.step_time(1, ctx) / (1 - busy)
        for _ in range(60):
            batch = rate * output * t
            t = perf.step_time(max(1, math.ceil(batch)), max(1.0, batch) * ctx) / (1 - busy)
        high = poisson_quantile(rate * output * t, TPOT_QUANTILE)
        tail = perf.step_time(high, high * ctx) + high * t_prefill / output
        return t, tail

    rate = colocated(pool, prompt, output, objective).rate
    mean, tail = mean_and_tail(rate)
    assert mean > objective / 2, (rate, mean)
    assert tail <= objective * 1.01  # the fixed point here iterates a little differently
    assert mean_and_tail(rate * 1.05)[1] > objective
    # The quantile is Poisson's: P(N <= k) first reaches q at k.
    assert [poisson_quantile(m, 0.99) for m in (0, 0.5, 4, 30)] == [
        0,
        3,
        9,
        43,
    ]  # scipy.stats.poisson.ppf
    assert poisson_quantile(1000, 0.99) == math.ceil(1000 + 2.3263 * math.sqrt(1000))


MOONCAKE = (REPO / "inventory" / "mooncake-mixed.yaml").read_text()
# The Mooncake conversation trace's workload as `plan --workload-from` derives it: 7% of its
# prompts are longer than the 4090s' 47,104 tokens, so only the A100s prefill them.
MOONCAKE_WORKLOAD = (
    "    workload: {requests_per_s: 3.73, mean_prompt_tokens: 12035, mean_output_tokens: 343,\n"
    "               prompt_tokens_p50: 6909, prompt_tokens_p90: 27367,"
    " prompt_tokens_p99: 85401,\n"
    "               max_prompt_tokens: 126195, output_tokens_p50: 350,"
    " output_tokens_p90: 597,\n"
    "               output_tokens_p99: 1120, burstiness: 2.32}\n"
)


def mooncake(slo: str, mode: str = "auto") -> str:
    """`example:mooncake-mixed` (4 A100s, 14 RTX 4090s) on 100 Gb RDMA, its trace's lengths
    and bursts, an SLO and a disaggregation mode."""
    text = MOONCAKE
    for gpu in ("A100-SXM4-80GB", "RTX-4090"):
        line = f"    gpus: {{type: {gpu}, count: 1}}"
        assert line in text
        text = text.replace(line, line + "\n    network: {gbps: 100, rdma: true}")
    start = text.index("    workload:")
    end = text.index("\n", start) + 1
    extra = f"    slo: {slo}\n    disaggregation: {mode}\n"
    return text[:start] + MOONCAKE_WORKLOAD + extra + text[end:]


def test_a_split_is_weighed_by_goodput_on_the_lengths_only_one_class_holds(tmp_path, catalog):
    """A split is chosen by its goodput against the colocated servers' (the capacity `plan`
    prints), on the workload's lengths, not by the mean request: on Mooncake's lengths the
    prompts past the 4090s' context prefill only on the A100s, so the split's promised rate
    must leave that tail's prefill within its A100 prefill servers; and where no arrangement
    serves the SLO's share at any rate (6% of prompts take over 8 s to prefill alone on an
    A100), the servers stay colocated."""
    from fleetctl.planner.candidates import request_shape
    from fleetctl.planner.queueing import traffic_of
    from fleetctl.sim.fleet import servers_from_plan

    impossible = planned(tmp_path, catalog, mooncake("{ttft_p99_s: 8, tpot_p99_ms: 50}"))
    g = impossible.models[0].disaggregation
    assert g is not None and not g.chosen, g
    assert "no split serves 99% of requests within the SLO" in g.reason
    assert {d.server.role for d in impossible.deployments} == {"both"}

    # The objectives derived for this fleet: both arrangements serve some rate within them.
    slo = "{ttft_p99_s: 30, tpot_p99_ms: 110}"
    inv = load_inventory(write(tmp_path, mooncake(slo)), catalog)
    plan = plan_fleet(inv)
    colocated_rps = planned(tmp_path, catalog, mooncake(slo, "off")).models[0].capacity_rps
    g = plan.models[0].disaggregation
    assert g is not None and colocated_rps > 0
    assert g.colocated_rps == pytest.approx(colocated_rps)
    if not g.chosen:
        return
    assert plan.models[0].capacity_rps == pytest.approx(g.split_rps)
    assert g.split_rps is not None and g.split_rps >= 1.2 * colocated_rps
    # The prefill seconds a request brings the A100s: its share of the prompts no 4090 holds.
    model = inv.models[0]
    servers = servers_from_plan(plan.deployments, inv)
    a100 = next(s for s in servers if s.gpu_type == "A100-SXM4-80GB")
    rtx = next(s for s in servers if s.gpu_type == "RTX-4090")
    tail = sum(
        share * a100.perf.prefill_time(p)
        for share, p, o in traffic_of(model, request_shape(model)).points
        if p + o > rtx.max_model_len
    )
    a100_prefill = sum(1 for s in servers if s.gpu_type == a100.gpu_type and s.role == "prefill")
    assert g.split_rps * tail < a100_prefill, (g.split_rps, tail, a100_prefill)


def test_a_decode_servers_kv_cache_holds_the_batchs_own_lengths(catalog):
    """A decode server's KV cache must hold the lengths of the requests it is decoding, not
    their count times the mean request: on Mooncake's lengths (the p99 prompt seven times the
    mean) the batch an A100 holds at its p99 is far smaller than the mean request's count
    says; with every request the mean length it is the count's quantile as before; and the
    server's rate within the TPOT objective falls with it."""
    from fleetctl.planner.candidates import request_shape
    from fleetctl.planner.disaggregate import TPOT_QUANTILE, kv_batch, lengths, poisson_quantile
    from fleetctl.planner.queueing import traffic_of

    pool = a100_pool(catalog)
    model = load_inventory_text(catalog, mooncake("{ttft_p99_s: 30, tpot_p99_ms: 110}"))
    prompt, output = request_shape(model)
    held = lengths(traffic_of(model, (prompt, output)))
    mean = round(sum(share * tokens for share, tokens in held))
    by_mean = pool.kv_tokens // mean
    heavy = kv_batch(pool.kv_tokens, held, TPOT_QUANTILE)
    # One length: the count's quantile times it, as the mean request's sizing had it.
    even = kv_batch(pool.kv_tokens, ((1.0, mean),), TPOT_QUANTILE)
    assert poisson_quantile(even, TPOT_QUANTILE) <= by_mean < poisson_quantile(even + 1, 0.99)
    assert heavy < 0.75 * even, (heavy, even)
    one = decode_rate(pool, prompt, output, 0.11)
    tail = decode_rate(pool, prompt, output, 0.11, held=held)
    assert tail < 0.9 * one, (tail, one)
    assert decode_rate(pool, prompt, output, 0.11, held=((1.0, prompt + output),)) == one


def test_a_split_that_serves_more_at_the_share_but_less_past_it_stays_colocated(tmp_path, catalog):
    """Mooncake at the SLO derived for its fleet (TTFT 30 s, TPOT 110 ms) on 100 Gb: one A100
    decoding everything serves the SLO's 99% at a higher rate than colocated servers, but
    its KV cache cannot hold the heavy tail's requests in flight much past that, and at the
    workload's own rate it serves far fewer within the SLO (the simulator: 91.6% against
    97.8% at 2.54 req/s, 81.5% against 94.7% at 3.38, on 1,000 of the trace's requests). The
    planner sizes the decode KV on the lengths, so the split's promise drops (the simulator
    served 98.8% at 1.73 req/s and 97.8% at the 1.98 it promised before), and keeps the
    servers colocated, saying at which rate the split falls short. (The colocated servers
    keep vLLM's step budget, as when this was measured: a smaller one serves more colocated,
    and the split then falls short of 1.2x before this is weighed.)"""
    text = mooncake("{ttft_p99_s: 30, tpot_p99_ms: 110}")
    plan = planned(tmp_path, catalog, text + "planner: {max_num_batched_tokens: 2048}\n")
    g = plan.models[0].disaggregation
    assert g is not None and not g.chosen, g
    assert {d.server.role for d in plan.deployments} == {"both"}
    assert g.split_rps is not None and g.split_rps < 1.8, g  # was 1.98
    assert "past that it serves fewer within it" in g.reason, g.reason
    assert plan.models[0].capacity_rps == pytest.approx(g.colocated_rps)


def load_inventory_text(catalog, text: str):  # type: ignore[no-untyped-def]
    """The one model of an inventory given as text."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        return load_inventory(write(Path(d), text), catalog).models[0]


def test_a_split_on_bursty_traffic_counts_the_transfers_its_nics_queue(tmp_path, catalog):
    """On 10 GbE a 2,048-token prompt's KV takes 0.31 s to move, so four decode nodes
    receive at most 13 prompts a second; the Azure code trace's bursts (an index of
    dispersion of 134: bursts ten times its mean rate) queue them past the first token's
    objective, and the servers stay colocated (the simulator served 90% within both at 2.92
    req/s split against 3.38 colocated). A split that counted the links at the mean rate
    only claimed 7.62 req/s against 2.87."""
    workload = (
        "    workload: {requests_per_s: 4.0, mean_prompt_tokens: 2048, mean_output_tokens: 28,\n"
        "               prompt_tokens_p50: 1469, prompt_tokens_p90: 5194,"
        " prompt_tokens_p99: 7436,\n"
        "               max_prompt_tokens: 7437, output_tokens_p50: 13, output_tokens_p90: 55,\n"
        "               output_tokens_p99: 252, burstiness: 134}\n"
    )
    text = fleet(gbps=10, rdma=False, slo="{ttft_p99_s: 4, tpot_p99_ms: 100}")
    text = text.replace(WORKLOAD, workload)
    assert "burstiness: 134" in text
    g = planned(tmp_path, catalog, text).models[0].disaggregation
    assert g is not None and not g.chosen, g
    assert g.split_rps is not None and g.split_rps < 1.2 * g.colocated_rps
