"""The peers' prefix-aware policies (routing/policies/) on hand-built snapshots and in simulation.

The crossovers below are worked out by hand from each peer's published defaults, written here
as literals (not read back from the classes), so a changed default or formula fails a test:
- sgl-router / vllm-router cache_aware: cache_threshold 0.3, balance_abs_threshold 64,
  balance_rel_threshold 1.5, max_tree_size 2^26 characters;
- llm-d precise prefix profile: prefix 2.0, kv-cache-utilization 1.0, queue 1.0;
- Dynamo KV router: overlap_score_weight 1.0, temperature 0.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from fleetctl.routing.prefix import PrefixIndex, PromptBlocks, chain
from fleetctl.routing.registry import make_policy, policy_names
from fleetctl.routing.types import Request
from fleetctl.sim.fleet import simulate
from fleetctl.sim.workload import Synthetic
from tests.routing.test_policy import backend, server

BT = 16  # tokens per block in these tests
PEERS = ("cache-aware", "prefix-kv", "kv-router")


def blocks(ids, tokens=None):
    ids = list(ids)
    return PromptBlocks(chain(ids), BT, len(ids) * BT if tokens is None else tokens)


def req(i=0, b=None, prompt=None, out=100):
    prompt = prompt if prompt is not None else (b.tokens if b is not None else 500)
    return Request(i, "llama-3-8b", prompt, out, blocks=b)


def cached_view(**held):
    """The engines' cache contents (a KV-event-fed index): backend -> leading block ids."""
    view = PrefixIndex(learn=False)
    for name, ids in held.items():
        view.insert(name, chain(ids))
    return view


# --- cache-aware (sgl-router / vllm-router) -------------------------------------------------


def _warm(policy, b, name, catalog):
    """The policy sends prompt `b` to backend `name` (its own tree learns it)."""
    policy.placed(req(b=b), backend(catalog, name))


def test_cache_aware_follows_its_tree_when_balanced_and_balances_past_both_thresholds(catalog):
    p = make_policy("cache-aware")
    prompt = blocks(range(10))
    _warm(p, prompt, "b1", catalog)

    def pick(lo, hi):
        bs = [backend(catalog, "b0", outstanding=lo), backend(catalog, "b1", outstanding=hi)]
        return p.choose(req(b=prompt), bs)

    d = pick(0, 0)
    assert d.backend.name == "b1" and d.label == "cache-aware prefix:hit"
    # Absolute threshold 64: a gap of 64 is balanced, 65 is not (165 > 1.5 * 100 holds too).
    assert pick(100, 164).backend.name == "b1"
    d = pick(100, 165)
    assert d.backend.name == "b0" and d.label == "cache-aware balance"
    # Relative threshold 1.5: 299 <= 1.5 * 200 is balanced, 301 is not (both gaps > 64).
    assert pick(200, 299).backend.name == "b1"
    assert pick(200, 301).backend.name == "b0"


def test_cache_aware_needs_a_match_rate_strictly_above_0_3(catalog):
    p = make_policy("cache-aware")
    _warm(p, blocks(range(4)), "b1", catalog)
    bs = [backend(catalog, "b0"), backend(catalog, "b1", outstanding=1)]
    # 3 of 10 blocks: rate 0.3, not above the threshold: the least loaded (b0).
    d = p.choose(req(b=blocks([0, 1, 2, 90, 91, 92, 93, 94, 95, 96])), bs)
    assert d.backend.name == "b0" and d.label == "cache-aware prefix:miss"
    # 4 of 10: rate 0.4: the match, though b1 carries more load.
    d = p.choose(req(b=blocks([0, 1, 2, 3, 91, 92, 93, 94, 95, 96])), bs)
    assert d.backend.name == "b1" and d.label == "cache-aware prefix:hit"


def test_cache_aware_without_blocks_takes_the_least_loaded_and_ignores_the_view(catalog):
    p = make_policy("cache-aware", prefix=cached_view(b1=range(10)))
    bs = [backend(catalog, "b0", outstanding=3), backend(catalog, "b1", outstanding=2)]
    d = p.choose(req(), bs)
    assert d.backend.name == "b1" and d.label == "cache-aware prefix:none"
    # The KV-event view says b1 holds the prompt; the peer has no such view, and its own
    # tree is empty: the least loaded, the first of equals as Rust's min_by_key.
    bs[1].outstanding = 3
    assert p.choose(req(b=blocks(range(10))), bs).backend.name == "b0"


def test_cache_aware_tree_is_bounded_by_the_peers_tree_size(catalog):
    p = make_policy("cache-aware")
    _warm(p, blocks(range(3)), "b0", catalog)
    # 2^26 characters at 4 characters a token, in 16-token blocks.
    assert p.tree.capacity == 2**26 // (4 * BT)
    p.tree.capacity = 2
    _warm(p, blocks(range(3)), "b0", catalog)
    assert p.tree.size("b0") == 2


def test_cache_aware_ties_are_seeded_and_sticky(catalog):
    prompt = blocks(range(8))

    def picks(seed):
        p = make_policy("cache-aware", seed)
        bs = [backend(catalog, f"b{i}") for i in range(4)]
        for b in bs:
            _warm(p, prompt, b.name, catalog)
        return [p.choose(req(b=prompt), bs).backend.name for _ in range(5)]

    assert picks(1) == picks(1)
    assert len(set(picks(1))) == 1  # the same node answers the same tenant
    assert len({picks(s)[0] for s in range(12)}) > 1  # an arbitrary one, not the first


# --- prefix-kv (llm-d precise prefix profile) ------------------------------------------------


def test_prefix_kv_follows_the_prefix_until_queue_and_kv_outweigh_it(catalog):
    # b1 holds p of the prompt's blocks, has the longer queue (queue score 0, b0's 1) and
    # kv usage u1; b0 is empty. score(b1) - score(b0) = 2 p - 1 - u1.
    prompt = blocks(range(10))
    p = make_policy("prefix-kv", prefix=cached_view(b1=range(6)))  # p = 0.6: 0.2 - u1

    def pick(u1):
        bs = [backend(catalog, "b0"), backend(catalog, "b1", waiting=5, kv_usage=u1)]
        return p.choose(req(b=prompt), bs)

    d = pick(0.1)
    assert d.backend.name == "b1" and d.label == "prefix-kv prefix:hit"
    d = pick(0.3)
    assert d.backend.name == "b0" and d.label == "prefix-kv prefix:miss"
    # Balanced load: any match wins.
    p = make_policy("prefix-kv", prefix=cached_view(b1=range(1)))
    bs = [backend(catalog, "b0"), backend(catalog, "b1")]
    assert p.choose(req(b=prompt), bs).backend.name == "b1"


def test_prefix_kv_queue_is_min_max_of_the_engines_waiting_queue(catalog):
    p = make_policy("prefix-kv")
    # The router's own in-flight count is not what llm-d reads: vllm:num_requests_waiting is.
    bs = [backend(catalog, "b0", outstanding=50), backend(catalog, "b1", waiting=1)]
    assert p.choose(req(), bs).backend.name == "b0"
    # Min-max: waiting 0 / 5 / 10 score 1 / 0.5 / 0, so 0.5 of queue beats 0.4 of kv usage.
    bs = [
        backend(catalog, "b0", waiting=10),
        backend(catalog, "b1", waiting=5),
        backend(catalog, "b2", waiting=0, kv_usage=0.6),
    ]
    assert p.scores(req(), bs) == pytest.approx({"b0": 1.0, "b1": 1.5, "b2": 1.4})
    # Min-max from the shortest queue, not from 0: 2 / 5 / 8 score 1 / 0.5 / 0.
    for b, waiting in zip(bs, (8, 5, 2), strict=True):
        b.waiting = waiting
    assert p.scores(req(), bs) == pytest.approx({"b0": 1.0, "b1": 1.5, "b2": 1.4})
    d = p.choose(req(), bs)
    assert d.backend.name == "b1" and d.label == "prefix-kv prefix:none"


def test_prefix_kv_ties_are_random_but_seeded(catalog):
    bs = [backend(catalog, f"b{i}") for i in range(3)]

    def picks(seed):
        p = make_policy("prefix-kv", seed)
        return [p.choose(req(), bs).backend.name for _ in range(20)]

    assert picks(4) == picks(4)
    assert len(set(picks(4))) == 3
    assert any(picks(s) != picks(4) for s in range(5, 10))  # the seed decides


# --- kv-router (Dynamo) --------------------------------------------------------------------


def test_kv_router_follows_the_overlap_until_prefill_backlog_outweighs_it(catalog):
    # A 10-block prompt, all cached on b1: cost(b0) = 160/16 + 10 new blocks = 20;
    # cost(b1) = pending_prefill / 16 + 0 new blocks. The crossover is 320 pending tokens.
    prompt = blocks(range(10))
    p = make_policy("kv-router", prefix=cached_view(b1=range(10)))

    def pick(**b1):
        bs = [backend(catalog, "b0"), backend(catalog, "b1", **b1)]
        return p.choose(req(b=prompt), bs)

    d = pick()
    assert d.backend.name == "b1" and d.label == "kv-router prefix:hit"
    assert pick(pending_prefill=300).backend.name == "b1"
    d = pick(pending_prefill=340)
    assert d.backend.name == "b0" and d.label == "kv-router prefix:miss"
    # The decode term: KV in use on b1, in blocks, against the same 20.
    kv = backend(catalog, "x").kv_tokens
    assert pick(kv_usage=300 / kv).backend.name == "b1"
    assert pick(kv_usage=340 / kv).backend.name == "b0"


def test_kv_router_without_blocks_weighs_prefill_backlog_against_kv_in_use(catalog):
    p = make_policy("kv-router")
    kv = backend(catalog, "x").kv_tokens
    # cost(b0) = (160 + 500) / 16 = 41.25; cost(b1) = 160 / 16 + used / 16.
    r = req(prompt=160)
    b0 = backend(catalog, "b0", pending_prefill=500)
    d = p.choose(r, [b0, backend(catalog, "b1", kv_usage=400 / kv)])  # 35
    assert d.backend.name == "b1" and d.label == "kv-router prefix:none"
    assert p.choose(r, [b0, backend(catalog, "b1", kv_usage=600 / kv)]).backend.name == "b0"


def test_kv_router_ties_go_to_the_smaller_tree_then_a_seeded_draw(catalog):
    bs = [backend(catalog, "b0"), backend(catalog, "b1")]
    prompt = blocks(range(4))
    view = cached_view(b0=range(100, 110), b1=range(200, 203))  # no overlap, equal costs
    for seed in range(5):
        assert (
            make_policy("kv-router", seed, prefix=view).choose(req(b=prompt), bs).backend is bs[1]
        )

    def picks(seed):
        p = make_policy("kv-router", seed)
        return [p.choose(req(b=prompt), bs).backend.name for _ in range(20)]

    assert picks(2) == picks(2)
    assert set(picks(2)) == {"b0", "b1"}
    assert any(picks(s) != picks(2) for s in range(3, 8))  # the seed decides


# --- all three ------------------------------------------------------------------------------


def test_peer_policies_are_registered():
    assert all(n in policy_names() for n in PEERS)
    view = cached_view()
    for name in PEERS:
        p = make_policy(name, 3, prefix=view)
        assert p.name == name and p.prefix is view
        assert not p.admission
    # All three read prompt hashes (the daemon hashes prompts for them); only cache-aware keeps
    # its own index, as its peer does (the daemon then gives it no shared one).
    flags = {n: (make_policy(n).reads_prefix, make_policy(n).own_index) for n in PEERS}
    assert flags == {
        "cache-aware": (True, True),
        "prefix-kv": (True, False),
        "kv-router": (True, False),
    }


def test_placed_forwards_to_the_prefix_view(catalog):
    for name in PEERS:
        view = PrefixIndex()  # fed by placements
        p = make_policy(name, prefix=view)
        p.placed(req(b=blocks(range(3))), backend(catalog, "b0"))
        assert view.match("b0", chain(range(3))) == 3


def _with_blocks(items):
    """Prompt hashes for a synthetic workload: a session's turns resend the conversation (one
    growing prefix); other prompts share a 2-block system prompt."""
    out = []
    for w in items:
        n = max(1, math.ceil(w.prompt / BT))
        if w.session is not None:
            ids = [hash((w.session, j)) for j in range(n)]
        else:
            ids = [-1, -2][:n] + [hash((w.id, j)) for j in range(n - 2)]
        out.append(replace(w, blocks=PromptBlocks(chain(ids), BT, w.prompt)))
    return out


@pytest.mark.parametrize("name", PEERS)
def test_peer_policies_complete_a_simulated_workload(catalog, name):
    servers = [server(catalog, f"a100-{i}", "A100-SXM4-80GB") for i in range(2)] + [
        server(catalog, f"rtx-{i}", "RTX-4090") for i in range(2)
    ]
    items = Synthetic(
        model="llama-3-8b", rate=6, duration=60, sessions=0.5, turns=3, max_context=8192
    ).generate(5)
    result = simulate(servers, _with_blocks(items), name)
    assert len(result.outcomes) == len(items) > 100
    assert all(o.backend is not None and o.finished is not None for o in result.outcomes)
    assert sum(result.reasons.values()) == len(items)
    assert all(label.startswith(name) for label in result.reasons)


# --- rule by rule, fast (scripts/mutation.py runs these once per mutant of each) ------------


class EngineView:
    """A KV-event view whose engines cache in their own block size (the simulator's, or a
    trace whose 512-token blocks are not the engine's 16): any token count, per backend."""

    def __init__(self, **tokens):
        self.tokens = tokens

    def cached(self, backend, blocks):
        return self.tokens.get(backend, 0)

    def routed(self, backend, blocks):
        pass


def test_cache_aware_says_why_in_its_reason(catalog):
    p = make_policy("cache-aware")
    prompt = blocks(range(10))
    _warm(p, prompt, "b1", catalog)

    def reason(lo, hi, r):
        bs = [backend(catalog, "b0", outstanding=lo), backend(catalog, "b1", outstanding=hi)]
        return p.choose(r, bs).reason

    assert reason(100, 165, req(b=prompt)) == "cache-aware balance (load 100..165)"
    assert reason(7, 3, req(b=prompt)) == "cache-aware prefix:hit (match 1.00)"
    # 3 of 10 blocks held: a miss, to the least loaded (3 in flight).
    miss = req(b=blocks([0, 1, 2, 90, 91, 92, 93, 94, 95, 96]))
    assert reason(7, 3, miss) == "cache-aware prefix:miss (match 0.30)"
    assert reason(7, 3, req()) == "cache-aware prefix:none (3)"


def test_cache_aware_relative_threshold_is_strict(catalog):
    # 300 = 1.5 * 200 exactly (gap 100 > 64): not above it, so still balanced.
    p = make_policy("cache-aware")
    bs = [backend(catalog, "b0", outstanding=200), backend(catalog, "b1", outstanding=300)]
    assert not p.imbalanced(bs)
    bs[1].outstanding = 301
    assert p.imbalanced(bs)
    # An idle worker beside one 65 deep: both thresholds passed (65 > 1.5 * 0).
    assert p.imbalanced([backend(catalog, "b0"), backend(catalog, "b1", outstanding=65)])


def test_cache_aware_prompts_without_tokens_or_hashes_go_to_the_least_loaded(catalog):
    p = make_policy("cache-aware")
    _warm(p, blocks(range(3)), "b1", catalog)
    bs = [backend(catalog, "b0", outstanding=1), backend(catalog, "b1", outstanding=2)]
    no_hashes = PromptBlocks((), BT, 40)
    d = p.choose(req(b=no_hashes), bs)
    assert d.backend.name == "b0" and d.label == "cache-aware prefix:none"
    empty = PromptBlocks(chain(range(3)), BT, 0)  # an empty prompt: rate 0, not 0 / 0
    d = p.choose(req(b=empty, prompt=0), bs)
    assert d.backend.name == "b0" and d.label == "cache-aware prefix:none"
    # One token, held: rate 1.
    one = PromptBlocks(chain(range(1)), BT, 1)
    assert p.choose(req(b=one), bs).label == "cache-aware prefix:hit"


def test_cache_aware_tie_order_is_per_tree_node(catalog):
    # Every tenant holds two 8-block prompts that differ only in their last block: the
    # deepest match ends at different nodes, each with its own arbitrary tenant order, so
    # over a dozen seeds they do not always agree (one order for both would).
    a, c = blocks(range(8)), blocks([*range(7), 50])
    # A third prompt that runs on past a's last node answers as a does, whatever the seed.
    longer = blocks([*range(8), 60, 61])

    def tenants(seed):
        p = make_policy("cache-aware", seed)
        bs = [backend(catalog, f"b{i}") for i in range(4)]
        for b in bs:
            _warm(p, a, b.name, catalog)
            _warm(p, c, b.name, catalog)
        return [p.choose(req(b=x), bs).backend.name for x in (a, c, longer)]

    picks = [tenants(s) for s in range(12)]
    assert any(pa != pc for pa, pc, _ in picks)
    assert all(pa == pl for pa, _, pl in picks)


def test_cache_aware_seeds_with_0_by_default(catalog):
    from fleetctl.routing.policies.cache_aware import CacheAware

    def picks(p):
        bs = [backend(catalog, f"b{i}") for i in range(4)]
        prompts = [blocks(range(k, k + 4)) for k in range(0, 48, 4)]  # 12 tree nodes
        for x in prompts:
            for b in bs:
                _warm(p, x, b.name, catalog)
        return [p.choose(req(b=x), bs).backend.name for x in prompts]

    assert picks(CacheAware()) == picks(CacheAware(0)) != picks(CacheAware(1))


def test_cache_aware_sizes_its_tree_once_and_to_at_least_one_block(catalog):
    from fleetctl.routing.policies.cache_aware import CacheAware

    p = CacheAware(max_tree_size=1000)
    _warm(p, blocks(range(3)), "b0", catalog)
    assert p.tree.capacity == 1000 // (4 * BT)  # 15 blocks of 64 characters
    # A later prompt in 512-token blocks does not resize it.
    _warm(p, PromptBlocks(chain(range(2)), 512, 1024), "b0", catalog)
    assert p.tree.capacity == 15
    tiny = CacheAware(max_tree_size=10)  # under one 64-character block: still one
    _warm(tiny, blocks(range(3)), "b0", catalog)
    assert tiny.tree.capacity == 1


def test_prefix_kv_counts_whole_blocks_of_the_request_and_clips_to_one(catalog):
    p = make_policy("prefix-kv")
    b0 = backend(catalog, "b0")
    prompt = blocks(range(7), tokens=100)  # 6 whole blocks and 4 tokens
    # 40 tokens cached (an engine's finer blocks): 2 whole blocks of 16, 2/6.
    p.prefix = EngineView(b0=40)
    assert p.prefix_score(req(b=prompt), b0) == pytest.approx(2 / 6)
    # All 100 tokens: 6 whole blocks of 6, 1; never more.
    p.prefix = EngineView(b0=100)
    assert p.prefix_score(req(b=prompt), b0) == 1.0
    p.prefix = EngineView(b0=160)
    assert p.prefix_score(req(b=prompt), b0) == 1.0
    # A prompt of one whole block, held: 1.
    p.prefix = EngineView(b0=16)
    assert p.prefix_score(req(b=blocks(range(1))), b0) == 1.0
    # A prompt shorter than a block has no whole block to match: 0, not 0 / 0.
    p.prefix = EngineView(b0=10)
    assert p.prefix_score(req(b=blocks(range(1), tokens=10)), b0) == 0.0
    assert p.prefix_score(req(), b0) == 0.0


def test_prefix_kv_clips_kv_utilization_to_zero_and_one(catalog):
    p = make_policy("prefix-kv")
    # One backend: queue 1; prefix 0; kv 1 - usage, clipped.
    over = backend(catalog, "b0", kv_usage=1.25)
    assert p.scores(req(), [over]) == {"b0": 1.0}
    under = backend(catalog, "b0", kv_usage=-0.5)
    assert p.scores(req(), [under]) == {"b0": 2.0}


def test_prefix_kv_weights_are_llm_ds(catalog):
    # b0: prefix 3/6 = 0.5, kv usage 0.25, waiting 4 (queue 0); b1: cold, waiting 0 (queue 1).
    p = make_policy("prefix-kv", prefix=EngineView(b0=48))
    bs = [backend(catalog, "b0", kv_usage=0.25, waiting=4), backend(catalog, "b1", waiting=0)]
    scores = p.scores(req(b=blocks(range(6))), bs)
    assert scores == pytest.approx({"b0": 2 * 0.5 + 0.75 + 0, "b1": 0 + 1 + 1})


def test_prefix_kv_says_why_in_its_reason(catalog):
    p = make_policy("prefix-kv", prefix=EngineView(b0=48))
    bs = [backend(catalog, "b0"), backend(catalog, "b1")]
    d = p.choose(req(b=blocks(range(6))), bs)  # b0: 2 * 0.5 + 1 + 1
    assert d.reason == "prefix-kv prefix:hit (score 3.00, prefix 0.50)"
    d = p.choose(req(b=blocks(range(6))), [bs[1]])  # alone and cold: 0 + 1 + 1
    assert d.reason == "prefix-kv prefix:miss (score 2.00, prefix 0.00)"


def test_kv_router_cost_by_hand(catalog):
    p = make_policy("kv-router", prefix=EngineView(b1=100, b2=200))
    prompt = blocks(range(7), tokens=100)  # 6 whole blocks
    r = req(b=prompt, prompt=100)
    b0 = backend(catalog, "b0", pending_prefill=60)
    kv = b0.kv_tokens
    b0.kv_usage = 320 / kv  # 320 tokens in use: 20 blocks
    # b0, cold: prefill (100 + 60) / 16 = 10; decode 6 new + 20 active = 26.
    assert p.cost(r, b0) == (pytest.approx(36.0), 0)
    # b1 holds all 100 tokens: 6 whole blocks, overlap 6: prefill (100 - 96) / 16 = 0.25,
    # decode 0 new blocks.
    assert p.cost(r, backend(catalog, "b1")) == (pytest.approx(0.25), 6)
    # b2 says 200 (more than the prompt): still 6, never more than its whole blocks.
    assert p.cost(r, backend(catalog, "b2")) == (pytest.approx(0.25), 6)
    # Without hashes: vLLM's 16-token blocks, no overlap and no new blocks: 100 / 16.
    assert p.cost(req(prompt=100), backend(catalog, "b3")) == (pytest.approx(6.25), 0)


def test_kv_router_a_fully_cached_prompt_has_no_new_tokens(catalog):
    # 160 tokens in 10 whole blocks, all cached: prefill max(0, 160 - 160) = 0.
    p = make_policy("kv-router", prefix=EngineView(b0=160))
    assert p.cost(req(b=blocks(range(10))), backend(catalog, "b0")) == (0.0, 10)
    # A prompt the hashes overstate (fewer tokens than its cached blocks): not negative.
    assert p.cost(req(b=blocks(range(10)), prompt=150), backend(catalog, "b0")) == (0.0, 10)


def test_kv_router_says_why_in_its_reason(catalog):
    p = make_policy("kv-router", prefix=cached_view(b1=range(10)))
    bs = [backend(catalog, "b0"), backend(catalog, "b1", pending_prefill=8)]
    # b1: 8 / 16 = 0.5; b0: 10 + 10.
    assert (
        p.choose(req(b=blocks(range(10))), bs).reason
        == "kv-router prefix:hit (cost 0.5, cached 10)"
    )
    assert p.choose(req(b=blocks(range(50, 60))), bs).reason == (
        "kv-router prefix:miss (cost 20.0, cached 0)"
    )
    assert p.choose(req(prompt=160), bs).reason == "kv-router prefix:none (cost 10.0, cached 0)"


def test_prefix_kv_and_kv_router_seed_with_0_by_default(catalog):
    from fleetctl.routing.policies.kv_router import KvRouter
    from fleetctl.routing.policies.prefix_kv import PrefixKv

    bs = [backend(catalog, f"b{i}") for i in range(4)]  # all tied

    def picks(p):
        return [p.choose(req(), bs).backend.name for _ in range(12)]

    for cls in (PrefixKv, KvRouter):
        assert picks(cls()) == picks(cls(0)) != picks(cls(1))
