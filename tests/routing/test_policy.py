"""Routing policies on hand-built snapshots, and the seed's rules measured in simulation."""

from __future__ import annotations

from collections import defaultdict

import pytest

from fleetctl.model.perf import EnginePerf, kv_budget
from fleetctl.routing.policies.kv_aware import KvAware
from fleetctl.routing.policies.power_of_two import PowerOfTwo
from fleetctl.routing.policies.round_robin import RoundRobin
from fleetctl.routing.policy import HardwareAware
from fleetctl.routing.registry import make_policy
from fleetctl.routing.types import Backend, Request
from fleetctl.sim.fleet import Server, simulate
from fleetctl.sim.workload import Synthetic


def backend(catalog, name, gpu="A100-SXM4-80GB", variant="bf16", model="llama-3-8b", **live):
    g, m, f = catalog.gpu(gpu), catalog.model(model), catalog.format(variant)
    kv = kv_budget(g, m, f).kv_tokens
    return Backend(name, name, g.name, model, variant, kv, 256, EnginePerf(g, m, f), **live)


def server(catalog, name, gpu, variant="bf16", model="llama-3-8b", max_len=8192):
    g, m, f = catalog.gpu(gpu), catalog.model(model), catalog.format(variant)
    kv = kv_budget(g, m, f).kv_tokens
    return Server(name, name, g.name, model, variant, EnginePerf(g, m, f), kv, 256, 2048, max_len)


def req(i=0, prompt=500, out=100, **kw):
    return Request(i, "llama-3-8b", prompt, out, **kw)


def test_round_robin_cycles_and_p2c_is_seeded(catalog):
    bs = [backend(catalog, f"b{i}") for i in range(3)]
    rr = RoundRobin()
    assert [rr.choose(req(), bs).backend.name for _ in range(4)] == ["b0", "b1", "b2", "b0"]

    def picks(seed):
        p2c = PowerOfTwo(seed)
        return [p2c.choose(req(), bs).backend.name for _ in range(30)]

    # One seed, one sequence; another seed, another (ties go by name: b2 never wins one).
    assert picks(7) == picks(7)
    assert picks(7) != picks(8) and set(picks(7)) == {"b0", "b1"}


def test_p2c_takes_the_less_loaded_of_its_two_draws(catalog):
    # Loaded backends: every draw of two has a strictly less loaded one, which it must take.
    bs = [backend(catalog, f"b{i}", outstanding=load) for i, load in enumerate((0, 5, 9))]
    for seed in range(5):
        p2c = PowerOfTwo(seed)
        names = [p2c.choose(req(), bs).backend.name for _ in range(60)]
        assert "b2" not in names  # the busiest never wins a draw
        assert names.count("b0") > names.count("b1") > 0  # b0 wins 2 draws of 3, b1 one
    # Two backends: the idle one, always.
    two = [backend(catalog, "busy", outstanding=7), backend(catalog, "idle", outstanding=1)]
    assert {PowerOfTwo(s).choose(req(), two).backend.name for s in range(20)} == {"idle"}


def test_kv_aware_takes_the_emptiest(catalog):
    bs = [backend(catalog, "a", kv_usage=0.7), backend(catalog, "b", kv_usage=0.2)]
    assert KvAware().choose(req(), bs).backend.name == "b"


def test_long_requests_go_to_the_large_kv_class(catalog):
    a100 = backend(catalog, "a100", outstanding=6, reserved_tokens=20000)
    rtx = backend(catalog, "rtx", gpu="RTX-4090")
    ha = HardwareAware()
    long = ha.choose(req(prompt=5000, out=500), [a100, rtx])
    assert long.backend is a100 and "long->large-kv" in long.reason
    # Short requests: load decides, so the idle 4090 wins over the busy A100.
    a100.pending_prefill = 20000
    short = ha.choose(req(prompt=300, out=50), [a100, rtx])
    assert short.backend is rtx and "length:short" in short.reason


def test_long_requests_take_the_small_kv_class_only_when_it_is_4x_sooner(catalog):
    # The penalty: a small-KV backend gets a long request only where it promises the first
    # token long_small_kv_penalty (4) times sooner than the large-KV class. A request of two
    # output tokens: its first token is all that differs.
    rtx = backend(catalog, "rtx", gpu="RTX-4090")
    long = req(prompt=5000, out=2)
    ha = HardwareAware()
    # The A100's backlog makes it about 2.5x slower than the idle 4090: it still gets it.
    a100 = backend(catalog, "a100", pending_prefill=20000)
    ratio = ha.estimate(a100, long) / ha.estimate(rtx, long)
    assert 1.5 < ratio < 3.5
    d = ha.choose(long, [a100, rtx])
    assert d.backend is a100 and "length:long->large-kv" in d.reason
    # About 4.5x slower: now the 4090 is worth it.
    a100 = backend(catalog, "a100", pending_prefill=40000)
    assert ha.estimate(a100, long) / ha.estimate(rtx, long) > 4.0
    d = ha.choose(long, [a100, rtx])
    assert d.backend is rtx and "length:long->small-kv" in d.reason
    # With 500 tokens to decode, the A100's decode (2x the bandwidth) outweighs its backlog.
    d = ha.choose(req(prompt=5000, out=500), [a100, rtx])
    assert d.backend is a100 and "by:tpot" in d.reason
    # A short request has no penalty: the 2.5x slower A100 loses it.
    a100 = backend(catalog, "a100", pending_prefill=20000)
    assert ha.choose(req(prompt=500, out=2), [a100, rtx]).backend is rtx


def test_kv_overflow_costs_the_overflowing_backend_its_turn(catalog):
    ha = HardwareAware()
    r = req(prompt=2000, out=500)
    full = backend(catalog, "full", outstanding=2)
    busier = backend(catalog, "busier", outstanding=8)
    # With room in both caches, the shorter batch is sooner.
    assert ha.choose(r, [full, busier]).backend is full
    below = ha.estimate(full, r)
    # Half full: still no wait for room; only the step that reads the KV in flight is longer.
    full.reserved_tokens = full.kv_tokens // 2
    assert below < ha.estimate(full, r) < below * 1.1
    # What is in flight already fills its cache: the request would wait for room there.
    full.reserved_tokens = full.kv_tokens * 3 // 2
    assert ha.estimate(full, r) > below * 1.5
    d = ha.choose(r, [full, busier])
    assert d.backend is busier, d


def test_bandwidth_saturation_biases_away_even_with_a_short_queue(catalog):
    hot = backend(catalog, "hot", outstanding=2, bandwidth_util=0.97)
    calm = backend(catalog, "calm", outstanding=4, bandwidth_util=0.40)
    d = HardwareAware().choose(req(out=400), [hot, calm])
    assert d.backend is calm
    # Below the threshold the shorter queue wins.
    hot.bandwidth_util = 0.5
    assert HardwareAware().choose(req(out=400), [hot, calm]).backend is hot


def test_compute_saturation_is_a_signal_too(catalog):
    busy = backend(catalog, "busy", compute_util=0.99)
    idle = backend(catalog, "idle", outstanding=1)
    assert HardwareAware().choose(req(out=300), [busy, idle]).backend is idle


def test_strict_precision_is_honoured_or_rejected(catalog):
    bf16 = backend(catalog, "bf16")
    int4 = backend(catalog, "int4", gpu="RTX-4090", variant="gptq-int4")
    ha = HardwareAware()
    pool, _ = ha.eligible(req(precision="int4", strict=True), [bf16, int4])
    assert pool == [int4]
    pool, why = ha.eligible(req(precision="fp8", strict=True), [bf16, int4])
    assert pool == [] and "no backend serves llama-3-8b in fp8" in why and "gptq-int4" in why
    # Prefer mode falls back when the format is missing, and says so.
    d = ha.choose(req(precision="fp8"), [bf16, int4])
    assert d.backend is not None and "precision:unavailable" in d.reason


def test_every_policy_is_selectable_by_name():
    for name in ("round-robin", "least-outstanding", "power-of-two", "kv-aware", "hardware-aware"):
        assert make_policy(name).name == name
    with pytest.raises(KeyError):
        make_policy("nope")


def _mixed(catalog):
    return [server(catalog, f"a100-{i}", "A100-SXM4-80GB") for i in range(2)] + [
        server(catalog, f"rtx-{i}", "RTX-4090") for i in range(4)
    ]


def test_session_affinity_holds_for_every_later_turn(catalog):
    servers = _mixed(catalog)
    items = Synthetic(
        model="llama-3-8b", rate=4, duration=200, sessions=1.0, turns=5, max_context=8192
    ).generate(3)
    result = simulate(servers, items, "hardware-aware")
    cls = {s.name: s.gpu_type for s in servers}
    turns = defaultdict(list)
    for o in sorted(result.outcomes, key=lambda o: o.item.arrival):
        assert o.backend is not None, o
        turns[o.item.session].append(cls[o.backend])
    later = [(t[0], x) for t in turns.values() for x in t[1:]]
    assert len(later) > 100
    assert all(first == x for first, x in later)  # 100% of later turns
    # And both classes got sessions: affinity is not "everything on one class".
    assert {t[0] for t in turns.values()} == {"A100-SXM4-80GB", "RTX-4090"}


def test_a_session_keeps_its_class_while_that_class_is_the_busier(catalog):
    ha = HardwareAware()
    a100 = backend(catalog, "a100", outstanding=12, pending_prefill=30000)
    rtx = [backend(catalog, f"rtx-{i}", gpu="RTX-4090") for i in range(2)]
    first = req(0, prompt=300, out=50, session="s1")
    d = ha.choose(first, [a100, *rtx])
    assert d.backend.gpu_type == "RTX-4090", d  # the A100 is busy: a 4090 is sooner
    ha.placed(first, d.backend)
    # Now the 4090s are loaded and the A100 idle: any request without the session moves...
    a100.outstanding, a100.pending_prefill = 0, 0
    for b in rtx:
        b.outstanding, b.pending_prefill, b.reserved_tokens = 12, 30000, 20000
    fleet = [a100, *rtx]
    assert ha.choose(req(1, prompt=300, out=50), fleet).backend is a100
    assert ha.choose(req(2, prompt=300, out=50, session="other"), fleet).backend is a100
    # ...but the session's next turns stay on its class, by eligibility and by choice.
    turn = req(3, prompt=800, out=50, session="s1")
    pool, _ = ha.eligible(turn, fleet)
    assert {b.gpu_type for b in pool} == {"RTX-4090"}
    d = ha.choose(turn, fleet)
    assert d.backend.gpu_type == "RTX-4090" and "affinity:class" in d.reason, d
    # Even when offered the whole fleet (the daemon's eligibility pass skipped).
    assert ha.choose(req(4, prompt=800, out=50, session="s1"), fleet).backend is not a100


def test_a_session_stays_on_its_node_unless_another_is_affinity_slack_sooner(catalog):
    ha = HardwareAware()
    rtx = [backend(catalog, f"rtx-{i}", gpu="RTX-4090") for i in range(2)]
    first = req(0, prompt=300, out=50, session="s")
    rtx[1].outstanding = 1  # rtx-0 is sooner: the first turn goes there
    d = ha.choose(first, rtx)
    assert d.backend is rtx[0]
    ha.placed(first, d.backend)
    rtx[1].outstanding = 0
    # Its node is now a little busier than the other (its warm prefix cache is worth it).
    rtx[0].outstanding, rtx[0].pending_prefill = 2, 600
    turn = req(1, prompt=300, out=50, session="s")
    gap = ha.estimate(rtx[0], turn) - ha.estimate(rtx[1], turn)
    assert 0 < gap < ha.config.affinity_slack_s
    d = ha.choose(turn, rtx)
    assert d.backend is rtx[0] and "affinity:node" in d.reason, d
    # Much busier: the session moves to the other node of its class.
    rtx[0].pending_prefill = 30000
    assert ha.estimate(rtx[0], turn) - ha.estimate(rtx[1], turn) > ha.config.affinity_slack_s
    d = ha.choose(req(2, prompt=300, out=50, session="s"), rtx)
    assert d.backend is rtx[1] and "affinity:node" not in d.reason, d


def test_what_a_backend_is_believed_to_cache_counts_by_its_prefix_trust(catalog):
    from fleetctl.routing.prefix import PrefixIndex, PromptBlocks, chain

    ha = HardwareAware()
    ha.prefix = PrefixIndex(learn=False)
    ids = chain(range(250))  # 4000 tokens in blocks of 16
    ha.prefix.insert("warm", ids)
    warm = backend(catalog, "warm", gpu="RTX-4090")
    r = req(prompt=4000, out=50, blocks=PromptBlocks(ids, 16, 4000))
    full = ha.estimate(warm, r)
    cold = ha.estimate(warm, r, cached=0)
    warm.prefix_trust = 0.5
    half = ha.estimate(warm, r)
    warm.prefix_trust = 0.0
    none = ha.estimate(warm, r)
    assert full < half < cold and none == pytest.approx(cold)


def test_strict_hints_in_simulation(catalog):
    servers = [
        server(catalog, "a", "A100-SXM4-80GB"),
        server(catalog, "r", "RTX-4090", "gptq-int4"),
    ]
    items = Synthetic(
        model="llama-3-8b", rate=3, duration=120, precision="int4:0.4/fp8:0.2;strict"
    ).generate(5)
    result = simulate(servers, items, "hardware-aware")
    by_hint = defaultdict(list)
    for o in result.outcomes:
        by_hint[o.item.precision].append(o)
    # Strict int4 goes to r, or is refused up front when no server's length takes it.
    assert by_hint["int4"] and all(
        o.backend == "r"
        or (o.backend is None and "the longest llama-3-8b serves is 8192" in o.rejected)
        for o in by_hint["int4"]
    )
    assert by_hint["fp8"] and all(o.rejected and o.backend is None for o in by_hint["fp8"])
    assert all(o.rejected is None for o in by_hint[None])


def test_precision_hint_matches_a_format_its_family_or_its_stem():
    from fleetctl.routing.types import precision_matches

    assert precision_matches("fp8", "fp8-per-channel") and precision_matches("FP8", "fp8")
    assert precision_matches("int4", "awq-int4") and precision_matches("gptq-int4", "gptq-int4")
    assert not precision_matches("fp8", "bf16") and not precision_matches("fp", "fp8")


def test_the_router_weighs_stalls_against_each_models_mean_output(catalog):
    """What a request in flight has to decode, for the SLO-weighted cost: the traffic's mean
    output where the caller measured it, else the inventory's workload, else the default."""
    from dataclasses import replace

    from fleetctl.base.resources import examples
    from fleetctl.fleet.inventory import load_inventory
    from fleetctl.fleet.slo import DEFAULT_OUTPUT
    from fleetctl.routing.policy import RoutingConfig

    inv = load_inventory(examples()["seed-mixed-8b"], catalog)
    assert RoutingConfig.of(inv).mean_output == {"llama-3-8b": 300}
    assert RoutingConfig.of(inv, shapes={"llama-3-8b": (900, 120)}).mean_output == {
        "llama-3-8b": 120
    }
    m = inv.models[0]
    bare = replace(m, spec=m.spec.model_copy(update={"workload": None}))
    assert RoutingConfig.of(replace(inv, models=(bare,))).mean_output == {
        "llama-3-8b": DEFAULT_OUTPUT
    }
