"""Routing policies (routing/policy.py, policies/) rule by rule, on hand-built backends.

Fast (no catalog, no simulation): scripts/mutation.py runs it once per mutant. The GPU here is
`LinearPerf`, a stand-in for fleetctl.model.perf.EnginePerf whose costs are linear, so every
estimate below is worked out by hand from HardwareAware.estimate's formula in a comment:

    prefill_marginal(tokens, context) = tokens / 1000 + context / 100_000   (seconds)
    step_time(tokens, kv_tokens)      = 0.01 + tokens / 1000 + kv_tokens / 100_000
"""

from __future__ import annotations

import pytest

from fleetctl.routing.goodput import Slo, cost, terms
from fleetctl.routing.policies.kv_aware import KvAware
from fleetctl.routing.policies.least_outstanding import LeastOutstanding
from fleetctl.routing.policies.power_of_two import PowerOfTwo
from fleetctl.routing.policies.round_robin import RoundRobin
from fleetctl.routing.policy import HardwareAware, Policy, RoutingConfig
from fleetctl.routing.prefix import PrefixIndex, PromptBlocks, chain
from fleetctl.routing.registry import make_policy
from fleetctl.routing.scheduler import account, first_token
from fleetctl.routing.sessions import Pin, SessionTable
from fleetctl.routing.types import Backend, Request


class LinearPerf:
    """A GPU whose prefill and step costs are linear (see the module docstring)."""

    def prefill_marginal(self, tokens: int, context: int = 0) -> float:
        return tokens / 1000 + context / 100_000

    def step_time(self, tokens: int, kv_tokens: float) -> float:
        return 0.01 + tokens / 1000 + kv_tokens / 100_000


PERF = LinearPerf()


def be(name, gpu="A", variant="bf16", kv=100_000, perf=PERF, node=None, model="m", **live):
    """A backend of class `gpu/variant` on node `node` (its own name by default)."""
    return Backend(name, node or name, gpu, model, variant, kv, perf=perf, **live)  # type: ignore[arg-type]


def rq(i=0, prompt=1000, out=100, **kw):
    return Request(i, "m", prompt, out, **kw)


def prompt_blocks(n_tokens, seed=0):
    """A prompt of `n_tokens` tokens in 16-token blocks (the last one partial)."""
    n = -(-n_tokens // 16)
    return PromptBlocks(chain(range(seed, seed + n)), 16, n_tokens)


# --- Policy.eligible (every policy) -----------------------------------------------------------


def test_eligible_keeps_healthy_backends_of_the_model_whose_length_takes_the_request():
    # prompt 500 + max_tokens 100: a context of 600 is needed.
    r = rq(prompt=500, out=100, max_tokens=100)
    fits, exact, unknown = be("fits", max_model_len=601), be("exact", max_model_len=600), be("u")
    short = be("short", max_model_len=599)
    sick = be("sick", healthy=False)
    other = be("other", model="other-model")
    pool, why = Policy().eligible(r, [fits, exact, unknown, short, sick, other])
    assert pool == [fits, exact, unknown] and why == ""  # 0: length unknown, not filtered


def test_eligible_without_max_tokens_needs_room_for_one_token():
    r = rq(prompt=500, out=100)  # no max_tokens: prompt + 1 = 501
    pool, _ = Policy().eligible(r, [be("a", max_model_len=501), be("b", max_model_len=500)])
    assert [b.name for b in pool] == ["a"]


def test_eligible_says_why_nothing_can_serve():
    p = Policy()
    r = rq(prompt=500, out=100, max_tokens=100)
    assert p.eligible(r, [be("sick", healthy=False), be("x", model="other")]) == (
        [],
        "no healthy backend serves m",
    )
    # Too short everywhere: the message names the longest (599, not 550).
    pool, why = p.eligible(r, [be("a", max_model_len=550), be("b", max_model_len=599)])
    assert pool == []
    assert why == (
        "prompt (500 tokens) + max_tokens needs a context of 600; the longest m serves is 599"
    )


# --- the baselines ----------------------------------------------------------------------------


def test_policy_flags_say_who_queues_and_who_reads_prefixes():
    # Only the seed's scheduler queues router-side and reads the prefix view; none keeps an
    # index of its own (the peers' cache-aware does, routing/policies/cache_aware.py).
    ours = ("round-robin", "least-outstanding", "power-of-two", "kv-aware", "hardware-aware")
    admission = {n: make_policy(n).admission for n in ours}
    reads = {n: make_policy(n).reads_prefix for n in ours}
    assert admission == {n: n == "hardware-aware" for n in ours}
    assert reads == {n: n == "hardware-aware" for n in ours}
    assert {n: make_policy(n).own_index for n in ours} == dict.fromkeys(ours, False)


def test_least_outstanding_takes_the_fewest_in_flight_then_the_first_name():
    bs = [be("c", outstanding=2), be("b", outstanding=3), be("a", outstanding=2)]
    d = LeastOutstanding().choose(rq(), bs)
    assert d.backend.name == "a" and d.reason == "least-outstanding (2)"


def test_kv_aware_ranks_by_kv_usage_then_waiting_then_in_flight_then_name():
    p = KvAware()

    def pick(*bs):
        return p.choose(rq(), list(bs)).backend.name

    assert pick(be("a", kv_usage=0.5), be("b", kv_usage=0.25)) == "b"
    assert pick(be("a", kv_usage=0.2, waiting=2), be("b", kv_usage=0.2, waiting=1)) == "b"
    assert pick(be("a", waiting=1, outstanding=4), be("b", waiting=1, outstanding=3)) == "b"
    assert pick(be("b", outstanding=1), be("a", outstanding=1)) == "a"
    assert p.choose(rq(), [be("a", kv_usage=0.25)]).reason == "kv-aware (usage 0.25)"


def test_power_of_two_with_one_backend_takes_it_and_says_so():
    d = PowerOfTwo().choose(rq(), [be("only")])
    assert d.backend.name == "only" and d.reason == "power-of-two (only one)"


def test_power_of_two_seeds_with_0_by_default():
    bs = [be(f"b{i}", outstanding=i) for i in range(6)]
    default, zero = PowerOfTwo(), PowerOfTwo(0)
    assert [default.choose(rq(), bs).backend.name for _ in range(20)] == [
        zero.choose(rq(), bs).backend.name for _ in range(20)
    ]


def test_round_robin_starts_at_the_first_backend():
    bs = [be("a"), be("b")]
    rr = RoundRobin()
    assert [rr.choose(rq(), bs).reason for _ in range(3)] == ["round-robin"] * 3
    assert RoundRobin().choose(rq(), bs).backend.name == "a"


def test_placed_records_what_the_prefix_view_held_and_tells_it_where_the_prompt_went():
    p = RoundRobin()
    p.prefix = PrefixIndex()  # learns from placements
    blocks = prompt_blocks(100)  # 7 blocks: 6 of 16 tokens and one of 4
    first = rq(prompt=100, blocks=blocks)
    p.placed(first, be("a"))
    assert first.cached_tokens == 0  # nothing there yet
    again = rq(1, prompt=100, blocks=blocks)
    p.placed(again, be("a"))
    assert again.cached_tokens == 100  # the first placement taught the index all 7 blocks
    # Without hashes nothing is looked up, and nothing breaks.
    plain = rq(2, prompt=100)
    p.placed(plain, be("a"))
    assert plain.cached_tokens == 0


def test_a_policy_knows_no_prefix_until_given_a_view():
    r = rq(prompt=100, blocks=prompt_blocks(100))
    RoundRobin().placed(r, be("a"))
    RoundRobin().placed(r, be("a"))
    assert r.cached_tokens == 0


# --- HardwareAware.estimate: the first token ---------------------------------------------------
#
# estimate = queued prefill at f(2048) / 2048 = 1 ms a token + its own f(prompt - cached,
# cached) + one decode step of the batch it joins: step(in flight + 1, KV in flight (at most
# the cache) + its prompt + half its output); plus, when KV overflows, one decode of the
# model's mean output (its own where the config has none) per overflowing share of each request
# in flight.


def test_estimate_is_queued_prefill_then_ours_then_one_decode_step():
    ha = HardwareAware()
    b = be("b", outstanding=3, pending_prefill=4096, reserved_tokens=3000)
    r = rq(prompt=1000, out=200)
    # queued: 4096 * f(2048) / 2048 = 4096 * 2.048 / 2048 = 4.096 s; ours: f(1000) = 1.0 s.
    # It joins 3 in flight: step(4, 3000 + 1000 + 100) = 0.01 + 0.004 + 0.041 = 0.055 s.
    assert ha.estimate(b, r) == pytest.approx(4.096 + 1.0 + 0.055)
    # The scraped running count stands for in-flight requests other routers sent there.
    b = be("b", outstanding=1, running=3, pending_prefill=4096, reserved_tokens=3000)
    assert ha.estimate(b, r) == pytest.approx(4.096 + 1.0 + 0.055)


class LongPromptPerf(LinearPerf):
    """LinearPerf whose prefill also pays attention over the prompt itself, as a real GPU's
    does: 1 ms a token plus 1 ms per 10,000 tokens of the prompt for each of its tokens."""

    def prefill_marginal(self, tokens: int, context: int = 0) -> float:
        return super().prefill_marginal(tokens, context) + tokens * (context + tokens) / 1e7


def test_queued_prefill_is_each_prompts_own_time_not_a_chunks_speed():
    # One queued 20,000-token prompt takes f = 20 + 40 = 60 s, three times the 20.48 s its
    # tokens would at a 2,048-token chunk's speed: the router keeps the seconds it sent.
    long = rq(prompt=20_000, out=10)
    b = be("b", perf=LongPromptPerf())
    account(b, long, 0.0)
    assert b.pending_prefill == 20_000 and b.pending_prefill_s == pytest.approx(60.0)
    # A 1-token prompt waits 60 s, then f(1) = 0.0010001 and step(2, 20,010 + 1 + 1) = 0.21212.
    assert HardwareAware().estimate(b, rq(prompt=1, out=2)) == pytest.approx(60.2131201)
    first_token(b, long)
    assert (b.pending_prefill, b.pending_prefill_s) == (0, pytest.approx(0.0))
    # So a short request waits behind 30,000 tokens of short prompts (30.3 s) rather than
    # behind the one long prompt, whose 20,000 tokens a chunk's speed reads as 20.5 s.
    account(b, long, 0.0)
    many = be("a", perf=LongPromptPerf(), pending_prefill=30_000, pending_prefill_s=30.3)
    assert HardwareAware().choose(rq(prompt=100, out=10), [b, many]).backend is many


def test_estimate_of_a_tiny_request_on_an_idle_backend_counts_one_sequence_of_one_token():
    ha = HardwareAware()
    # prompt 1 + output 2: ours f(1) = 0.001; a batch of 1 with 1 + 2 // 2 = 2 tokens of
    # context: step(1, 2) = 0.01 + 0.001 + 0.00002.
    assert ha.estimate(be("b"), rq(prompt=1, out=2)) == pytest.approx(0.001 + 0.01102)
    # One in flight (no tokens reserved) makes a batch of two.
    assert ha.estimate(be("b", outstanding=1), rq(prompt=1, out=2)) == pytest.approx(0.01302)


def test_estimate_skips_the_prefill_of_what_is_cached_as_far_as_prefix_trust_goes():
    ha = HardwareAware()
    b = be("b", prefix_trust=0.75)
    r = rq(prompt=1000, out=200)
    # cached 601 * 0.75 = 450.75 -> 450 tokens: ours f(550, 450) = 0.55 + 0.0045;
    # step(1, 1100) = 0.01 + 0.001 + 0.011 = 0.022.
    assert ha.estimate(b, r, cached=601) == pytest.approx(0.5545 + 0.022)
    assert ha.estimate(b, r, cached=0) == pytest.approx(1.0 + 0.022)


def test_estimate_looks_up_the_cache_but_always_computes_the_last_prompt_token():
    ha = HardwareAware()
    blocks = prompt_blocks(1000)
    ha.prefix = PrefixIndex(learn=False)
    ha.prefix.insert("warm", blocks.hashes)  # the whole prompt
    ha.prefix.insert("half", blocks.hashes[:32])  # 32 blocks of 16 = 512 tokens
    r = rq(prompt=1000, out=200, blocks=blocks)
    # warm: all 1000 cached, capped at 999: f(1, 999) = 0.001 + 0.00999; step 0.022.
    assert ha.estimate(be("warm"), r) == pytest.approx(0.01099 + 0.022)
    assert ha.cached(be("warm"), r) == 999
    # half: f(488, 512) = 0.488 + 0.00512.
    assert ha.estimate(be("half"), r) == pytest.approx(0.49312 + 0.022)
    # Told what is cached, it does not look it up.
    assert ha.estimate(be("warm"), r, cached=512) == pytest.approx(0.49312 + 0.022)
    assert ha.cached(be("warm"), rq(prompt=1000)) == 0  # no hashes: nothing known


def test_estimate_without_a_perf_model_is_load_over_capacity():
    ha = HardwareAware()
    assert ha.estimate(be("b", perf=None, outstanding=6, max_num_seqs=4), rq()) == 1.5
    assert ha.estimate(be("b", perf=None, outstanding=6, max_num_seqs=0), rq()) == 6.0
    # ... and nothing about decode: no model of the GPU to say it.
    e = ha.predict(be("b", perf=None, outstanding=6, max_num_seqs=4), rq())
    assert (e.tpot_s, e.others, e.added_s()) == (0.0, 0.0, 0.0)


def test_estimate_adds_a_decode_per_overflowing_request_when_kv_overflows():
    ha = HardwareAware()
    r = rq(prompt=400, out=100)
    # (reserved 1300 + 500) / 1000 = 1.8: 0.8 * max(1, 1) * 100 output tokens * step, with
    # step(2, 1000 (the cache holds no more) + 400 + 50) = 0.01 + 0.002 + 0.0145 = 0.0265:
    # 2.12 s on top of f(400) + step.
    b = be("b", kv=1000, reserved_tokens=1300, outstanding=1)
    assert ha.estimate(b, r) == pytest.approx(0.4 + 2.12 + 0.0265)
    # Idle (0 in flight): still one request's decode per overflow, as a batch of one:
    # step(1, 1450) = 0.0255: 0.8 * 100 * 0.0255 = 2.04.
    b = be("b", kv=1000, reserved_tokens=1300)
    assert ha.estimate(b, r) == pytest.approx(0.4 + 2.04 + 0.0255)
    # Two in flight: two decodes per overflowing request, at step(3, 1450) = 0.0275:
    # 0.8 * 2 * 100 * 0.0275 = 4.4.
    b = be("b", kv=1000, reserved_tokens=1300, outstanding=2)
    assert ha.estimate(b, r) == pytest.approx(0.4 + 4.4 + 0.0275)
    # Exactly full is no overflow: (500 + 500) / 1000 = 1; step(2, 950) = 0.0215.
    b = be("b", kv=1000, reserved_tokens=500, outstanding=1)
    assert ha.estimate(b, r) == pytest.approx(0.4 + 0.0215)
    # A KV size of 0 (unknown) is taken as 1 token: (0 + 500) / 1 = 500, 499 decodes, at
    # step(2, 0 + 450) = 0.0165.
    b = be("b", kv=0, outstanding=1)
    assert ha.estimate(b, r) == pytest.approx(0.4 + 499 * 100 * 0.0165 + 0.0165)


def test_kv_wait_is_the_decodes_of_the_requests_in_flight_not_its_own_output():
    # The room a full cache frees comes from the ends of the requests in flight: each
    # overflowing one takes about the model's mean output (300 here) of steps to finish,
    # whatever this request asks for. A 2-token answer read its own 2 steps as the wait,
    # and queued for a full small-KV server while an idle one would have served it.
    ha = HardwareAware(RoutingConfig(mean_output={"m": 300}))
    r = rq(prompt=400, out=2)
    # (reserved 1398 + 402) / 1000 = 1.8: 0.8 * max(1, 1) * 300 * step, with
    # step(2, 1000 (the cache holds no more) + 400 + 1) = 0.01 + 0.002 + 0.01401 = 0.02601.
    full = be("full", kv=1000, reserved_tokens=1398, outstanding=1)
    assert ha.estimate(full, r) == pytest.approx(0.4 + 0.8 * 300 * 0.02601 + 0.02601)
    # 3,000 tokens queued (3.0 s) on an idle cache: 3.0 + f(400) + step(1, 401) = 3.41501.
    free = be("free", pending_prefill=3000)
    assert ha.estimate(free, r) == pytest.approx(3.41501)
    assert ha.choose(r, [full, free]).backend is free
    # Without a mean output for the model, its own output stands in (as before).
    assert HardwareAware().estimate(full, r) == pytest.approx(0.4 + 0.8 * 2 * 0.02601 + 0.02601)


def test_saturation_slows_the_decode_steps_not_the_first_token_past_0_85():
    ha = HardwareAware()
    r = rq(prompt=400, out=300)
    # step(2, 400 + 150) = 0.01 + 0.002 + 0.0055 = 0.0175; TTFT f(400) + step = 0.4175.
    # At 0.9: (0.9 - 0.85) / (1 - 0.85) = 1/3 of the room past the threshold in use: every
    # decode step 1 / (1 - 1/3) = 1.5 times as long.
    calm = ha.predict(be("b", outstanding=1), r)
    assert (calm.ttft_s, calm.tpot_s) == pytest.approx((0.4175, 0.0175))
    for hot in (
        be("b", outstanding=1, bandwidth_util=0.9),
        be("b", outstanding=1, compute_util=0.9),
    ):
        e = ha.predict(hot, r)
        assert (e.ttft_s, e.tpot_s) == pytest.approx((0.4175, 0.0175 * 1.5))
    # Both: 2/3 of it, three times as long; and the requests there slow as much.
    both = ha.predict(be("b", outstanding=1, bandwidth_util=0.9, compute_util=0.9), r)
    assert both.tpot_s == pytest.approx(0.0175 * 3)
    assert both.others_tpot_s == pytest.approx(calm.others_tpot_s * 3)
    # At or past full use: 10 times, not without bound.
    full = ha.predict(be("b", outstanding=1, bandwidth_util=1.0, compute_util=0.95), r)
    assert full.tpot_s == pytest.approx(0.0175 * 10)
    # Below the thresholds, nothing.
    below = be("b", outstanding=1, bandwidth_util=0.8, compute_util=0.8)
    assert ha.predict(below, r).tpot_s == pytest.approx(0.0175)


def test_a_saturation_threshold_of_1_turns_the_penalty_off_even_past_full_use():
    """The inventory allows `bandwidth_saturation: 1`; a measured read rate can come out a
    little over the GPU's peak. Before, that divided by 1 - 1 = 0."""
    ha = HardwareAware(RoutingConfig(bandwidth_saturation=1.0, compute_saturation=1.0))
    r = rq(prompt=400, out=300)
    over = be("b", outstanding=1, bandwidth_util=1.02, compute_util=1.01)
    assert ha.predict(over, r).tpot_s == pytest.approx(0.0175)  # the calm figure above


# --- HardwareAware.predict: decoding there, and what it does to the others ------------------------
#
# With one in flight and nothing reserved: the others' step alone is step(1, 0) = 0.011, ours
# with them step(2, prompt + out / 2). Prompts sent there at R tokens/s take rho = R x 1 ms of
# the GPU: a decode token takes step / (1 - rho), at most step + a full chunk of
# (2048 - batch) tokens at 1 ms each.


def test_a_request_alone_decodes_at_the_step_of_its_batch():
    e = HardwareAware().predict(be("b"), rq(prompt=1000, out=200))
    # step(1, 1000 + 100) = 0.022 s a token; nobody there to slow.
    assert (e.tpot_s, e.others, e.others_added_s, e.added_s()) == (
        pytest.approx(0.022), 0.0, 0.0, 0.0,
    )  # fmt: skip


def test_its_prefill_and_its_share_of_each_step_are_what_it_adds_to_the_others():
    e = HardwareAware().predict(be("b", outstanding=1), rq(prompt=1000, out=200))
    # Others alone: step(1, 0) = 0.011; with it step(2, 1100) = 0.023: 0.012 s more a step for
    # its 200 tokens (2.4 s), and its prefill f(1000) = 1 s stalls them: 3.4 s each.
    assert (e.tpot_s, e.others_tpot_s, e.others) == pytest.approx((0.023, 0.011, 1.0))
    assert e.others_added_s == pytest.approx(1.0 + 0.012 * 200)
    # What is cached there it does not compute: f(500, 500) = 0.505 s of prefill.
    e = HardwareAware().predict(be("b", outstanding=1), rq(prompt=1000, out=200), cached=500)
    assert e.others_added_s == pytest.approx(0.505 + 0.012 * 200)


def test_requests_past_the_kv_cache_and_max_num_seqs_do_not_decode_beside_it():
    r = rq(prompt=1000, out=200)
    # 4 in flight reserving 8,000 tokens of a 2,000-token cache: a quarter run at once.
    e = HardwareAware().predict(be("b", outstanding=4, reserved_tokens=8000, kv=2000), r)
    assert e.others == pytest.approx(1.0)
    # max_num_seqs 2 of 6 in flight.
    e = HardwareAware().predict(be("b", outstanding=6, max_num_seqs=2), r)
    assert e.others == pytest.approx(2.0)


def test_prompts_sent_there_lately_stretch_every_decode_token():
    r = rq(prompt=1000, out=200)
    # 500 tokens/s of prompts: rho = 0.5, each decode token twice its step (0.022 s).
    e = HardwareAware().predict(be("b", prefill_rate=500.0), r)
    assert e.tpot_s == pytest.approx(0.044)
    # ... at most a step with a full chunk: 0.022 + (2048 - 0 - 1) * 0.001.
    e = HardwareAware().predict(be("b", prefill_rate=999.0), r)
    assert e.tpot_s == pytest.approx(0.022 + 2.047)
    e = HardwareAware().predict(be("b", prefill_rate=5000.0), r)  # a backlog: rho >= 1
    assert e.tpot_s == pytest.approx(0.022 + 2.047)
    # A smaller --max-num-batched-tokens carries a smaller chunk: 0.022 + (512 - 1) * 0.001.
    e = HardwareAware().predict(be("b", prefill_rate=5000.0, max_num_batched_tokens=512), r)
    assert e.tpot_s == pytest.approx(0.022 + 0.511)


def test_cost_without_an_slo_is_the_seconds_the_fleets_requests_gain():
    r = rq(prompt=1000, out=200)
    e = HardwareAware().predict(be("b", outstanding=1), r)
    # TTFT f(1000) + step(2, 1100) = 1.023; its 199 decode tokens at 0.023; 3.4 s to the one
    # other request.
    assert cost(e, r, None) == pytest.approx(1.023 + 199 * 0.023 + 3.4)
    parts = terms(e, r, None)
    assert parts == pytest.approx({"ttft": 1.023, "tpot": 199 * 0.023, "others": 3.4})


def test_cost_with_an_slo_weighs_each_phase_against_its_objective():
    r = rq(prompt=1000, out=200)
    e = HardwareAware().predict(be("b", outstanding=1), r)
    # TTFT 1.023 s against 2 s; decode seconds against 199 x 50 ms = 9.95 s.
    slo = Slo(ttft_s=2.0, tpot_s=0.05)
    assert terms(e, r, slo) == pytest.approx(
        {"ttft": 1.023 / 2, "tpot": 199 * 0.023 / 9.95, "others": 3.4 / 9.95}
    )
    # One objective alone cannot set the rate between them: plain seconds.
    for half in (Slo(ttft_s=2.0), Slo(tpot_s=0.05)):
        assert cost(e, r, half) == pytest.approx(cost(e, r, None))


def test_with_an_slo_the_seconds_added_to_the_others_weigh_against_their_output():
    # A 3-token answer to a 20,000-token prompt: its 20 s of prefill stall the requests
    # decoding there, whose outputs are the model's mean (343 tokens), not its 3.
    slo = Slo(ttft_s=30.0, tpot_s=0.1)
    r = rq(prompt=20_000, out=3)
    e = HardwareAware().predict(be("b", outstanding=1), r)
    assert terms(e, r, slo, others_output=343) == pytest.approx(
        {"ttft": e.ttft_s / 30, "tpot": e.tpot_s / 0.1, "others": e.added_s() / (342 * 0.1)}
    )
    # Without the mean, its own output stands in (the rule before there was one).
    assert terms(e, r, slo)["others"] == pytest.approx(e.added_s() / (2 * 0.1))
    # So it no longer queues behind 40 s of prefill (a 60 s first token) to stall two
    # decodes rather than three: on the idle queue it gets its first token 40 s sooner.
    queued = be("a", outstanding=2, pending_prefill=40_000)
    free = be("b", outstanding=3)
    config = RoutingConfig(slo={"m": slo}, mean_output={"m": 343})
    d = HardwareAware(config).choose(r, [queued, free])
    assert d.backend is free and "by:ttft" in d.notes


# --- HardwareAware.choose ---------------------------------------------------------------------


def test_choose_takes_the_soonest_then_the_first_name_and_reports_its_estimate():
    ha = HardwareAware()
    r = rq(prompt=1000, out=200)
    fast, slow = be("z", outstanding=0), be("y", pending_prefill=2048)
    d = ha.choose(r, [slow, fast])
    assert d.backend is fast and d.label == "hardware-aware length:short by:ttft"
    assert d.ttft_s == pytest.approx(ha.estimate(fast, r))
    assert d.tpot_s == pytest.approx(ha.predict(fast, r).tpot_s)
    d = ha.choose(r, [be("b"), be("a")])
    assert d.backend.name == "a" and d.label == "hardware-aware length:short by:tie"


def test_a_request_is_long_past_long_context_tokens_of_prompt_plus_output():
    ha = HardwareAware()
    bs = [be("a"), be("b")]  # one KV size: no small-KV class
    assert ha.choose(rq(prompt=3996, out=100), bs).label == "hardware-aware length:short by:tie"
    assert ha.choose(rq(prompt=3997, out=100), bs).label == "hardware-aware length:long by:tie"


def test_small_kv_is_under_half_the_largest():
    ha = HardwareAware()
    long = rq(prompt=5000, out=100)
    half = [be("big", kv=100_000), be("half", kv=50_000)]
    assert ha.choose(long, half).label == "hardware-aware length:long by:tie"
    under = [be("big", kv=100_000, pending_prefill=2048), be("small", kv=49_999)]
    d = ha.choose(long, under)
    assert d.backend.name == "big" and d.label == "hardware-aware length:long->large-kv by:ttft"


def test_a_small_kv_backend_gets_a_long_request_only_4x_sooner():
    ha = HardwareAware()
    long = rq(prompt=5000, out=100)
    # small: idle, f(5000) + step(1, 5050) = 5 + 0.0615 = 5.0615 s, times the penalty 4:
    # 20.246 s. big: the same plus its queued prefill of q tokens at 1 ms each. Both idle
    # and alike, they decode alike: the first token decides.
    small = be("small", kv=10_000)

    def pick(q):
        return ha.choose(long, [be("big", pending_prefill=q), small])

    # q = 15 s: big 20.0615 < 20.246; q = 15.2 s: 20.2615 > 20.246 (a penalty of 5 would
    # keep it on big, one of 3 would have sent it to small already).
    assert pick(15_000).label == "hardware-aware length:long->large-kv by:ttft"
    d = pick(15_200)
    assert d.backend is small and d.label == "hardware-aware length:long->small-kv by:ttft"
    assert d.ttft_s == pytest.approx(5.0615)  # the estimate, not the penalized cost
    # Servers of different lengths are length classes already: no penalty on top.
    small_long = be("small", kv=10_000, max_model_len=16_384)
    d = ha.choose(long, [be("big", pending_prefill=1000, max_model_len=8192), small_long])
    assert d.backend is small_long


def test_long_small_kv_penalty_and_long_context_tokens_are_the_documented_defaults():
    # The values the docs and benchmarks/results/prefix_routing.md were measured with.
    c = RoutingConfig()
    assert (c.long_context_tokens, c.long_small_kv_penalty, c.large_kv_share) == (4096, 4.0, 0.5)
    assert (c.bandwidth_saturation, c.compute_saturation) == (0.85, 0.85)
    assert (c.affinity_slack_s, c.exclusive_window) == (0.25, 1000)


def test_a_config_given_by_keyword_replaces_the_defaults():
    # A short request, were it long, would take the 4x-sooner small-KV backend only by the
    # penalty; at a threshold of 500 tokens it is long, and with a penalty of 1 it goes by
    # its estimate: big is 2 s behind (2000 queued tokens).
    ha = HardwareAware(RoutingConfig(long_context_tokens=500, long_small_kv_penalty=1.0))
    big, small = be("big", pending_prefill=2000), be("small", kv=10_000)
    d = ha.choose(rq(prompt=1000, out=100), [big, small])
    assert d.backend is small and d.label == "hardware-aware length:long->small-kv by:ttft"
    d = HardwareAware().choose(rq(prompt=1000, out=100), [big, small])
    assert d.backend is small and d.label == "hardware-aware length:short by:ttft"


# --- precision and sessions ---------------------------------------------------------------------


def test_strict_precision_filters_and_names_the_formats_it_runs():
    ha = HardwareAware()
    bf16, fp8, int4 = be("x"), be("y", variant="fp8"), be("z", variant="awq-int4")
    pool, why = ha.eligible(rq(precision="int4", strict=True), [bf16, fp8, int4])
    assert pool == [int4] and why == ""
    assert ha.eligible(rq(precision="int8", strict=True), [int4, bf16, fp8]) == (
        [],
        "no backend serves m in int8 (it runs awq-int4, bf16, fp8)",
    )
    # Preferred, not strict: every format stays eligible; choose prefers the match.
    pool, _ = ha.eligible(rq(precision="int4"), [bf16, int4])
    assert pool == [bf16, int4]


def test_choose_prefers_the_hinted_format_and_says_how_it_went():
    ha = HardwareAware()
    busy_fp8, idle_bf16 = be("f", variant="fp8", outstanding=5), be("b")
    d = ha.choose(rq(precision="fp8"), [idle_bf16, busy_fp8])
    assert d.backend is busy_fp8 and d.notes == ("precision:prefer", "length:short")
    d = ha.choose(rq(precision="int4"), [idle_bf16, busy_fp8])
    # Sent to the busy one, its prefill would stall five requests decoding there.
    notes = ("precision:unavailable", "length:short", "by:others")
    assert d.backend is idle_bf16 and d.notes == notes
    d = ha.choose(rq(precision="fp8", strict=True), [busy_fp8])
    assert d.notes == ("precision:strict", "length:short")


def test_eligible_keeps_a_session_on_its_class_while_the_class_has_a_backend():
    ha = HardwareAware()
    a, b = be("a", gpu="A"), be("b", gpu="B")
    ha.sessions.set("s", Pin(b.node_class, "b"))
    assert ha.eligible(rq(session="s"), [a, b])[0] == [b]
    assert ha.eligible(rq(session="t"), [a, b])[0] == [a, b]
    # Its class gone: anywhere.
    c = be("c", gpu="C")
    assert ha.eligible(rq(session="s"), [a, c])[0] == [a, c]


def test_choose_keeps_a_session_on_its_class_and_node_within_affinity_slack():
    ha = HardwareAware()
    r0 = rq(0, prompt=1000, out=100, session="s")
    home, other = be("home", gpu="A"), be("other", gpu="A")
    ha.placed(r0, home)
    assert ha.sessions.get("s") == Pin("A/bf16", "home")
    far = be("far", gpu="B")  # another class, idle
    # home is 0.2 s behind other (200 queued tokens at 1 ms): within the slack of 0.25, it stays.
    home.pending_prefill = 200
    d = ha.choose(rq(1, prompt=1000, out=100, session="s"), [far, other, home])
    assert d.backend is home
    assert d.notes == ("affinity:class", "length:short", "by:ttft", "affinity:node")
    # 0.3 s behind: the other node of its class.
    home.pending_prefill = 300
    d = ha.choose(rq(2, prompt=1000, out=100, session="s"), [far, other, home])
    assert d.backend is other and d.notes == ("affinity:class", "length:short", "by:ttft")
    # Its class gone from the pool: anywhere, and it says so.
    d = ha.choose(rq(3, prompt=1000, out=100, session="s"), [far])
    assert d.backend is far and d.notes == ("affinity:class-gone", "length:short")


def test_placed_pins_a_session_and_moves_the_pin_with_its_node():
    ha = HardwareAware()
    ha.placed(rq(0, session="s"), be("a1", gpu="A"))
    ha.placed(rq(1, session="s"), be("a2", gpu="A"))
    assert ha.sessions.get("s") == Pin("A/bf16", "a2")
    ha.placed(rq(2, session="s"), be("b1", gpu="B"))
    assert ha.sessions.get("s") == Pin("B/bf16", "b1")
    # Another class on the same node: the pin follows the class.
    ha.placed(rq(3, session="s"), be("c1", gpu="C", node="b1"))
    assert ha.sessions.get("s") == Pin("C/bf16", "b1")
    ha.placed(rq(4), be("d1", gpu="D"))  # no session: no pin
    assert list(ha.sessions.pins) == ["s"]


def test_the_session_table_keeps_the_sessions_used_last():
    table = SessionTable(capacity=2)
    table.set("a", Pin("A/bf16", "a1"))
    table.set("b", Pin("B/bf16", "b1"))
    assert table.get("a") == Pin("A/bf16", "a1")  # a used: b is now the oldest
    table.set("c", Pin("C/bf16", "c1"))
    assert list(table.pins) == ["a", "c"] and table.get("b") is None


class CountingSessions(SessionTable):
    """A session table that counts writes (the shared one sends each to Redis, stamped)."""

    def __init__(self):
        super().__init__()
        self.writes = 0

    def set(self, session, pin):
        self.writes += 1
        super().set(session, pin)


def test_a_turn_that_stays_on_its_pinned_node_writes_no_pin():
    ha = HardwareAware(sessions=CountingSessions())
    a = be("a1", gpu="A")
    for i in range(3):
        ha.placed(rq(i, session="s"), a)
    assert ha.sessions.writes == 1


# --- prefix hits ---------------------------------------------------------------------------------


def test_placed_keeps_what_choose_looked_up_and_teaches_the_index():
    ha = HardwareAware()
    blocks = prompt_blocks(1000)
    index = PrefixIndex()  # learns from placements
    ha.prefix = index
    index.insert("warm", blocks.hashes[:32])  # 512 tokens
    warm, cold = be("warm"), be("cold")
    r = rq(prompt=1000, out=100, blocks=blocks)
    d = ha.choose(r, [cold, warm])
    assert d.backend is warm and d.notes == ("length:short", "by:ttft", "prefix:hit")
    # More of it arrives there before the placement: choose's look-up is what counts.
    index.insert("warm", blocks.hashes)
    assert (d.cached_tokens, d.looked_up) == (512, True)
    ha.placed(r, warm, d)
    assert r.cached_tokens == 512
    # Placed elsewhere than chosen: looked up there (nothing), and the index learns it.
    r2 = rq(1, prompt=1000, out=100, blocks=blocks)
    d2 = ha.choose(r2, [cold, warm])
    ha.placed(r2, cold, d2)
    assert r2.cached_tokens == 0 and index.match("cold", blocks.hashes) == len(blocks.hashes)


def test_a_prefix_hit_elsewhere_is_not_reported_for_a_cold_pick():
    ha = HardwareAware()
    blocks = prompt_blocks(1000)
    ha.prefix = PrefixIndex(learn=False)
    ha.prefix.insert("warm", blocks.hashes[:32])
    warm, cold = be("warm", pending_prefill=5000), be("cold")
    d = ha.choose(rq(prompt=1000, out=100, blocks=blocks), [warm, cold])
    assert d.backend is cold and d.notes == ("length:short", "by:ttft")


# --- work only one class can do -------------------------------------------------------------------


def _two_lengths():
    """Class L serves 32K contexts, class S 8K."""
    return be("l", gpu="L", max_model_len=32_768), be("s", gpu="S", max_model_len=8192)


def test_a_request_only_some_classes_can_take_is_exclusive_work_for_them():
    ha = HardwareAware()
    big, small = _two_lengths()
    long, short = rq(0, prompt=10_000), rq(1, prompt=1000)
    pool, _ = ha.eligible(long, [big, small])
    assert pool == [big] and pool.exclusive
    pool, _ = ha.eligible(short, [big, small])
    assert pool == [big, small] and not pool.exclusive
    # The verdict travels with the pool and the decision, never with the policy.
    d = ha.choose(long, ha.eligible(long, [big, small])[0])
    assert d.exclusive and not ha.choose(short, [big, small]).exclusive
    # Backends of other models, or down, are no classes of this one's.
    other = be("o", gpu="O", model="other", max_model_len=65_536)
    down = be("d", gpu="D", healthy=False, max_model_len=65_536)
    assert not ha.eligible(short, [small, other, down])[0].exclusive


def place(ha: HardwareAware, req, fleet, backend=None):
    """Through eligible and choose to placed, as the scheduler does; on `backend` if given."""
    pool, _ = ha.eligible(req, fleet)
    d = ha.choose(req, pool)
    ha.placed(req, backend or d.backend, d)
    return d


def test_exclusive_share_is_a_decaying_average_over_placements():
    ha = HardwareAware()
    big, small = _two_lengths()
    fleet = [big, small]
    assert ha.exclusive_share("L") == 0.0  # no work yet
    long, short = rq(0, prompt=10_000), rq(1, prompt=1000)
    place(ha, long, fleet)  # L: (10000, 10000)
    assert ha.exclusive_share("L/bf16") == 1.0
    place(ha, short, fleet, small)  # every class ages by 0.999: L (9990, 9990); S (0, 1000)
    assert ha.exclusive_share("S/bf16") == 0.0
    short2 = rq(2, prompt=1000, cached_tokens=400)  # 600 tokens of prefill
    place(ha, short2, fleet, big)  # L: (9990 * 0.999, 9990 * 0.999 + 600)
    assert ha.exclusive_share("L/bf16") == pytest.approx(9980.01 / 10580.01)


def test_a_request_any_class_can_take_pays_for_delaying_exclusive_work():
    big, small = _two_lengths()
    fleet = [big, small]
    ha = HardwareAware()
    long = rq(0, prompt=10_000)
    place(ha, long, fleet)  # L's work: all exclusive, share 1
    short = rq(1, prompt=1000, out=100)
    # On L it pays share 1 * f(1000) = 1 s per request waiting there plus itself: with one
    # waiting, 2 s. S, otherwise alike, is q tokens of queued prefill (q ms) behind.
    big.waiting = 1

    def pick(q):
        small.pending_prefill = q
        return ha.choose(short, fleet).backend.name

    assert pick(1990) == "s" and pick(2010) == "l"


def test_exclusive_work_pays_nothing_for_delaying_exclusive_work():
    ha = HardwareAware()
    big, small = _two_lengths()
    big2 = be("l2", gpu="L2", max_model_len=32_768)  # another class of the long length
    fleet = [big, big2, small]
    first = rq(0, prompt=10_000, out=100)
    place(ha, first, fleet, big)  # L's share: 1; L2's: 0
    second = rq(1, prompt=10_000, out=100)
    pool, _ = ha.eligible(second, fleet)
    assert pool == [big, big2]
    # L2 is 5 s behind (5000 queued tokens); were `second` charged L's share of its own
    # prefill (10 s) on L, L2 would win.
    big2.pending_prefill = 5000
    assert ha.choose(second, pool).backend is big


def test_what_it_has_cached_shrinks_what_a_request_would_delay_there():
    big, small = _two_lengths()
    fleet = [big, small]
    ha = HardwareAware()
    ha.prefix = PrefixIndex(learn=False)
    long = rq(0, prompt=10_000)
    place(ha, long, fleet)  # L's share: 1
    blocks = prompt_blocks(1000)
    ha.prefix.insert("l", blocks.hashes[:32])  # L holds 512 of its 1000 tokens
    short = rq(1, prompt=1000, out=100, blocks=blocks)
    big.waiting = 1
    # On L: f(488, 512) = 0.49312 of prefill, and as much again per request waiting (one):
    # 0.98624 on top of its estimate f(488, 512) + step. On S: f(1000) + step + q ms.
    # S wins while 1.0 + q / 1000 < 0.49312 + 0.98624, that is q < 479.36.

    def pick(q):
        small.pending_prefill = q
        return ha.choose(short, fleet).backend.name

    assert pick(470) == "s" and pick(490) == "l"


def test_one_class_pays_nothing_for_its_own_exclusive_work():
    # All of L's work was exclusive, but a pool of L alone has no other class to spare it:
    # l1 (5 waiting, which only the exclusive-work term counts) is 1 s sooner than l2.
    l1, l2 = be("l1", gpu="L", max_model_len=32_768), be("l2", gpu="L", max_model_len=32_768)
    s = be("s", gpu="S", max_model_len=8192)
    ha = HardwareAware()
    long = rq(0, prompt=10_000)
    place(ha, long, [l1, l2, s], l1)
    short = rq(1, prompt=1000, out=100)
    l1.waiting, l2.pending_prefill = 5, 1000
    assert ha.choose(short, [l1, l2]).backend is l1


def test_a_backend_without_a_perf_model_is_ranked_by_load_alone():
    # Two classes, nothing exclusive: the one without a perf model costs its load ratio, 0
    # when idle, against 0.1 + step(1, 550) for 100 tokens on the other.
    ha = HardwareAware()
    known, unknown = be("known", gpu="L"), be("unknown", gpu="X", perf=None)
    assert ha.choose(rq(prompt=100, out=1000), [known, unknown]).backend is unknown
