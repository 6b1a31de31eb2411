"""The admission queue: strict priority classes, KV-derived caps, and the seed's aging rule."""

from __future__ import annotations

from fleetctl.perf import EnginePerf, kv_budget
from fleetctl.routing.policy import HardwareAware, RoundRobin
from fleetctl.routing.scheduler import Aging, RollingMedian, Scheduler, release
from fleetctl.routing.types import Backend, Request
from fleetctl.sim.fleet import Server, simulate
from fleetctl.sim.workload import WorkItem


def one_backend(catalog, kv_tokens=10_000, max_seqs=4):
    g, m, f = catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3-8b"), catalog.format("bf16")
    return Backend("b", "n", g.name, "llama-3-8b", "bf16", kv_tokens, max_seqs, EnginePerf(g, m, f))


def test_rolling_median_forgets_old_values():
    m = RollingMedian(60)
    for t, v in [(0, 1.0), (10, 3.0), (20, 2.0)]:
        m.add(t, v)
    assert m.median(20) == 2.0
    assert m.median(65) == 2.5  # the value from t=0 is out of the window
    assert m.median(75) == 2.0
    assert m.median(200) is None


def test_aging_boosts_exactly_past_factor_times_median():
    s = Scheduler(HardwareAware(), Aging(factor=2.0, window_s=60))
    s.observe_ttft(100.0, 0.5)
    s.observe_ttft(100.0, 1.5)  # median 1.0 -> threshold 2.0 s
    assert s.aging_threshold(100.0) == 2.0
    early = Request("early", "llama-3-8b", 10, 10, priority=2, arrival=97.9)
    late = Request("late", "llama-3-8b", 10, 10, priority=2, arrival=98.1)
    for r in (early, late):
        s.submit(r)
    s._age(100.0)
    assert early.boosted and not late.boosted and s.boosts == 1
    assert [r.id for r in s.classes[0]] == ["early"]
    # Without TTFT samples there is no threshold, and aging off never boosts.
    assert Scheduler(HardwareAware()).aging_threshold(0) is None
    off = Scheduler(HardwareAware(), Aging(enabled=False))
    off.observe_ttft(0, 1.0)
    assert off.aging_threshold(1) is None


def test_every_aged_request_is_boosted_at_once_and_they_keep_arrival_order(catalog):
    s = Scheduler(HardwareAware(), Aging(factor=2.0, window_s=60))
    s.observe_ttft(100.0, 1.0)  # threshold 2.0 s
    arrivals = {
        "top-a": (0, 90.0), "top-b": (0, 99.5),  # top class, in order
        "p1-a": (1, 91.0), "p1-b": (1, 95.0), "p1-c": (1, 97.0), "p1-new": (1, 99.0),
        "p3-a": (3, 89.0), "p3-b": (3, 96.0), "p3-new": (3, 99.9),
    }  # fmt: skip
    for rid, (prio, t) in arrivals.items():
        s.submit(Request(rid, "llama-3-8b", 10, 10, priority=prio, arrival=t))
    big = one_backend(catalog, kv_tokens=1_000_000, max_seqs=100)
    sent, _ = s.dispatch(100.0, [big])
    # One dispatch boosts all five that waited over 2 s, from every class, not one of them.
    assert s.boosts == 5
    boosted = {d.request.id for d in sent if d.request.boosted}
    assert boosted == {"p1-a", "p1-b", "p1-c", "p3-a", "p3-b"}
    # The top class (with the boosted requests in it) goes first, by arrival across classes;
    # then what was not boosted, by class.
    order = [d.request.id for d in sent]
    top = sorted(
        ["top-a", "top-b", *boosted], key=lambda r: arrivals[r][1]
    )  # 89, 90, 91, 95, 96, 97, 99.5
    assert order == [*top, "p1-new", "p3-new"]


def test_boosted_requests_wait_in_arrival_order_while_the_fleet_is_full(catalog):
    s = Scheduler(HardwareAware(), Aging(factor=2.0, window_s=60))
    s.observe_ttft(0.0, 1.0)
    for rid, prio, t in [("c", 2, 3.0), ("a", 1, 1.0), ("d", 2, 4.0), ("b", 3, 2.0)]:
        s.submit(Request(rid, "llama-3-8b", 10, 10, priority=prio, arrival=t))
    full = one_backend(catalog, max_seqs=1)
    full.outstanding = 1
    assert s.dispatch(10.0, [full]) == ([], [])
    assert [r.id for r in s.queue] == ["a", "b", "c", "d"] and s.boosts == 4
    # Room for one at a time: they leave in arrival order.
    out = []
    for now in (11.0, 12.0, 13.0, 14.0):
        full.outstanding = 0
        (d,), _ = s.dispatch(now, [full])
        out.append(d.request.id)
    assert out == ["a", "b", "c", "d"]


def test_caps_come_from_the_kv_budget_and_priority_is_strict(catalog):
    b = one_backend(catalog, kv_tokens=10_000, max_seqs=4)
    s = Scheduler(HardwareAware(), Aging(enabled=False))
    big = [Request(f"hi{i}", "llama-3-8b", 3000, 1000, priority=0, arrival=i) for i in range(3)]
    small = Request("lo", "llama-3-8b", 100, 10, priority=1, arrival=0)
    for r in [small, *big]:
        s.submit(r)
    sent, rejected = s.dispatch(10, [b])
    # Two 4,000-token requests fill the 10,000-token cache; the third high-priority one waits,
    # and the low-priority one waits behind it even though it would fit.
    assert [d.request.id for d in sent] == ["hi0", "hi1"] and not rejected
    assert b.outstanding == 2 and b.reserved_tokens == 8000
    assert [r.id for r in s.queue] == ["hi2", "lo"]
    release(b, big[0])
    sent, _ = s.dispatch(11, [b])
    assert [d.request.id for d in sent] == ["hi2", "lo"]


def test_a_request_bigger_than_the_cache_runs_alone_on_an_empty_backend(catalog):
    b = one_backend(catalog, kv_tokens=10_000, max_seqs=4)
    s = Scheduler(HardwareAware(), Aging(enabled=False))
    huge = [Request(f"huge{i}", "llama-3-8b", 12_000, 1000, arrival=i) for i in range(2)]
    for r in huge:
        s.submit(r)
    sent, rejected = s.dispatch(0, [b])
    # Never fits the cache, so it must be let into an empty backend, or it never runs; the
    # second waits until the first is done.
    assert [d.request.id for d in sent] == ["huge0"] and not rejected
    assert [r.id for r in s.queue] == ["huge1"]
    release(b, huge[0])
    sent, _ = s.dispatch(1, [b])
    assert [d.request.id for d in sent] == ["huge1"]


def test_requests_with_a_choice_do_not_take_the_room_a_restricted_one_waits_for(catalog):
    g, m, f = catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3-8b"), catalog.format("bf16")
    r, fr = catalog.gpu("RTX-4090"), catalog.format("bf16")
    # Only the A100 takes a 20K context; it has 15K of KV free now.
    a100 = Backend("a100", "a", g.name, m.name, "bf16", 100_000, 64, EnginePerf(g, m, f), 32768)
    rtx = Backend("rtx", "r", r.name, m.name, "bf16", 40_000, 64, EnginePerf(r, m, fr), 8192)
    a100.outstanding, a100.reserved_tokens = 3, 85_000
    s = Scheduler(HardwareAware(), Aging(enabled=False))
    long = Request("long", "llama-3-8b", 19_000, 1000, arrival=0)
    s.submit(long)
    shorts = [Request(f"s{i}", "llama-3-8b", 900, 100, arrival=1 + i) for i in range(3)]
    for q in shorts:
        s.submit(q)
    sent, _ = s.dispatch(2, [a100, rtx])
    # The long one waits for the A100; the short ones backfill, but on the 4090 only, even
    # though the A100 has room for them and is faster: that room is the long one's.
    assert [(d.request.id, d.decision.backend.name) for d in sent] == [
        ("s0", "rtx"),
        ("s1", "rtx"),
        ("s2", "rtx"),
    ]
    assert a100.reserved_tokens == 85_000 and [q.id for q in s.queue] == ["long"]


def test_baselines_forward_everything_at_once(catalog):
    b = one_backend(catalog, kv_tokens=1000, max_seqs=1)
    s = Scheduler(RoundRobin())
    for i in range(5):
        s.submit(Request(i, "llama-3-8b", 900, 100, arrival=0))
    sent, _ = s.dispatch(0, [b])
    assert len(sent) == 5 and b.outstanding == 5


def test_unknown_model_is_rejected_not_queued(catalog):
    s = Scheduler(HardwareAware())
    s.submit(Request("x", "other-model", 10, 10))
    sent, rejected = s.dispatch(0, [one_backend(catalog)])
    assert (
        not sent
        and rejected[0].decision.reject
        and "no healthy backend serves other-model" in rejected[0].decision.reason
    )


def _starvation(catalog, aging: bool):
    g, m, f = catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3.1-8b"), catalog.format("bf16")
    kv = kv_budget(g, m, f).kv_tokens
    servers = [
        Server(f"a{i}", f"a{i}", g.name, m.name, "bf16", EnginePerf(g, m, f), kv, 256, 2048, 32768)
        for i in range(2)
    ]
    items = []
    # A continuous stream of high-priority 32K-context requests, faster than the fleet serves
    # them, for 600 s; twenty short low-priority requests from t=30 s, once the fleet is full.
    t = 0.0
    while t < 600:
        items.append(WorkItem(0, t, 30000, 200, m.name, priority=0))
        t += 0.6
    for i in range(20):
        items.append(WorkItem(0, 5.0 * i + 30.0, 300, 50, m.name, priority=3))
    items.sort(key=lambda w: w.arrival)
    items = [
        WorkItem(i, w.arrival, w.prompt, w.output, w.model, w.priority) for i, w in enumerate(items)
    ]
    result = simulate(servers, items, "hardware-aware", aging=Aging(2.0, 60.0, aging), drain_s=0.0)
    low = [o for o in result.outcomes if o.item.priority == 3]
    return low, result


def test_low_priority_requests_do_not_starve_with_aging(catalog):
    low, result = _starvation(catalog, aging=True)
    assert all(o.finished is not None for o in low)
    assert all(o.boosted for o in low) and result.boosts == 20
    high_done = sum(1 for o in result.outcomes if o.item.priority == 0 and o.finished is not None)
    high_all = sum(1 for o in result.outcomes if o.item.priority == 0)
    assert high_done < high_all  # the fleet really is busier than it can serve


def test_low_priority_requests_starve_without_aging(catalog):
    low, result = _starvation(catalog, aging=False)
    assert all(o.finished is None for o in low)
    assert result.boosts == 0


def test_a_retry_keeps_its_place_avoids_the_failed_backend_and_obeys_caps(catalog):
    a, b = one_backend(catalog, max_seqs=1), one_backend(catalog, max_seqs=1)
    a.name, b.name = "a", "b"
    s = Scheduler(HardwareAware(), Aging(enabled=False))
    busy = Request("busy", "llama-3-8b", 10, 10, arrival=0)
    s.submit(busy)
    (placed,), _ = s.dispatch(1, [b])
    assert placed.decision.backend is b and b.outstanding == 1
    later = Request("later", "llama-3-8b", 10, 10, arrival=5)
    retry = Request("retry", "llama-3-8b", 10, 10, arrival=2, exclude=frozenset({"a"}))
    s.submit(later)
    s.submit(retry)
    assert [r.id for r in s.queue] == ["retry", "later"]  # by arrival: the retry keeps its place
    sent, _ = s.dispatch(6, [a, b])
    # `a` failed the retry: only `later` may go there; `b` is at its cap, so the retry waits.
    assert [(d.request.id, d.decision.backend.name) for d in sent] == [("later", "a")]
    assert b.outstanding == 1 and [r.id for r in s.queue] == ["retry"]
    release(b, busy)
    sent, _ = s.dispatch(7, [a, b])
    assert [(d.request.id, d.decision.backend.name) for d in sent] == [("retry", "b")]
    # With every backend excluded, a retry is rejected (the daemon answers 502).
    release(a, later)
    last = Request("last", "llama-3-8b", 10, 10, exclude=frozenset({"a", "b"}))
    s.submit(last)
    _, rejected = s.dispatch(8, [a, b])
    assert [d.request.id for d in rejected] == ["last"] and rejected[0].decision.reject
