"""The simulator's prefix cache (vLLM V1's automatic prefix caching), the Mooncake trace reader,
and the prefix term of hardware-aware routing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetctl.base.errors import UserError
from fleetctl.model.perf import EnginePerf, kv_budget
from fleetctl.routing.policy import HardwareAware
from fleetctl.routing.prefix import PrefixIndex, PromptBlocks, chain
from fleetctl.routing.types import Backend, Request
from fleetctl.sim.engine import Engine, Seq
from fleetctl.sim.fleet import Server, simulate
from fleetctl.sim.kvpool import KvPool, engine_keys
from fleetctl.sim.workload import WorkItem, load_trace
from tests.conftest import DATA


def engine(catalog, kv=200_000, **kw):
    g, m, f = catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3.1-8b"), catalog.format("bf16")
    return Engine(EnginePerf(g, m, f), kv, max_model_len=131072, **kw)


def prompt(ids, tokens):
    return PromptBlocks(chain(ids), 512, tokens)


def run(e, seqs, gap=100.0):
    """Each request alone: it arrives after the one before has finished."""
    t = e.clock
    for s in seqs:
        e.add(s, t)
        e.advance(t + gap)
        assert s.finished_at is not None
        e.pool.check()
        t += gap


def test_a_shared_prefix_skips_its_prefill_and_is_counted(catalog):
    e = engine(catalog)
    a = Seq(1, 3000, 10, prompt([1, 2, 3, 4, 5, 6], 3000))
    b = Seq(2, 3000, 10, prompt([1, 2, 3, 9, 9, 9], 3000))  # shares the first three blocks
    run(e, [a, b])
    assert e.stats.prefix_cache_queries == 6000
    assert e.stats.prefix_cache_hits == 3 * 512  # 96 engine blocks of 16
    assert e.stats.prompt_tokens == 6000 - 3 * 512
    # An identical prompt hits all but its last token's block.
    c = Seq(3, 3000, 10, prompt([1, 2, 3, 9, 9, 9], 3000))
    run(e, [c])
    assert e.stats.prefix_cache_hits == 3 * 512 + (2999 // 16) * 16


def test_lru_eviction_takes_the_least_recently_freed_and_a_request_last_block_first(catalog):
    # 400 blocks of 16 (one is vLLM's null block): room for one 3200-token prompt at a time.
    e = engine(catalog, kv=401 * 16)
    first = Seq(1, 3200, 1, prompt([1, 2, 3, 4, 5, 6, 7], 3200))
    other = Seq(2, 3200, 1, prompt([50, 51, 52, 53, 54, 55, 56], 3200))
    run(e, [first, other])
    # `other` took the 200 never-used blocks; the free queue now holds the 200 blocks `first`
    # freed, then `other`'s. 100 more blocks evict the last 100 of `first`'s (its tail).
    filler = Seq(3, 1600, 1, prompt([70, 71, 72, 73], 1600))
    run(e, [filler])
    again = Seq(4, 3200, 1, prompt([1, 2, 3, 4, 5, 6, 7], 3200))
    hits = e.stats.prefix_cache_hits
    run(e, [again])
    assert e.stats.prefix_cache_hits - hits == 100 * 16  # its first 100 blocks survived


def test_a_preempted_request_finds_its_own_blocks_again(catalog):
    """Without hashes (the Azure path) a resumed request still hits the blocks it freed, as
    vLLM V1 hashes every full block; the ones reused meanwhile it recomputes."""
    e = engine(catalog, kv=2000)
    seqs = [Seq(i, 500, 300) for i in range(4)]
    for s in seqs:
        e.add(s, 0.0)
    e.advance(1e6)
    assert all(s.finished_at for s in seqs)
    assert e.stats.preemptions > 0
    assert e.stats.prefix_cache_hits > 0
    e.pool.check()
    assert e.free_blocks == e.total_blocks


def test_shared_blocks_held_by_two_running_requests_are_counted_once(catalog):
    e = engine(catalog)
    a = Seq(1, 4096, 200, prompt(range(8), 4096))
    b = Seq(2, 4096, 200, prompt(range(8), 4096))
    e.add(a, 0.0)
    e.advance(0.5)  # a has finished its prefill and is decoding
    assert a.first_token_at is not None
    e.add(b, 0.5)
    e.advance(0.6)
    assert b.first_token_at is not None
    used = e.total_blocks - e.free_blocks
    # b computed only its last block; both hold the 255 shared ones.
    assert e.stats.prefix_cache_hits == 255 * 16
    assert used < 2 * 256 + 10
    e.advance(1e6)
    e.pool.check()
    assert e.free_blocks == e.total_blocks


def test_engine_keys_split_trace_blocks_into_engine_blocks():
    a = PromptBlocks(chain([1, 2]), 512, 1000)
    b = PromptBlocks(chain([1, 3]), 512, 1000)
    ka, kb = engine_keys(a, 16), engine_keys(b, 16)
    assert len(ka) == 1000 // 16
    assert ka[:32] == kb[:32] and not set(ka[32:]) & set(kb[32:])
    # vLLM's CPU backend: 128-token blocks, four per trace block.
    assert len(engine_keys(a, 128)) == 7 and engine_keys(a, 128)[:4] == engine_keys(b, 128)[:4]


def test_kvpool_allocation_never_exceeds_the_free_blocks():
    pool = KvPool(10)
    pool.allocate(10)
    with pytest.raises(ValueError):
        pool.allocate(1)


def test_mooncake_trace_reads_with_chained_hashes():
    items = load_trace(DATA / "mooncake_conv_slice.jsonl", "m")
    assert len(items) == 300
    first = items[0]
    assert (first.arrival, first.prompt, first.output, first.max_tokens) == (0.0, 6758, 500, 500)
    assert first.blocks is not None and len(first.blocks.hashes) == 14
    assert first.blocks.block_tokens == 512
    # Every prompt of this service starts with the same 512-token block (its system prompt).
    heads = {w.blocks.hashes[0] for w in items if w.blocks}
    assert len(heads) == 1
    assert [w.arrival for w in items] == sorted(w.arrival for w in items)


def test_a_bad_mooncake_row_names_its_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
        '{"timestamp": 5, "input_length": "x", "output_length": 5}\n'
    )
    with pytest.raises(UserError) as e:
        load_trace(p, "m")
    assert e.value.where is not None and e.value.where.line == 2


def test_hardware_aware_counts_the_prefill_a_cached_prefix_saves(catalog):
    g, m, f = catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3.1-8b"), catalog.format("bf16")
    perf = EnginePerf(g, m, f)
    kv = kv_budget(g, m, f).kv_tokens
    a = Backend("a", "a", g.name, "m", "bf16", kv, perf=perf)
    z = Backend("z", "z", g.name, "m", "bf16", kv, perf=perf)
    blocks = prompt(range(40), 20_000)
    index = PrefixIndex()
    index.insert("z", blocks.hashes[:30])  # z holds 15,360 of its 20,000 tokens
    policy = HardwareAware()
    policy.prefix = index
    req = Request(1, "m", 20_000, 100, blocks=blocks)
    d = policy.choose(req, [a, z])
    assert d.backend is z  # by name alone, a would win the tie
    saved = policy.estimate(a, req) - policy.estimate(z, req)
    assert saved == pytest.approx(
        perf.prefill_marginal(20_000) - perf.prefill_marginal(4640, 15360)
    )
    policy.placed(req, z)
    assert req.cached_tokens == 15_360 and req.prefill_tokens == 4640


def conversations(n=11, turns=5, gap=20.0):
    """`n` conversations whose every turn resends the one before plus 2,048 new tokens."""
    items = []
    for c in range(n):
        ids: list[int] = []
        for t in range(turns):
            ids += [c * 100 + t * 4 + k for k in range(4)]
            at = c * 1.7 + t * gap
            items.append(
                WorkItem(
                    0,
                    at,
                    len(ids) * 512,
                    50,
                    "llama-3.1-8b",
                    max_tokens=50,
                    blocks=prompt(ids, len(ids) * 512),
                )
            )
    items.sort(key=lambda w: w.arrival)
    return [replace(w, id=i) for i, w in enumerate(items)]


def test_simulate_reports_hit_rate_and_prefill_saved(catalog):
    g, m, f = catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3.1-8b"), catalog.format("bf16")
    kv = kv_budget(g, m, f).kv_tokens
    servers = [
        Server(n, n, g.name, "llama-3.1-8b", "bf16", EnginePerf(g, m, f), kv, 256, 2048, 131072)
        for n in ("s1", "s2", "s3")
    ]
    items = conversations()
    by = {p: simulate(servers, items, p).summary() for p in ("round-robin", "hardware-aware")}
    for s in by.values():
        assert s["completed"] == len(items)
        assert 0 < s["prefix_hit_rate"] < 1 and s["prefill_saved_tokens"] > 0
    # Every later turn finds its conversation cached where hardware-aware sent the one before
    # (all but the last token's block), where round-robin finds it by chance.
    later = sum(w.prompt - 2048 for w in items if w.prompt > 2048)
    assert by["hardware-aware"]["prefill_saved_tokens"] >= later
    assert by["round-robin"]["prefill_saved_tokens"] < 0.8 * later


def test_a_request_blocked_for_room_is_not_overtaken_on_that_backend(catalog):
    """EASY backfilling: later requests may use other backends, never the room the blocked
    one waits for (else a long prompt waits as long as short ones keep coming)."""
    from fleetctl.routing.policies.least_outstanding import LeastOutstanding
    from fleetctl.routing.scheduler import Scheduler

    big = Backend("big", "big", "A100-SXM4-80GB", "m", "bf16", 100_000, max_model_len=131072)
    big.outstanding, big.reserved_tokens = 1, 60_000
    small = Backend("small", "small", "RTX-4090", "m", "bf16", 40_000, max_model_len=32768)
    small.outstanding, small.reserved_tokens = 2, 2_000
    sched = Scheduler(LeastOutstanding(), admission=True)
    long = Request(1, "m", 50_000, 100, arrival=0.0)  # only `big` takes it, once room frees
    short = Request(2, "m", 1_000, 100, arrival=1.0)  # fits `big` now, and `small`
    sched.submit(long)
    sched.submit(short)
    sent, rejected = sched.dispatch(2.0, [big, small])
    assert not rejected
    assert [(d.request.id, d.decision.backend.name) for d in sent] == [(2, "small")]
    assert sched.queue == [long]


def test_hardware_aware_keeps_optional_work_off_a_class_busy_with_work_only_it_can_do(catalog):
    g, m, f = catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3.1-8b"), catalog.format("bf16")
    r = catalog.gpu("RTX-4090")
    a100 = Backend(
        "a", "a", g.name, "m", "bf16", 400_000, perf=EnginePerf(g, m, f), max_model_len=131072
    )
    rtx = Backend(
        "r", "r", r.name, "m", "bf16", 40_000, perf=EnginePerf(r, m, f), max_model_len=32768
    )
    policy = HardwareAware()
    # Two output tokens: the first token decides (with a long answer the A100's faster
    # decode would weigh in too).
    optional = Request(100, "m", 8_000, 2)

    def decide(req):
        pool, _ = policy.eligible(req, [a100, rtx])
        return policy.choose(req, pool)

    def pick(req):
        return decide(req).backend

    assert pick(optional) is a100  # faster, and nothing else is known yet
    for i in range(5):  # only the A100 class can take these
        req = Request(i, "m", 50_000, 100)
        d = decide(req)
        assert d.backend is a100
        policy.placed(req, a100, d)
    assert policy.exclusive_share(a100.node_class) == pytest.approx(1.0)
    a100.waiting = 3  # three of them wait there for their first token
    assert pick(Request(101, "m", 8_000, 2)) is rtx
    # The delay counts once per request waiting there: with 8,000 prompt tokens queued on the
    # RTX, one prefill's delay (none waiting) leaves the A100 first; four (three waiting) do not.
    rtx.pending_prefill = 8_000
    a100.waiting = 0
    assert pick(Request(102, "m", 8_000, 2)) is a100
    a100.waiting = 3
    assert pick(Request(103, "m", 8_000, 2)) is rtx


def test_a_blocked_request_that_could_go_anywhere_holds_nothing(catalog):
    """Backfilling around a request with a choice of backends keeps the mean low."""
    from fleetctl.routing.policies.least_outstanding import LeastOutstanding
    from fleetctl.routing.scheduler import Scheduler

    big = Backend("big", "big", "A100-SXM4-80GB", "m", "bf16", 100_000, max_model_len=131072)
    big.outstanding, big.reserved_tokens = 1, 60_000
    other = Backend("other", "other", "A100-SXM4-80GB", "m", "bf16", 100_000, max_model_len=131072)
    other.outstanding, other.reserved_tokens = 2, 80_000
    sched = Scheduler(LeastOutstanding(), admission=True)
    sched.submit(Request(1, "m", 50_000, 100, arrival=0.0))  # fits neither now
    sched.submit(Request(2, "m", 1_000, 100, arrival=1.0))
    sent, _ = sched.dispatch(2.0, [big, other])
    assert [(d.request.id, d.decision.backend.name) for d in sent] == [(2, "big")]


def test_route_serve_learns_how_much_of_the_expected_prefix_a_server_finds(catalog):
    """From the server's vllm:prompt_tokens_cached_total against what the router counted on:
    an index of placements that overstates the cache earns a discount."""
    from fleetctl.daemon.live import PREFIX_WINDOW_TOKENS, LiveState

    b = Backend("http://127.0.0.1:1", "n", "A100-SXM4-80GB", "m", "bf16", 100_000)
    live = LiveState([b], interval=1.0)
    page = (DATA / "vllm-0.32.0-cpu-metrics.txt").read_text()

    def scrape(found: int, t: float) -> None:
        text = page.replace(
            'vllm:prompt_tokens_cached_total{engine="0",model_name="tiny-llama"} 0.0',
            f'vllm:prompt_tokens_cached_total{{engine="0",model_name="tiny-llama"}} {found}.0',
        )
        live.apply(b, text, t)

    scrape(0, 0.0)
    for k in range(1, 11):  # each window: the router counts on 2x what the server finds
        b.cached_sent += PREFIX_WINDOW_TOKENS
        scrape(k * PREFIX_WINDOW_TOKENS // 2, float(k))
    assert b.prefix_trust == pytest.approx(0.5, abs=0.02)
    policy = HardwareAware()
    req = Request(1, "m", 20_000, 10, blocks=prompt(range(40), 20_000))
    b.perf = EnginePerf(
        *(catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3.1-8b")), catalog.format("bf16")
    )
    p = b.perf
    got = policy.estimate(b, req, cached=16_000) - policy.estimate(b, req, cached=0)
    want = p.prefill_marginal(12_000, 8_000) - p.prefill_marginal(20_000)
    assert got == pytest.approx(want, rel=0.05)
