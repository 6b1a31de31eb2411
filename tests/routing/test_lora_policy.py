"""Hardware-aware with LoRA adapters: a server whose GPU slots do not hold a request's adapter
is predicted a later first token by its load (and by the wait for a slot when all are busy),
so the adapter's requests go where it is warm, unless that server would be slower still."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetctl.model.lora import LoraPerf
from fleetctl.model.perf import EnginePerf
from fleetctl.routing.policy import HardwareAware
from fleetctl.routing.types import Backend, Request


def backend(perf: EnginePerf, name: str, running: frozenset[str], slots: int = 2) -> Backend:
    return Backend(
        name,
        name,
        "A100-SXM4-80GB",
        "m",
        "bf16",
        400_000,
        perf=perf,
        adapters=frozenset({"sql", "a", "b"}),
        lora_running=running,
        lora_max=slots,
        lora_rank=64,
    )


@pytest.fixture
def perf(catalog) -> EnginePerf:
    g, m, f = catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3-8b"), catalog.format("bf16")
    return EnginePerf(g, m, f)


def test_an_adapters_load_and_slot_wait_count_in_the_predicted_first_token(perf):
    warm = backend(perf, "warm", frozenset({"sql"}))
    cold = backend(perf, "cold", frozenset())
    busy = backend(perf, "busy", frozenset({"a", "b"}))
    req = Request(0, "m", 1000, 100, adapter="sql")
    policy = HardwareAware()
    t_warm, t_cold, t_busy = (policy.estimate(b, req) for b in (warm, cold, busy))
    # The copy of a rank-64 slot's adapter from the CPU cache over PCIe (model/lora.py).
    assert t_cold - t_warm == pytest.approx(LoraPerf(perf, 64).activate_s(64))
    # Both slots hold adapters with requests running: it waits for one to drain first.
    assert t_busy - t_cold > 0.1
    # A base-model request waits for no load or slot: it pays only the kernels of the
    # adapters running in the step it joins (sql's on "warm").
    base = Request(1, "m", 1000, 100)
    kernels = LoraPerf(perf, 64).step_s(1, 1)
    assert policy.estimate(warm, base) - policy.estimate(cold, base) == pytest.approx(kernels)


def test_the_adapters_kernels_count_in_its_step_and_only_their_growth_in_the_others(perf):
    """The predicted decode step counts the kernels of the adapters running there, the
    request's own among them (model/lora.py); the seconds it adds to the requests there count
    only what it adds to their step: its tokens, and a new adapter's read, never the kernels
    they ran before it came (counting those made every server running adapters look costly
    to join, and sent hardware-aware's share within the objectives down on
    benchmarks/lora.py: 87.3% to 83.8% at 70% load)."""
    lora = LoraPerf(perf, 64)
    plain = replace(backend(perf, "plain", frozenset()), outstanding=4)
    running = replace(backend(perf, "running", frozenset({"sql"})), outstanding=4)
    policy = HardwareAware()
    base, sql, new = (Request(i, "m", 1000, 100, adapter=a) for i, a in enumerate(["", "sql", "a"]))
    # Its own step: five sequences, one adapter running.
    joined = policy.predict(running, sql).tpot_s - policy.predict(plain, base).tpot_s
    assert joined == pytest.approx(lora.step_s(1, 5))
    # What it adds to the four there: its own tokens' products, not sql's fixed cost.
    added = policy.predict(running, sql).others_added_s - policy.predict(plain, base).others_added_s
    assert added == pytest.approx(lora.token_s * 100)
    # Another adapter (a slot is free) adds its weights' read to each of their steps too.
    more = policy.predict(running, new).others_added_s - policy.predict(running, sql).others_added_s
    assert more == pytest.approx(lora.slot_read_s * 100)


def test_an_adapter_goes_where_it_is_warm_unless_that_server_is_slower(perf):
    warm = backend(perf, "warm", frozenset({"sql"}))
    busy = backend(perf, "busy", frozenset({"a", "b"}))
    req = Request(0, "m", 1000, 100, adapter="sql")
    policy = HardwareAware()
    # "busy" sorts first by name: only the slot wait sends it to "warm".
    assert policy.choose(req, [busy, warm]).backend is warm
    # With seconds of prompts queued on the warm server, the wait for a slot is cheaper.
    piled = replace(warm, pending_prefill=40_000)
    assert policy.choose(req, [busy, piled]).backend is busy


def test_route_serve_takes_each_servers_slot_rank_from_its_arguments(tmp_path):
    """A recorded server's --max-lora-rank (the plan's: the A100s hold the rank-64 adapter,
    the 4090s rank 16) is its backend's lora_rank, the rank its loads are predicted at."""
    from fleetctl.daemon.adapters import lora_rank
    from fleetctl.daemon.backends import backends_from_state
    from fleetctl.fleet.inventory import load_inventory
    from fleetctl.fleet.statedir import StateDir
    from fleetctl.model.catalog import load_catalog
    from tests.conftest import record_the_plan_as_applied, write
    from tests.planner.test_lora import GOOD

    path = write(tmp_path, GOOD)
    record_the_plan_as_applied(path)
    inv = load_inventory(path, load_catalog())
    ranks = {b.gpu_type: b.lora_rank for b in backends_from_state(inv, StateDir.of(inv))}
    assert ranks == {"A100-SXM4-80GB": 64, "RTX-4090": 16}
    assert lora_rank(["--max-lora-rank=32"]) == 32 and lora_rank(["--enable-lora"]) == 0
