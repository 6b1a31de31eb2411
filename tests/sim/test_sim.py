"""The engine model and the fleet simulator: conservation, vLLM behaviour, determinism, CLI."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from fleetctl.model.perf import EnginePerf, kv_budget
from fleetctl.sim.engine import Engine, Seq
from fleetctl.sim.fleet import simulate
from fleetctl.sim.workload import Synthetic, load_trace, parse_spec
from tests.conftest import DATA, REPO
from tests.routing.test_policy import _mixed


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
    a = simulate(servers, items, "power-of-two", seed=3)
    b = simulate(servers, items, "power-of-two", seed=3)
    assert a.summary() == b.summary()
    assert [o.backend for o in a.outcomes] == [o.backend for o in b.outcomes]
    # And the seed is what decides: another one draws other pairs.
    c = simulate(servers, items, "power-of-two", seed=4)
    assert [o.backend for o in c.outcomes] != [o.backend for o in a.outcomes]


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
    from fleetctl.base.errors import UserError

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
    from fleetctl.base.errors import UserError

    with pytest.raises(UserError, match="bad workload setting"):
        parse_spec("rat=2", "m")
    with pytest.raises(UserError, match="bad value for rate"):
        parse_spec("rate=fast", "m")


def test_workload_keys_shape_what_is_generated():
    """Each key's effect, from the items it generates (seeded: the same every run)."""
    # rate x duration requests; fixed lengths are the means exactly.
    items = parse_spec("rate=5,duration=600,lengths=fixed,prompt=800,output=100", "m").generate(1)
    assert 0.9 * 3000 <= len(items) <= 1.1 * 3000
    assert {(i.prompt, i.output) for i in items} == {(800, 100)}
    assert all(0 <= i.arrival < 600 for i in items)
    # Bursty: a quarter of the time at 4x the quiet rate, the mean rate kept. The first 15 s
    # of each minute then hold 4 x 15 / (4 x 15 + 45) = 4/7 of the requests.
    items = parse_spec("rate=10,duration=600,arrivals=bursty", "m").generate(1)
    assert 0.9 * 6000 <= len(items) <= 1.1 * 6000
    in_bursts = sum(i.arrival % 60 < 15 for i in items) / len(items)
    assert in_bursts == pytest.approx(4 / 7, abs=0.03)
    # Sessions: each turn resends the conversation so far (prompts, then outputs, added up).
    spec = "rate=1,duration=60,sessions=1,turns=3,lengths=fixed,prompt=100,output=10"
    items = parse_spec(spec, "m").generate(1)
    turns: dict[str, list[int]] = {}
    for i in items:
        assert i.session is not None
        turns.setdefault(i.session, []).append(i.prompt)
    assert turns and all(sorted(p) == [100, 210, 320] for p in turns.values())
    # Precision hints: the share asked for, strict when ";strict" is added.
    items = parse_spec("rate=10,duration=300,precision=int4:0.5;strict", "m").generate(1)
    hinted = [i for i in items if i.precision == "int4"]
    assert len(hinted) / len(items) == pytest.approx(0.5, abs=0.05)
    assert all(i.strict for i in hinted) and not any(i.precision for i in items if not i.strict)


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
    # The load is what the arrivals really are: their count over the time they span. (That the
    # fleet really is at that share of its capacity: test_load_is_measured_against_what_the_fleet_can_carry.)
    assert data["offered_rps"] == pytest.approx(data["requests"] / data["duration_s"], rel=0.01)
    assert data["load"] == pytest.approx(data["offered_rps"] / data["capacity_rps"], rel=0.01)
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


def test_slo_attainment_counts_requests_within_both_objectives():
    from fleetctl.routing.goodput import Slo
    from fleetctl.sim.fleet import Outcome, SimResult
    from fleetctl.sim.workload import WorkItem

    def served(i, ttft, tpot, output=11, arrival=0.0):
        o = Outcome(WorkItem(i, arrival, 100, output, "m"))
        o.first_token = arrival + ttft
        o.finished = o.first_token + tpot * (output - 1)
        return o

    slo = Slo(ttft_s=1.0, tpot_s=0.05)
    outcomes = [
        served(0, 0.5, 0.04),  # both met
        served(1, 1.0, 0.05),  # both exactly on the line: met
        served(2, 1.01, 0.01),  # TTFT missed
        served(3, 0.1, 0.051),  # TPOT missed
        served(4, 0.9, 9.0, output=1),  # one token: no TPOT to miss
        Outcome(WorkItem(5, 0.0, 100, 11, "m")),  # never served: a miss
    ]
    rejected = served(6, 0.1, 0.01)
    rejected.rejected = "too long"  # refused, even if timed: a miss
    outcomes.append(rejected)
    r = SimResult("p", outcomes, 100.0, 0, 0, slo=slo)
    summary = r.summary()
    assert [o.met(slo) for o in outcomes] == [True, True, False, False, True, False, False]
    assert summary["slo_attainment"] == pytest.approx(3 / 7)
    # Served requests span from the first arrival (0) to the last token, request 1's at
    # 1.0 + 10 x 0.05 = 1.5 s: 3 met over 1.5 s.
    assert summary["goodput_rps"] == pytest.approx(3 / 1.5)
    # Between the middle two of 0.01, 0.04, 0.05 and 0.051 (the refused request and the
    # one-token answer have no TPOT among the served).
    assert summary["tpot_p50_s"] == pytest.approx(0.045)
    without = SimResult("p", outcomes, 100.0, 0, 0).summary()
    assert without["slo_attainment"] != without["slo_attainment"]  # NaN: nothing to judge by
    # One objective: the other is met by anything.
    assert served(7, 0.5, 5.0).met(Slo(ttft_s=1.0)) and served(8, 5.0, 0.01).met(Slo(tpot_s=0.05))


def test_simulate_judges_goodput_by_the_slo_given(cli):
    """--slo sets the model's objectives for the run: each policy's slo_attainment (the share
    of all requests served within both) stays within its bounds, a looser SLO never meets
    fewer, and the table names the winner. (That it counts exactly who met both:
    test_slo_attainment_counts_requests_within_both_objectives.)"""

    def run(*extra):
        r = cli(
            "simulate",
            "example:seed-mixed-8b",
            "--trace",
            DATA / "azure_conv_slice.csv",
            "--load",
            "0.9",
            "--policies",
            "round-robin,hardware-aware",
            *extra,
        )
        assert r.code == 0, r.err
        return r

    tight = json.loads(run("--slo", "0.5,40", "--json").out)
    loose = json.loads(run("--slo", "30,1000", "--json").out)
    assert tight["slo"]["ttft_p99_s"] == 0.5 and tight["slo"]["tpot_p99_ms"] == 40.0
    assert tight["slo"]["source"] == "stated" and tight["slo"]["share"] == 0.99
    for name, figures in tight["policies"].items():
        for key in ("tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "goodput_rps"):
            assert key in figures
        assert figures["tpot_p50_s"] <= figures["tpot_p90_s"] <= figures["tpot_p99_s"]
        assert 0 <= figures["slo_attainment"] <= loose["policies"][name]["slo_attainment"]
        # Everything finishes within 30 s and 1 s a token here: all met.
        assert loose["policies"][name]["slo_attainment"] == 1.0
    best = max(tight["policies"], key=lambda n: tight["policies"][n]["slo_attainment"])
    assert tight["goodput_winner"] == best
    text = run("--slo", "0.5,40").out
    share = tight["policies"][best]["slo_attainment"]
    assert f"Goodput: {best} served {share:.1%} of requests within TTFT <= 0.5 s and " in text
    assert "TPOT <= 40 ms" in text
    # One objective alone: TTFT only.
    ttft_only = json.loads(run("--slo", "0.5,-", "--json").out)
    assert ttft_only["slo"]["ttft_p99_s"] == 0.5 and ttft_only["slo"]["tpot_p99_ms"] is None


def test_the_inventorys_slo_is_the_default_and_bad_slos_say_how(cli, tmp_path):
    inv = (REPO / "inventory" / "seed-mixed-8b.yaml").read_text()
    inv = inv.replace(
        "    max_context: 8192", "    max_context: 8192\n    slo: {ttft_p99_s: 2, tpot_p99_ms: 60}"
    )
    path = tmp_path / "slo.yaml"
    path.write_text(inv)
    r = cli("simulate", path, "--workload", "rate=3,duration=30", "--json")
    assert r.code == 0, r.err
    slo = json.loads(r.out)["slo"]
    assert (slo["ttft_p99_s"], slo["tpot_p99_ms"], slo["source"]) == (2.0, 60.0, "stated")
    for bad in ("2", "2,x", "-,-", "0,50", "2,-1", "2,50,3", "inf,50"):
        r = cli("simulate", path, "--workload", "rate=3", "--slo", bad)
        assert r.code == 2 and f"bad --slo '{bad}'" in r.err and "e.g. 2,50" in r.err, bad


def test_rate_replays_a_trace_at_that_many_requests_a_second(cli):
    def run(*extra):
        r = cli(
            "simulate",
            "example:seed-mixed-8b",
            "--trace",
            DATA / "azure_conv_slice.csv",
            "--policies",
            "hardware-aware",
            "--json",
            *extra,
        )
        return r

    for rate in (2.0, 8.0):
        r = run("--rate", str(rate))
        assert r.code == 0, r.err
        assert json.loads(r.out)["offered_rps"] == pytest.approx(rate, rel=1e-3)
    r = run("--rate", "2", "--load", "0.5")
    assert r.code == 2 and "at most one of --load and --rate" in r.err
    for bad in ("0", "-1", "inf"):
        r = run("--rate", bad)
        assert r.code == 2 and "--rate must be a positive number" in r.err


def test_load_is_measured_against_what_the_fleet_can_carry(cli):
    """--load scales arrivals to a share of the fleet's capacity: below it the queue stays
    short, past it TTFT climbs with the load. A capacity figure off by 2x either way moves
    the knee to the wrong side of one of these loads."""

    def run(load):
        r = cli(
            "simulate",
            "example:seed-mixed-8b",
            "--workload",
            "rate=10,duration=120",
            "--load",
            str(load),
            "--policies",
            "hardware-aware",
            "--json",
        )
        assert r.code == 0, r.err
        data = json.loads(r.out)
        figures = data["policies"]["hardware-aware"]
        assert figures["completed"] == data["requests"]
        return data["requests"] / data["duration_s"], figures["ttft_p99_s"]

    (rate_low, low), (rate_high, high), (rate_over, over) = (run(x) for x in (0.6, 1.3, 2.0))
    # The same requests, arriving 1.3/0.6 and 2.0/0.6 times as fast: the arrivals' real rate.
    assert rate_high / rate_low == pytest.approx(1.3 / 0.6, rel=0.02)
    assert rate_over / rate_low == pytest.approx(2.0 / 0.6, rel=0.02)
    assert low < 1.5  # at 60% nothing queues for long
    assert high > 3 * low  # past capacity the queue grows...
    assert over > 2 * high  # ...and keeps growing with the load


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
    assert json.loads(r.out)["plot"] == str(out)
    out.unlink()
    r = cli("simulate", "example:seed-mixed-8b", "--workload", "rate=3,duration=60", "--plot", out)
    assert r.code == 0, r.err
    assert out.is_file() and f"Wrote the latency plot to {out}" in r.out


@pytest.fixture(scope="module")
def rr_vs_ha(tmp_path_factory):
    """Round-robin and hardware-aware over the seed fleet at 150% load, progress recorded,
    at vLLM's step budget (as measured: the planner's smaller one on the 4090s holds their
    decode steps within the TPOT objective, and the overload queues prompts instead)."""
    from fleetctl.base.resources import examples
    from fleetctl.fleet.inventory import load_inventory
    from fleetctl.model.catalog import load_catalog
    from fleetctl.planner import plan_fleet
    from fleetctl.sim.compare import compare

    text = examples()["seed-mixed-8b"].read_text()
    assert "planner:\n" in text
    path = tmp_path_factory.mktemp("rr_vs_ha") / "inventory.yaml"
    path.write_text(text.replace("planner:\n", "planner:\n  max_num_batched_tokens: 2048\n"))
    inv = load_inventory(path, load_catalog())
    items = parse_spec("rate=20,duration=120,max_context=8192", "llama-3-8b").generate(0)
    steps: list[tuple[float, str]] = []
    c = compare(
        inv,
        plan_fleet(inv),
        "llama-3-8b",
        items,
        ["round-robin", "hardware-aware"],
        load=1.5,
        progress=lambda done, what: steps.append((done, what)),
    )
    return c, steps


def test_the_summary_names_the_tradeoff_of_a_real_comparison(rr_vs_ha):
    from fleetctl.sim.command import render, tradeoffs
    from tests.cli.test_render_widths import render_at

    c, _ = rr_vs_ha
    s = {name: r.summary() for name, r in c.results.items()}
    rr, ha = s["round-robin"], s["hardware-aware"]
    # What this run measured at 150% load, by the SLO derived for the fleet (none is
    # stated): hardware-aware cuts the TTFT tail, weighing the first token's seconds against
    # a 1.6 s objective and each decode second against 49 ms x the output, and pays for it in
    # the decode tail, where it stacks more requests on the faster A100s.
    assert c.slo is not None and c.slo.derived
    assert ha["ttft_p99_s"] < 0.5 * rr["ttft_p99_s"]
    assert ha["ttft_p90_s"] < 0.5 * rr["ttft_p90_s"]
    assert ha["tpot_p90_s"] > 1.2 * rr["tpot_p90_s"]
    [line] = tradeoffs(s)
    # It names the TTFT percentile it cut most (p99 here since stalls are weighed against
    # the others' output, p90 before).
    cut = {q: 1 - ha[f"ttft_{q}_s"] / rr[f"ttft_{q}_s"] for q in ("p50", "p90", "p99")}
    top = max(cut, key=lambda q: cut[q])
    assert line.startswith(f"hardware-aware cuts {top} TTFT {cut[top]:.0%}")
    assert f"raises p90 TPOT {ha['tpot_p90_s'] / rr['tpot_p90_s'] - 1:.0%}" in line
    assert "vs round-robin, but raises" in line and line.endswith("a trade-off")
    assert line in render_at(render(c), 400)


def test_tradeoff_sentences():
    from fleetctl.sim.command import tradeoffs

    def fig(ttft, tpot, e2e):
        return {
            "ttft_p50_s": ttft,
            "ttft_p90_s": ttft,
            "ttft_p99_s": ttft,
            "tpot_p50_s": tpot,
            "tpot_p90_s": tpot,
            "tpot_p99_s": tpot,
            "e2e_p99_s": e2e,
        }

    base = fig(1.0, 0.05, 10.0)
    assert tradeoffs({"a": base}) == []
    [line] = tradeoffs({"hardware-aware": base, "rr": fig(2.0, 0.05, 12.0)})
    assert line == (
        "hardware-aware cuts p50 TTFT 50% and p99 e2e latency 17% vs rr, and is no worse elsewhere"
    )
    [line] = tradeoffs({"hardware-aware": base, "rr": fig(0.25, 0.05, 10.2)})
    assert line == "hardware-aware raises p50 TTFT 4.0x vs rr, and is no better elsewhere"
    [line] = tradeoffs({"hardware-aware": base, "rr": fig(1.02, 0.0499, 10.0)})
    assert "within 5% on TTFT, TPOT and e2e latency" in line
    # Without hardware-aware the policy with the lowest p99 TTFT is the one compared; one-token
    # outputs have no TPOT (NaN), and that family is left out rather than compared.
    nan = float("nan")
    [line] = tradeoffs({"x": fig(3.0, nan, 10.0), "y": fig(1.0, nan, 11.0)})
    assert line == "y cuts p50 TTFT 67% vs x, but raises p99 e2e latency 10%: a trade-off"


def test_simulation_reports_progress_per_policy(rr_vs_ha):
    _, steps = rr_vs_ha
    done = [d for d, _ in steps]
    assert done == sorted(done) and done[0] == 0 and steps[-1] == (2, "simulated")
    assert any(0 < d < 1 for d in done) and any(1 < d < 2 for d in done)
    assert {w for _, w in steps} == {
        "simulating round-robin (1/2)",
        "simulating hardware-aware (2/2)",
        "simulated",
    }


def test_trace_loading_reports_progress(tmp_path):
    rows = "".join(
        f"2023-11-16 18:{i // 600:02d}:{i // 10 % 60:02d}.{i % 10},100,10\n" for i in range(9000)
    )
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    seen: list[float] = []
    items = load_trace(trace, "m", progress=seen.append)
    assert len(items) == 9000
    assert len(seen) == 2 and seen == sorted(seen) and seen[-1] <= trace.stat().st_size


def test_plot_title_names_fleet_source_and_load(rr_vs_ha):
    from fleetctl.sim.command import plot_title

    c, _ = rr_vs_ha
    title = plot_title(c, "seed-mixed-8b", "synthetic rate=20,duration=120")
    assert title.startswith("seed-mixed-8b: llama-3-8b on 12 servers, synthetic rate=20")
    assert f"{len(c.items):,} requests" in title and "(150% of capacity)" in title


def test_plot_without_matplotlib_fails_before_simulating(cli, tmp_path, monkeypatch):
    import sys

    import fleetctl.sim.command

    def never(*args, **kwargs):
        raise AssertionError("simulated before checking for matplotlib")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setattr(fleetctl.sim.command, "compare", never)
    out = tmp_path / "ttft.png"
    r = cli("simulate", "example:seed-mixed-8b", "--workload", "rate=3,duration=60", "--plot", out)
    assert r.code == 2, r.err
    assert "--plot needs matplotlib" in r.err and "pip install matplotlib" in r.err
    assert len(r.err.strip().splitlines()) == 1 and not out.exists()
