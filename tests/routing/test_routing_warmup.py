"""Warm-up-aware routing, rule by rule on hand-built backends: which server states a request
may go to under every registered policy, a warm-up's seconds in hardware-aware's predicted
first token, and the scheduler holding a request for a wake it asks for (routing/policy.py,
routing/scheduler.py)."""

from __future__ import annotations

import pytest

from fleetctl.daemon.router import keep_state
from fleetctl.routing.goodput import Slo
from fleetctl.routing.policy import HardwareAware, Pool, RoutingConfig
from fleetctl.routing.registry import REGISTRY, make_policy
from fleetctl.routing.scheduler import Scheduler, all_down
from fleetctl.routing.sessions import Pin, SessionTable
from fleetctl.routing.types import ASLEEP, AWAKE, DRAINING, STARTING, WAKING, Backend
from tests.routing.test_policy_units import PERF, be, rq


def _fleet(**states: str) -> list[Backend]:
    """One backend per name, in the state given; every sleeper may be woken."""
    out = []
    for name, state in states.items():
        b = be(name)
        b.state, b.wakeable, b.wake_s = state, True, 5.0
        out.append(b)
    return out


def _names(pool: list[Backend]) -> set[str]:
    return {b.name for b in pool}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_policy_sends_only_to_awake_servers_while_one_is_awake(name):
    """Mixed states: a draining, an asleep, a waking and a starting server are never chosen
    while an awake one is there, whatever the policy (hardware-aware: its objective met)."""
    policy = make_policy(name, config=RoutingConfig(slo={"m": Slo(ttft_s=10.0)}))
    backends = _fleet(a=ASLEEP, w=WAKING, s=STARTING, d=DRAINING, up=AWAKE)
    for i in range(20):
        pool, why = policy.eligible(rq(i), backends)
        assert pool and not why
        assert DRAINING not in {b.state for b in pool}
        pool.now = 0.0
        decision = policy.choose(rq(i), pool)
        assert decision.backend is not None and decision.backend.name == "up", decision


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_with_none_awake_a_warm_up_is_chosen_and_a_draining_one_never(name):
    policy = make_policy(name)
    pool, _ = policy.eligible(rq(), _fleet(a=ASLEEP, w=WAKING, d=DRAINING))
    assert "d" not in _names(pool)
    pool.now = 0.0
    decision = policy.choose(rq(), pool)
    assert decision.backend is not None and decision.backend.name in {"a", "w"}
    # Only draining: nothing new goes there, and the client hears the servers are down.
    pool, why = policy.eligible(rq(), _fleet(d=DRAINING))
    assert not pool and why.startswith("no awake server serves m")


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_a_sleeper_without_sleep_mode_is_never_chosen(name):
    policy = make_policy(name)
    (b,) = _fleet(a=ASLEEP)
    b.wakeable = False
    pool, why = policy.eligible(rq(), [b])
    assert not pool and why


def test_predicted_first_token_counts_a_wake_and_what_is_left_of_one():
    """Asleep: its whole wake (wake_s); waking: ready_at - now; awake: none."""
    policy = HardwareAware()
    awake, asleep, waking = _fleet(up=AWAKE, a=ASLEEP, w=WAKING)
    waking.ready_at = 103.0
    base = policy.estimate(awake, rq())
    policy._now = 100.0
    assert policy.estimate(asleep, rq()) == pytest.approx(base + 5.0)
    assert policy.estimate(waking, rq()) == pytest.approx(base + 3.0)
    policy._now = 104.0  # past its expected end: no more wait than an awake one's
    assert policy.estimate(waking, rq()) == pytest.approx(base)


def test_hardware_aware_wakes_where_every_awake_server_would_miss():
    """An awake server whose queue puts the first token past the objective loses to a
    sleeper whose wake is shorter than that queue; with the objective met, the awake one."""
    slo = Slo(ttft_s=2.0)
    policy = HardwareAware(RoutingConfig(slo={"m": slo}))
    busy, sleeper = _fleet(busy=AWAKE, a=ASLEEP)
    sleeper.wake_s = 1.0
    busy.pending_prefill, busy.pending_prefill_s = 10_000, 10.0  # 10 s of prompts queued
    pool = Pool([busy, sleeper], now=0.0)
    d = policy.choose(rq(), pool)
    assert d.backend is sleeper and "wake" in d.notes and "awake:miss" in d.notes
    assert d.ttft_s is not None and d.ttft_s >= 1.0
    busy.pending_prefill, busy.pending_prefill_s = 0, 0.0
    d = policy.choose(rq(), Pool([busy, sleeper], now=0.0))
    assert d.backend is busy and "wake" not in d.notes


def test_the_scheduler_holds_a_request_for_the_wake_it_asks_once():
    """A dispatch that picks an asleep server marks it waking (ready_at = now + wake_s) and
    lists it once for its wake; the request waits in the queue, and goes there once the
    server is awake, its decision saying it waited for a wake."""
    sched = Scheduler(make_policy("round-robin"))
    (b,) = _fleet(a=ASLEEP)
    b.perf = PERF  # type: ignore[assignment]
    for i in range(3):
        sched.submit(rq(i, arrival=10.0))
    sent, rejected = sched.dispatch(10.0, [b])
    assert not sent and not rejected and len(sched) == 3
    assert b.state == WAKING and b.ready_at == pytest.approx(15.0)
    assert sched.take_woken() == [b]
    sent, _ = sched.dispatch(11.0, [b])
    assert not sent and sched.take_woken() == []  # one wake, not one per request
    b.state = AWAKE
    sent, _ = sched.dispatch(12.0, [b])
    assert len(sent) == 3 and all(d.decision.backend is b for d in sent)
    assert "after:wake" in sent[0].decision.notes
    assert "after:waking" in sent[1].decision.notes


def test_a_queue_waiting_for_a_warm_up_is_weighed_once_per_dispatch_not_per_request():
    """Requests like one that chose to wait for a warm-up wait too, unweighed: a burst queues
    thousands for the servers being woken, and weighing each against every backend at every
    event stalled the simulated burst (O(queue x backends) per event)."""
    policy = make_policy("round-robin")
    calls = 0
    choose = policy.choose

    def counted(req, backends):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return choose(req, backends)

    policy.choose = counted  # type: ignore[method-assign]
    sched = Scheduler(policy)
    (b,) = _fleet(a=ASLEEP)
    b.perf = PERF  # type: ignore[assignment]
    for i in range(50):
        sched.submit(rq(i, arrival=10.0))
    sched.dispatch(10.0, [b])
    sched.dispatch(11.0, [b])
    assert calls == 2 and len(sched) == 50
    b.state = AWAKE
    sent, _ = sched.dispatch(12.0, [b])
    assert len(sent) == 50 and "after:waking" in sent[-1].decision.notes


def test_a_model_with_only_draining_or_unwakeable_servers_is_down_not_a_bad_request():
    """Nothing of it can serve, through no fault of the request's: a 503, not a 400."""
    asleep, draining = _fleet(a=ASLEEP, d=DRAINING)
    asleep.wakeable = False
    assert all_down(rq(), [asleep, draining])
    asleep.wakeable = True
    assert not all_down(rq(), [asleep, draining])


def test_a_sessions_sleeping_class_does_not_wake_while_another_class_is_awake():
    """A session pinned to a class whose servers all sleep goes on an awake class rather
    than waking one; with no class awake, its own class is woken."""
    sessions = SessionTable()
    policy = HardwareAware(sessions=sessions)
    pinned = be("p", gpu="B")
    pinned.state, pinned.wakeable = ASLEEP, True
    other = be("o", gpu="A")
    sessions.set("s", Pin(pinned.node_class, pinned.node))
    pool, _ = policy.eligible(rq(session="s"), [pinned, other])
    pool.now = 0.0
    assert policy.choose(rq(session="s"), pool).backend is other
    other.state = DRAINING
    pool, _ = policy.eligible(rq(session="s"), [pinned, other])
    assert _names(pool) == {"p"}


def test_a_reload_keeps_what_the_router_knows_better_than_the_file():
    """A wake the router asked is still under way, and a server a scrape found asleep stays
    asleep until a scrape finds it awake; a file's draining always wins."""
    fresh = _fleet(x=AWAKE, y=ASLEEP, z=AWAKE, d=DRAINING)
    old = _fleet(x=ASLEEP, y=WAKING, z=AWAKE, d=WAKING)
    old[1].ready_at = 42.0
    for b, o in zip(fresh, old, strict=True):
        keep_state(b, o)
    assert [b.state for b in fresh] == [ASLEEP, WAKING, AWAKE, DRAINING]
    assert fresh[1].ready_at == 42.0


def test_a_split_models_sleeping_prefill_servers_stay_in_its_pool():
    """Awake-first holds per role: with every prefill server asleep, a split model's pool
    keeps one to wake beside its awake decode servers, so it stays split."""
    prefill, decode = _fleet(p=ASLEEP, d=AWAKE)
    prefill.role, decode.role = "prefill", "decode"
    pool, _ = make_policy("round-robin").eligible(rq(), [prefill, decode])
    assert _names(pool) == {"p", "d"}


def test_a_split_request_prefills_and_decodes_on_awake_servers_first():
    """Hardware-aware offers sleepers beside the awake servers, but a split request's phases
    are chosen by their queues alone: an awake prefill server before an asleep one, and an
    awake decode server or none (the KV cannot wait for a wake)."""
    sched = Scheduler(make_policy("hardware-aware"))
    asleep_p, awake_p, asleep_d, awake_d = _fleet(a=ASLEEP, b=AWAKE, c=ASLEEP, d=AWAKE)
    asleep_p.role = awake_p.role = "prefill"
    asleep_d.role = awake_d.role = "decode"
    fleet = [asleep_p, awake_p, asleep_d, awake_d]
    for b in fleet:
        b.perf = None  # speed unknown: the fewest in flight first, the first on a tie
    sched.submit(rq())
    sent, _ = sched.dispatch(0.0, fleet)
    assert [d.decision.backend for d in sent] == [awake_p] and sched.take_woken() == []
    decision = sched.decode_for(rq(), fleet, force=True)
    assert decision is not None and decision.backend is awake_d
    awake_d.state = DRAINING
    decision = sched.decode_for(rq(), fleet, force=True)
    assert decision is not None and decision.reject and decision.down
