"""A LoRA-enabled server's capacity counts its adapters' kernels: the one performance model's
expected step for the adapters its traffic asks for, in the planner and in `simulate --load`."""

from __future__ import annotations

import dataclasses

import pytest

from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.model.lora import LoraMix, LoraPerf
from fleetctl.model.perf import EnginePerf, max_sequences
from fleetctl.planner import lora as planner_lora
from fleetctl.planner.candidates import evaluate, node_classes, request_shape
from fleetctl.planner.place import plan_fleet
from fleetctl.sim.compare import compare, mean_shape
from fleetctl.sim.fleet import servers_from_plan
from fleetctl.sim.workload import WorkItem
from tests.conftest import write
from tests.planner.test_lora import GOOD


def test_a_lora_servers_capacity_is_less_by_its_adapters_step_cost():
    c = load_catalog()
    perf = EnginePerf(c.gpu("RTX-4090"), c.model("llama-3-8b"), c.format("fp8"))
    mix = LoraMix((0.5, 0.2, 0.1), max_loras=2, max_rank=16)
    with_lora = dataclasses.replace(perf, lora_mix=mix)
    prompt, output, kv, seqs = 1000, 200, 60_000, 256
    base = perf.capacity_rps(prompt, output, kv, seqs)
    lora = with_lora.capacity_rps(prompt, output, kv, seqs)
    assert 0 < lora < base
    # Each request pays its share of the adapters' extra on every decode step (the expected
    # distinct adapters of the batch, at most --max-loras, and the 80% of its tokens that
    # run one) and its prompt's LoRA products.
    costs = LoraPerf(perf, 16)
    batch = min(seqs, max_sequences(kv, prompt + output))
    adapters = min(2.0, sum(1 - (1 - p) ** batch for p in mix.shares))
    step = costs.step_s(adapters, 0.8 * batch)
    prefill = 0.8 * prompt * costs.token_s
    assert 1 / lora - 1 / base == pytest.approx(output * step / batch + prefill, rel=1e-6)
    # Without requests for adapters a server runs the base model's steps.
    assert LoraMix.of([0.0], 2, 16) is None


def _items(n: int) -> list[WorkItem]:
    names = ["support-en", None, "sql", "support-en", "legal-de"]
    return [
        WorkItem(i, i * 0.1, 900 + 20 * (i % 9), 150 + i % 7, "llama-3-8b", adapter=names[i % 5])
        for i in range(n)
    ]


def test_simulate_load_is_a_share_of_the_capacity_with_the_adapters_kernels(tmp_path):
    inv = load_inventory(write(tmp_path, GOOD), load_catalog())
    plan = plan_fleet(inv)
    items = _items(200)
    c = compare(inv, plan, "llama-3-8b", items, ["round-robin"], load=0.5)
    servers = [s for s in servers_from_plan(plan.deployments, inv) if s.model == "llama-3-8b"]
    prompt, output = mean_shape(items)
    base = sum(
        s.perf.capacity_rps(prompt, output, s.kv_tokens, s.max_num_seqs, s.max_num_batched_tokens)
        for s in servers
    )
    assert all(s.lora is not None for s in servers)
    assert c.capacity_rps < 0.97 * base
    assert c.offered_rps == pytest.approx(0.5 * c.capacity_rps, rel=1e-6)
    # A trace that names no adapter runs none of their kernels.
    plain = [dataclasses.replace(w, adapter=None) for w in items]
    assert compare(inv, plan, "llama-3-8b", plain, ["round-robin"], load=0.5).capacity_rps == (
        pytest.approx(base)
    )


def test_the_plans_capacity_of_a_lora_server_counts_its_adapters_kernels(tmp_path):
    """Without an SLO the candidate's capacity is saturation's: the same server's without
    adapters' less their kernels, at the shares the inventory states (support-en 2 of the
    model's 5 req/s; the other 3 spread over the adapters without a demand)."""
    inv = load_inventory(write(tmp_path, GOOD), load_catalog())
    model = inv.models[0]
    rtx = next(k for k in node_classes(inv) if k.gpu.name == "RTX-4090")
    mix = planner_lora.mix(model, "RTX-4090", 2)
    # Every request is an adapter's (some state no demand); legal-de, pinned to the A100,
    # takes half the unstated 0.6, and a 4090 serves the rest: support-en's 0.4, sql's 0.3.
    assert mix is not None and mix.shares == pytest.approx((0.4 / 0.7, 0.3 / 0.7))
    k = evaluate(rtx, model, model.variants[0], 1, inv)
    assert k.perf.lora_mix == mix
    prompt, output = request_shape(model)
    bare = dataclasses.replace(k.perf, lora_mix=None)
    without = bare.capacity_rps(prompt, output, k.budget.kv_tokens, k.max_num_seqs)
    assert k.capacity_rps == pytest.approx(
        k.perf.capacity_rps(prompt, output, k.budget.kv_tokens, k.max_num_seqs)
    )
    assert k.capacity_rps < 0.97 * without


def test_an_adapters_capacity_at_its_slo_counts_its_kernels_in_every_step(tmp_path):
    """`plan`'s capacity of an adapter at its own SLO (support-en: 1 s TTFT, 60 ms TPOT) is
    its servers serving it alone: below the same servers' figure without LoRA kernels."""
    from fleetctl.planner.adapters import lora_summary

    inv = load_inventory(write(tmp_path, GOOD), load_catalog())
    model = inv.models[0]
    rtx = next(k for k in node_classes(inv) if k.gpu.name == "RTX-4090")
    k = evaluate(rtx, model, model.variants[0], 1, inv)
    bare = dataclasses.replace(k, perf=dataclasses.replace(k.perf, lora_mix=None))
    (support, *_), (plain, *_) = (lora_summary(model, [(c, 2)])[1] for c in (k, bare))
    assert support.name == plain.name == "support-en"
    assert support.capacity_rps is not None and plain.capacity_rps is not None
    assert 0 < support.capacity_rps < 0.97 * plain.capacity_rps
