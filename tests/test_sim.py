"""The engine model and the fleet simulator: conservation, vLLM behaviour, determinism, CLI."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from fleetctl.perf import EnginePerf, kv_budget
from fleetctl.sim.engine import Engine, Seq
from fleetctl.sim.fleet import simulate
from fleetctl.sim.workload import Synthetic, load_trace, parse_spec
from tests.test_policy import _mixed

DATA = Path(__file__).parent / "data"


def engine(catalog, gpu="RTX-4090", kv=None, **kw):
    g, m, f = catalog.gpu(gpu), catalog.model("llama-3-8b"), catalog.format("bf16")
    kv = kv if kv is not None else kv_budget(g, m, f).kv_tokens
    return Engine(EnginePerf(g, m, f), kv, **kw)


def drive(e, n=200, rate=1.0, seed=1, prompt=(100, 4000), output=(10, 400)):
    rnd = random.Random(seed)
    seqs, t = [], 0.0
    for i in range(n):
        t += rnd.expovariate(rate)
        s = Seq(i, rnd.randint(*prompt), rnd.randint(*output))
        seqs.append(s)
        e.advance(t)
        e.add(s, t)
    e.advance(float("inf"))
    return seqs


def test_every_request_finishes_and_every_block_comes_back(catalog):
    e = engine(catalog)
    seqs = drive(e)
    assert e.idle and e.free_blocks == e.total_blocks
    assert all(s.finished_at is not None and s.first_token_at <= s.finished_at for s in seqs)
    assert all(e.generated(s) == s.output for s in seqs)
    assert e.stats.finished == len(seqs)
    assert e.stats.generation_tokens == sum(s.output for s in seqs)
    assert e.stats.prompt_tokens >= sum(s.prompt for s in seqs)  # recomputes count too


def test_single_request_decodes_at_the_calibrated_speed(catalog):
    e = engine(catalog)
    s = Seq(0, 100, 471)
    e.add(s, 0.0)
    e.advance(float("inf"))
    tok_s = (s.output - 1) / (s.finished_at - s.first_token_at)
    assert tok_s == pytest.approx(47, rel=0.05)  # the seed's 4090 figure


def test_oversubscribed_kv_preempts_and_resumes_from_the_prefix_cache(catalog):
    e = engine(catalog, kv=16 * 200)  # 3,200 tokens of KV
    seqs = drive(e, n=30, rate=5.0, prompt=(500, 1200), output=(300, 600))
    assert e.stats.preemptions > 0
    assert any(s.preemptions for s in seqs)
    assert e.stats.prefix_cache_hits > 0
    assert e.free_blocks == e.total_blocks and all(s.finished_at for s in seqs)


def test_batching_limits_are_respected(catalog):
    e = engine(catalog, max_num_seqs=4, max_num_batched_tokens=512)
    peak = 0
    rnd = random.Random(2)
    for i in range(40):
        e.add(Seq(i, rnd.randint(100, 900), 50), i * 0.05)
        peak = max(peak, e.num_running)
    e.advance(float("inf"))
    assert peak <= 4 and e.stats.finished == 40


def test_a_long_prompt_is_prefilled_in_chunks(catalog):
    e = engine(catalog, max_num_batched_tokens=512)
    s = Seq(0, 4000, 2)
    e.add(s, 0.0)
    e.advance(float("inf"))
    assert e.stats.steps >= 8  # ceil(4000 / 512) prefill steps, then a decode


def test_fast_path_matches_step_by_step(catalog):
    fast, slow = engine(catalog), engine(catalog, max_span_s=0.0)
    a, b = drive(fast, n=60, seed=4), drive(slow, n=60, seed=4)
    assert [s.finished_at for s in a] == pytest.approx([s.finished_at for s in b], rel=1e-9)
    assert slow.stats.steps == fast.stats.steps


def test_simulation_is_deterministic_for_a_seed(catalog):
    servers = _mixed(catalog)
    items = Synthetic(
        model="llama-3-8b", rate=6, duration=120, long_share=0.2, max_context=8192
    ).generate(9)
    a = simulate(servers, items, "power-of-two", seed=3).summary()
    b = simulate(servers, items, "power-of-two", seed=3).summary()
    assert a == b


def test_hardware_aware_beats_round_robin_on_the_tail(catalog):
    servers = _mixed(catalog)
    items = Synthetic(
        model="llama-3-8b", rate=5, duration=300, prompt=2500, output=250, max_context=8192
    ).generate(1)
    rr = simulate(servers, items, "round-robin").summary()
    ha = simulate(servers, items, "hardware-aware").summary()
    assert ha["completed"] == rr["completed"] == len(items)
    assert rr["ttft_p99_s"] > 1.3 * ha["ttft_p99_s"]


def test_trace_loading_and_bad_traces(tmp_path):
    items = load_trace(DATA / "azure_conv_slice.csv", "m")
    assert len(items) == 400 and items[0].arrival == 0.0
    assert (items[0].prompt, items[0].output) == (374, 44)
    assert all(b.arrival >= a.arrival for a, b in itertools.pairwise(items))
    from fleetctl.errors import UserError

    bad = tmp_path / "bad.csv"
    bad.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(UserError, match="expected TIMESTAMP,ContextTokens,GeneratedTokens"):
        load_trace(bad, "m")
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,x,1\n")
    with pytest.raises(UserError, match="bad trace row"):
        load_trace(bad, "m")


def test_workload_specs():
    w = parse_spec("rate=2,duration=60,prompt=800,priorities=0:0.5/2:0.5,arrivals=bursty", "m")
    items = w.generate(1)
    assert {i.priority for i in items} == {0, 2}
    assert 60 <= len(items) <= 200
    from fleetctl.errors import UserError

    with pytest.raises(UserError, match="bad workload setting"):
        parse_spec("rat=2", "m")
    with pytest.raises(UserError, match="bad value for rate"):
        parse_spec("rate=fast", "m")


def test_simulate_command_json_and_table(cli, tmp_path):
    r = cli(
        "simulate",
        "example:seed-mixed-8b",
        "--trace",
        DATA / "azure_conv_slice.csv",
        "--load",
        "0.5",
        "--policies",
        "round-robin,hardware-aware",
        "--json",
    )
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert set(data["policies"]) == {"round-robin", "hardware-aware"}
    for figures in data["policies"].values():
        for key in (
            "ttft_mean_s",
            "ttft_p50_s",
            "ttft_p90_s",
            "ttft_p99_s",
            "tpot_mean_s",
            "e2e_p99_s",
            "throughput_rps",
            "preemptions",
            "completed",
            "starved",
        ):
            assert key in figures
    assert data["load"] == pytest.approx(0.5, rel=0.01)
    r = cli(
        "simulate",
        "example:seed-mixed-8b",
        "--workload",
        "rate=3,duration=60",
        "--policies",
        "hardware-aware",
    )
    assert r.code == 0 and "hardware-aware" in r.out and "TTFT" in r.out
    r = cli("simulate", "example:seed-mixed-8b", "--workload", "rate=3", "--policies", "fastest")
    assert r.code == 2 and "unknown policy 'fastest'" in r.err
    r = cli("simulate", "example:seed-multi-model", "--workload", "rate=3")
    assert r.code == 2 and "--model" in r.err


def test_simulate_plot(cli, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "ttft.png"
    r = cli(
        "simulate",
        "example:seed-mixed-8b",
        "--workload",
        "rate=3,duration=60",
        "--plot",
        out,
        "--json",
    )
    assert r.code == 0, r.err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
