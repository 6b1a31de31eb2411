"""The admission queue: strict priority classes, KV-derived caps, and the seed's aging rule."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from fleetctl.model.perf import EnginePerf, kv_budget
from fleetctl.routing.policies.round_robin import RoundRobin
from fleetctl.routing.policy import HardwareAware, Policy
from fleetctl.routing.scheduler import (
    PREFILL_WINDOW_S,
    Aging,
    RollingMedian,
    Scheduler,
    account,
    decay,
    first_token,
    release,
)
from fleetctl.routing.types import Backend, Decision, Request
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


# The tests below pin the queue's own rules with a policy that has no cost model: it takes the
# first backend it is offered, so which request goes where follows from the scheduler alone.


class FirstListed(Policy):
    """Admission on; picks the first eligible backend; records whom it was asked to place."""

    name = "first-listed"
    admission = True

    def __init__(self) -> None:
        self.asked: list[int | str] = []

    def choose(self, req: Request, backends: Sequence[Backend]) -> Decision:
        self.asked.append(req.id)
        return Decision(backends[0], self.name)


def plain(name, kv_tokens=10_000, max_seqs=100, model="m", **kw) -> Backend:
    return Backend(name, name, "gpu", model, "bf16", kv_tokens, max_seqs, **kw)


def req(rid, prompt, output, **kw) -> Request:
    return Request(rid, "m", prompt, output, **kw)


def sent_to(sent) -> list[tuple[int | str, str]]:
    return [(d.request.id, d.decision.backend.name) for d in sent]


def test_rolling_median_is_the_middle_value_of_odd_and_even_counts():
    m = RollingMedian(60)
    for v in (16.0, 1.0, 8.0, 2.0, 4.0):
        m.add(0, v)
    # Sorted 1, 2, 4, 8, 16: the middle (third) value.
    assert m.median(0) == 4.0
    m.add(0, 6.0)
    # Sorted 1, 2, 4, 6, 8, 16: the mean of the third and fourth, (4 + 6) / 2.
    assert m.median(0) == 5.0


def test_default_aging_is_twice_the_median_over_the_last_60_s():
    # README: router aging defaults to {factor: 2.0, window_s: 60}; the simulator relies on
    # Scheduler's default Aging for the same numbers.
    s = Scheduler(HardwareAware())
    for v in (1.0, 2.0, 4.0, 8.0, 16.0):
        s.observe_ttft(0.0, v)
    assert s.aging_threshold(0.0) == 8.0  # 2 x median 4.0 (a median of 1 cannot tell * from /)
    assert s.aging_threshold(59.5) == 8.0  # still inside the 60 s window
    assert s.aging_threshold(60.5) is None  # every sample is older than 60 s


def test_a_request_that_waited_exactly_the_threshold_is_not_boosted():
    # "waited longer than factor x median": 2 x 1.0 = 2.0 s; both times are exact in binary.
    s = Scheduler(FirstListed(), Aging(factor=2.0, window_s=60))
    s.observe_ttft(100.0, 1.0)
    on_time = req("on-time", 10, 10, priority=1, arrival=98.0)
    s.submit(on_time)
    s._age(100.0)
    assert not on_time.boosted and s.boosts == 0 and [r.id for r in s.classes[1]] == ["on-time"]
    s._age(100.5)  # 2.5 s > 2.0 s: now it joins the top class
    assert on_time.boosted and s.boosts == 1 and [r.id for r in s.classes[0]] == ["on-time"]


def test_submit_puts_negative_priorities_and_boosted_requests_in_the_top_class():
    s = Scheduler(FirstListed(), Aging(enabled=False))
    s.submit(req("top", 10, 10, priority=0, arrival=1.0))
    s.submit(req("neg", 10, 10, priority=-5, arrival=2.0))  # vLLM-style: below 0 is still top
    s.submit(req("boosted", 10, 10, priority=7, arrival=0.5, boosted=True))
    s.submit(req("low", 10, 10, priority=7, arrival=0.0))
    assert sorted(s.classes) == [0, 7] and len(s) == 4
    # The top class in arrival order (0.5, 1.0, 2.0), then class 7.
    assert [r.id for r in s.queue] == ["boosted", "top", "neg", "low"]


def test_remove_takes_a_cancelled_request_out_and_drops_its_emptied_class():
    s = Scheduler(FirstListed(), Aging(enabled=False))
    a, b, c = (
        req("a", 10, 10, priority=1),
        req("b", 10, 10, priority=1),
        req("c", 10, 10, priority=2),
    )
    for r in (a, b, c):
        s.submit(r)
    s.remove(b)
    assert [r.id for r in s.queue] == ["a", "c"] and sorted(s.classes) == [1, 2]
    s.remove(c)  # the last of class 2: the class goes with it
    assert [r.id for r in s.queue] == ["a"] and sorted(s.classes) == [1]
    s.remove(c)  # no longer queued: nothing happens
    assert [r.id for r in s.queue] == ["a"] and len(s) == 1
    s.remove(a)
    assert s.classes == {} and len(s) == 0


def test_kv_overcommit_scales_the_cap_and_an_exact_fit_is_admitted():
    # Cap = kv_tokens x overcommit = 10,000 x 1.5 = 15,000 tokens; 11,000 are reserved.
    b = plain("b", kv_tokens=10_000)
    b.outstanding, b.reserved_tokens = 1, 11_000
    s = Scheduler(FirstListed(), Aging(enabled=False), kv_overcommit=1.5)
    s.submit(req("exact", 3000, 1000, arrival=0))  # 11,000 + 4,000 = 15,000: fits exactly
    s.submit(req("one-more", 1, 1, arrival=1))  # then 15,002 > 15,000
    sent, _ = s.dispatch(0, [b])
    assert sent_to(sent) == [("exact", "b")] and b.reserved_tokens == 15_000
    assert [r.id for r in s.queue] == ["one-more"]


def test_a_request_waits_for_its_chosen_backend_at_its_sequence_cap():
    # The policy picks `full` (first listed), which runs max_num_seqs requests already and has
    # KV to spare: the request waits for it rather than exceed the cap (`spare` has room).
    full, spare = plain("full", max_seqs=2), plain("spare", max_seqs=2)
    full.outstanding = 2
    s = Scheduler(FirstListed(), Aging(enabled=False))
    s.submit(req("r", 10, 10))
    assert s.dispatch(0, [full, spare]) == ([], [])
    assert full.outstanding == 2 and [r.id for r in s.queue] == ["r"]


def test_backfill_looks_exactly_32_requests_past_a_blocked_one():
    # `b` has 5,000 of 10,000 tokens reserved: "big" (6,000) must wait; 40 small ones (20
    # tokens each) fit. The scan looks BACKFILL_SCAN = 32 further, so 32 go now, 8 wait.
    # `big` could go to any healthy backend of its model, so it holds no room: the small ones
    # may use `b`. (`sick` is of the model but unhealthy and `other` serves another model:
    # neither is a backend `big` could have had, so neither makes it "restricted".)
    b = plain("b", kv_tokens=10_000, max_seqs=100)
    b.outstanding, b.reserved_tokens = 1, 5000
    sick, other = plain("sick", healthy=False), plain("other", model="other")
    s = Scheduler(FirstListed(), Aging(enabled=False))
    s.submit(req("big", 5000, 1000, arrival=0))
    small = [req(f"s{i}", 10, 10, arrival=1 + i) for i in range(40)]
    for r in small:
        s.submit(r)
    sent, rejected = s.dispatch(0, [b, sick, other])
    assert sent_to(sent) == [(f"s{i}", "b") for i in range(32)] and not rejected
    assert [r.id for r in s.queue] == ["big", *(f"s{i}" for i in range(32, 40))]
    assert b.outstanding == 33 and b.reserved_tokens == 5000 + 32 * 20


def test_a_held_backend_keeps_later_requests_that_need_it_and_lets_others_pass():
    # Only `long` (max_model_len 32768) takes prompts over 8191 tokens. It has 15,000 of
    # 40,000 tokens free, so "long1" (25,000) waits for it and holds it: "long2" (10,000)
    # would fit there but may go nowhere else, so it waits too; "short" goes to `short`, not
    # to the first-listed `long`.
    long = plain("long", kv_tokens=40_000, max_model_len=32768)
    long.outstanding, long.reserved_tokens = 1, 25_000
    short = plain("short", kv_tokens=30_000, max_model_len=8192)
    policy = FirstListed()
    s = Scheduler(policy, Aging(enabled=False))
    for r in (
        req("long1", 24_000, 1000, arrival=0),
        req("long2", 9_000, 1000, arrival=1),
        req("short", 500, 100, arrival=2),
    ):
        s.submit(r)
    sent, _ = s.dispatch(0, [long, short])
    assert sent_to(sent) == [("short", "short")]
    assert [r.id for r in s.queue] == ["long1", "long2"] and long.reserved_tokens == 25_000
    # Only long1 and short reached the policy: long2's only backend was held.
    assert policy.asked == ["long1", "short"]


def test_a_rejected_request_does_not_stop_the_ones_behind_it():
    b = plain("b")
    s = Scheduler(FirstListed(), Aging(enabled=False))
    s.submit(Request("unknown", "no-such-model", 10, 10, arrival=0))
    s.submit(req("ok", 10, 10, arrival=1))
    sent, rejected = s.dispatch(0, [b])
    assert [d.request.id for d in rejected] == ["unknown"] and sent_to(sent) == [("ok", "b")]
    assert len(s) == 0 and s.classes == {}  # a rejected request is not kept


def test_no_smaller_requests_like_a_blocked_one_are_not_reexamined():
    # "big1" (6,000 tokens) finds no room on `b` (5,000 free). "big2" asks for the same and is
    # no smaller: it waits without the policy being asked. "diff" is as big but strict about
    # its format, so it is asked about (and waits); "small" still goes.
    b = plain("b", kv_tokens=10_000)
    b.outstanding, b.reserved_tokens = 1, 5000
    policy = FirstListed()
    s = Scheduler(policy, Aging(enabled=False))
    for r in (
        req("big1", 5000, 1000, arrival=0),
        req("big2", 5000, 1000, arrival=1),
        req("diff", 5000, 1000, arrival=2, precision="bf16", strict=True),
        req("small", 100, 100, arrival=3),
    ):
        s.submit(r)
    sent, _ = s.dispatch(0, [b])
    assert sent_to(sent) == [("small", "b")]
    assert policy.asked == ["big1", "diff", "small"]
    assert [r.id for r in s.queue] == ["big1", "big2", "diff"]


def test_accounting_of_a_request_from_dispatch_to_release():
    # prompt 1,000 of which 300 are expected cached, output 200: total 1,200, prefill 700.
    b = plain("b", kv_tokens=100_000)
    b.outstanding, b.reserved_tokens, b.pending_prefill, b.cached_sent = 2, 500, 100, 50
    r = req("r", 1000, 200, cached_tokens=300)
    account(b, r, 0.0)
    assert (b.outstanding, b.reserved_tokens, b.pending_prefill, b.cached_sent) == (
        3, 1700, 800, 350,
    )  # fmt: skip
    first_token(b, r)  # its prefill is done
    assert b.pending_prefill == 100
    release(b, r)  # finished after its first token: prefill already taken off
    assert (b.outstanding, b.reserved_tokens, b.pending_prefill, b.cached_sent) == (
        2, 500, 100, 350,
    )  # fmt: skip
    # One that fails before its first token takes its prefill off when released.
    account(b, r, 0.0)
    release(b, r, first_token_seen=False)
    assert (b.outstanding, b.reserved_tokens, b.pending_prefill) == (2, 500, 100)


def test_the_prefill_rate_spreads_each_prompt_over_the_window_and_fades():
    # PREFILL_WINDOW_S is 5 s: 700 tokens to compute (1,000 less 300 cached) add 700 / 5 =
    # 140 tokens/s at once; 5 s later e^-1 of it is left, and a second prompt then adds its own.
    assert PREFILL_WINDOW_S == 5.0
    b = plain("b", kv_tokens=100_000)
    account(b, req("r", 1000, 200, cached_tokens=300), 10.0)
    assert b.prefill_rate == pytest.approx(140.0) and b.rate_at == 10.0
    decay(b, 15.0)
    assert b.prefill_rate == pytest.approx(140.0 / math.e)
    second = req("s", 500, 10)
    account(b, second, 15.0)
    assert b.prefill_rate == pytest.approx(140.0 / math.e + 100.0)
    # Time never runs back: a dispatch stamped earlier neither grows nor rewinds it.
    decay(b, 12.0)
    assert b.prefill_rate == pytest.approx(140.0 / math.e + 100.0) and b.rate_at == 15.0
    # Releasing a request leaves the rate alone: it is what was sent, not what runs.
    release(b, second)
    assert b.prefill_rate == pytest.approx(140.0 / math.e + 100.0)


def test_dispatch_ages_every_backends_prefill_rate_to_now_before_choosing():
    seen: list[float] = []

    class Watching(FirstListed):
        def choose(self, r, backends):
            seen.append(backends[1].prefill_rate)
            return super().choose(r, backends)

    a, b = plain("a"), plain("b")
    b.prefill_rate, b.rate_at = 100.0, 0.0
    s = Scheduler(Watching(), Aging(enabled=False))
    s.submit(req("r", 10, 10))
    s.dispatch(5.0, [a, b])
    assert seen == [pytest.approx(100.0 / math.e)]


def test_a_fleet_with_no_free_sequence_slot_is_not_offered_any_request():
    # Every backend runs max_num_seqs requests: the queue stops before asking the policy
    # about any request (none could be placed), in this class and the ones below it.
    a, b = plain("a", max_seqs=2), plain("b", max_seqs=3)
    a.outstanding, b.outstanding = 2, 3
    policy = FirstListed()
    s = Scheduler(policy, Aging(enabled=False))
    s.submit(req("hi", 10, 10, priority=0))
    s.submit(req("lo", 10, 10, priority=1))
    assert s.dispatch(0, [a, b]) == ([], [])
    assert policy.asked == [] and [r.id for r in s.queue] == ["hi", "lo"]


def test_an_adapter_waiting_for_its_one_server_holds_back_no_base_model_request(catalog):
    """A LoRA adapter's request waits for the servers that have it loaded; its base model's
    requests of the same size still go to the others; an adapter whose servers are all out
    is the router's fault (503), not the request's."""
    g, m, f = catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3-8b"), catalog.format("bf16")
    perf = EnginePerf(g, m, f)
    loaded = Backend("loaded", "a", g.name, m.name, "bf16", 10_000, 64, perf)
    other = Backend("other", "b", g.name, m.name, "bf16", 10_000, 64, perf)
    loaded.adapters = frozenset({"sql"})
    loaded.outstanding, loaded.reserved_tokens = 3, 9_900  # no room for 1,000 more
    s = Scheduler(HardwareAware(), Aging(enabled=False))
    s.submit(Request("adapter", m.name, 900, 100, arrival=0, adapter="sql"))
    s.submit(Request("base", m.name, 900, 100, arrival=1))
    sent, rejected = s.dispatch(2, [loaded, other])
    assert [(d.request.id, d.decision.backend.name) for d in sent] == [("base", "other")]
    assert not rejected and [q.id for q in s.queue] == ["adapter"]
    loaded.healthy = False
    sent, rejected = s.dispatch(3, [loaded, other])
    assert not sent and [d.request.id for d in rejected] == ["adapter"]
    assert rejected[0].decision.down
