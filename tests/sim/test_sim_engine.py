"""The engine model step by step: small caches and short prompts whose every step, block and
counter is worked out by hand from vLLM V1's scheduling rules (see fleetctl/sim/engine.py).

Times are checked against the shared performance model (`EnginePerf`, tested on its own in
tests/model/test_perf.py) called with the step's tokens, KV reads and attention pairs derived here;
what these tests pin is the engine's bookkeeping, not the roofline.
"""

from __future__ import annotations

import random

import pytest

from fleetctl.model.perf import EnginePerf
from fleetctl.routing.prefix import PromptBlocks, chain
from fleetctl.sim.engine import DECODE, DONE, PREFILL, WAITING, Engine, EngineStats, Seq
from fleetctl.sim.kvpool import engine_keys

BS = 16  # tokens per KV block (CUDA)


def perf(catalog, version: str | None = None, **kw) -> EnginePerf:
    g, m, f = catalog.gpu("RTX-4090"), catalog.model("llama-3-8b"), catalog.format("bf16")
    return EnginePerf(g, m, f, vllm_version=version, **kw)


def engine(catalog, blocks: int, version: str | None = None, **kw) -> Engine:
    """An engine whose cache holds `blocks` usable blocks (V1 keeps one more aside)."""
    return Engine(perf(catalog, version), (blocks + 1) * BS, **kw)


def step(e: Engine) -> list[Seq]:
    """Apply the next planned step (a mixed one, or a run of identical decode steps) alone.
    (`advance(t)` would go on to a mixed step that starts at t.)"""
    assert e.next_event() is not None
    return e._apply()


def check(e: Engine) -> None:
    """The engine's incremental state agrees with the sequences it holds (for tests where no
    two running requests share a prefix: every running sequence's blocks are its own)."""
    e.pool.check()
    dec = [s for s in e.running if s.state == DECODE]
    ctx = [s.base_c + e.steps_done - s.d0 for s in dec]
    assert e.n_decode == len(dec)
    assert e.decode_context() == sum(ctx)
    for r in range(BS):
        assert e.residues[r] == sum(1 for s in dec if (s.base_c - s.d0) % BS == r)
    held = sum(e.blocks_for(c) for c in ctx)
    held += sum(s.blocks for s in e.running if s.state == PREFILL)
    assert e.total_blocks - e.free_blocks == held
    assert all(s.state == WAITING for s in e.waiting)
    # A request admitted with part of its prompt took the rest of the step's budget: at most
    # one is mid-prefill between steps (scripts/mutation_equivalents/sim.engine.toml uses this).
    assert len(e.prefilling) <= 1


def test_limits_follow_vllm_and_an_empty_cache_reads_full(catalog):
    # Every running sequence takes at least one token of a step's budget, so no more than
    # max_num_batched_tokens of them can run.
    e = engine(catalog, 10, max_num_seqs=256, max_num_batched_tokens=8)
    assert e.max_num_seqs == 8
    assert engine(catalog, 10, max_num_seqs=4).max_num_seqs == 4
    # vLLM's defaults on a small GPU; a fresh engine's time starts at 0.
    d = Engine(perf(catalog), 100 * BS)
    assert (d.max_num_seqs, d.max_num_batched_tokens, d.max_model_len) == (256, 2048, 8192)
    assert (d.block_size, d.clock, d.name, d.max_span_s) == (16, 0.0, "", None)
    assert d.pool.events is None  # KV events are recorded only when asked for
    assert d.stats == EngineStats()  # every counter at zero
    assert Seq(0, 10, 0).output == 1  # a request samples at least one token
    # A partial block at the end of the cache holds no sequence's tokens.
    assert Engine(perf(catalog), 100 * BS + 15).total_blocks == 100 - 1
    # Less KV than the null block: nothing usable (not -1 blocks), and usage reads as full.
    empty = Engine(perf(catalog), 8)
    assert empty.total_blocks == 0 and empty.kv_usage == 1.0
    assert e.kv_usage == 0.0 and e.idle and e.num_running == e.num_waiting == 0


def test_one_request_is_chunked_prefilled_then_decoded(catalog):
    """A 40-token prompt with a 16-token budget: chunks of 16, 16 and 8, the last of which
    samples the first token, then two decode steps to its 3 output tokens."""
    e = engine(catalog, 10, max_num_batched_tokens=16)
    p = e.perf
    s = Seq("r", 40, 3)
    e.add(s, 2.0)
    assert e.clock == 2.0  # an idle engine starts at the arrival
    assert (e.num_waiting, e.idle) == (1, False)
    assert s.first_token_at is None and s.finished_at is None
    # Chunk 1: tokens 0-15, one block; it attends 16 * (0 + 17/2) = 136 pairs.
    t = 2.0 + p.step_time(16, 16, 136, seqs=1)
    assert e.next_event() == 2.0  # a mixed step is applied at its start
    assert step(e) == []
    assert (s.state, s.computed, s.blocks, e.free_blocks) == (PREFILL, 16, 1, 9)
    assert e.clock == pytest.approx(t, rel=1e-12)
    assert e.kv_usage == pytest.approx(0.1)
    check(e)
    # Chunk 2: tokens 16-31 on 16 cached: KV 32, pairs 16 * (16 + 8.5) = 392.
    step(e)
    t += p.step_time(16, 32, 392, seqs=1)
    assert (s.computed, s.blocks, e.free_blocks) == (32, 2, 8)
    # Chunk 3: the last 8 tokens on 32 cached: KV 40, pairs 8 * (32 + 4.5) = 292, a third
    # block; this step samples the first token.
    step(e)
    t += p.step_time(8, 40, 292, seqs=1)
    assert s.first_token_at == pytest.approx(t, rel=1e-12)
    assert e.first_tokens == [s]
    assert s.state == DECODE and e.generated(s) == 1 and e.free_blocks == 7
    assert e.decode_context() == 40 and e.decode_read() == 41
    check(e)
    # Two identical decode steps remain, applied at once: contexts 40 and 41 (no new block:
    # 42 tokens fit three).
    start = e.clock
    end = e.next_event()
    assert end == pytest.approx(start + p.step_time(1, 41) + p.step_time(1, 42), rel=1e-12)
    assert step(e) == [s]
    assert s.finished_at == pytest.approx(end, rel=1e-12)
    assert (s.state, e.generated(s), s.req) == (DONE, 3, "r")  # with the caller's handle
    st = e.stats
    assert (st.steps, st.prompt_tokens, st.generation_tokens, st.finished) == (5, 40, 3, 1)
    assert (st.prefix_cache_queries, st.prefix_cache_hits, st.preemptions) == (40, 0, 0)
    assert st.busy_s == pytest.approx(end - 2.0, rel=1e-12)
    # HBM read: the weights once a step, plus each step's KV (16, 32, 40, then 41 and 42).
    w, kvb = p.weight_read_bytes(1) / p.tp, p.kv_token_bytes
    assert st.read_bytes == pytest.approx(5 * w + (16 + 32 + 40 + 41 + 42) * kvb, rel=1e-12)
    assert e.idle and e.free_blocks == e.total_blocks and e.next_event() is None
    check(e)


def test_decode_runs_at_once_equal_decode_steps_one_by_one(catalog):
    """The closed-form fast path and single steps (max_span_s=0) give the same timeline and
    counters, block allocations across block boundaries included."""

    def run(**kw):
        e = engine(catalog, 40, **kw)
        seqs = [Seq(i, 20 + 7 * i, 30 + 11 * i) for i in range(4)]
        for s in seqs:
            e.add(s, 0.0)
        applied = 0
        while not e.idle:
            step(e)
            applied += 1
            check(e)
        return e, seqs, applied

    (fast, a, n_fast), (slow, b, n_slow) = run(), run(max_span_s=0.0)
    assert [s.finished_at for s in a] == pytest.approx([s.finished_at for s in b], rel=1e-12)
    # The second arrival finds the first's prefill step begun (applied as it starts): seq 0
    # prefills alone, the other three in step 2 beside seq 0's first decode (decode step 0).
    # They finish at decode steps 29 (30 tokens from d0 = 0), 41, 52 and 63 (from d0 = 1):
    # after the adds, step 2 then four runs, or 63 single steps; 64 steps in all.
    assert (n_fast, n_slow) == (1 + 4, 63)
    assert fast.stats.steps == slow.stats.steps == 64
    assert fast.stats.generation_tokens == slow.stats.generation_tokens == 30 + 41 + 52 + 63
    assert fast.stats.read_bytes == pytest.approx(slow.stats.read_bytes, rel=1e-12)
    assert fast.stats.busy_s == pytest.approx(slow.stats.busy_s, rel=1e-12)
    assert fast.clock == pytest.approx(slow.clock, rel=1e-12)
    # A finished request's count stays put while the others decode on.
    assert [fast.generated(s) for s in a] == [slow.generated(s) for s in b] == [30, 41, 52, 63]


def test_max_span_caps_a_run_of_decode_steps(catalog):
    """A server streaming in real time plans no run longer than max_span_s (at least one
    step); without the cap the run lasts to the next finish."""
    p = perf(catalog)
    one = p.step_time(1, 17)  # the first decode step: 16 prompt tokens + the new one
    # Uncapped: 100 decode steps to the finish, taking ceil(116 / 16) - 1 = 7 of 49 free blocks.
    # And with 2 steps left, a cap of 0 still plans them one by one.
    for cap, k, out in ((None, 100, 101), (2.5 * one, 2, 101), (0.0, 0, 101), (0.0, 0, 3)):
        e = Engine(p, 51 * BS, max_span_s=cap)
        e.add(Seq(0, 16, out), 0.0)
        step(e)  # the prefill; 100 decode steps remain, the first needs a new block
        start = e.clock
        end = e.next_event()
        if k == 0:  # a single step: planned as a mixed step, applied at its start
            assert end == start
        else:
            assert end == pytest.approx(start + p.decode_span(1, 17, k), rel=1e-12)


def test_out_of_blocks_the_newest_request_is_preempted_and_resumes_from_its_own_blocks(catalog):
    """6 blocks, two requests of 32 prompt and 20 output tokens. Worked out by hand:

    step 1: a prefills alone (2 blocks). step 2: b arrives and is admitted (2 blocks) beside
    a's decode step D=0 (ctx 32: a third block); 1 block free. b decodes from d0 = 1.
    a needs a block at D = 16, b at D = 1 and 17 (context a multiple of 16). So a run of 15
    steps (D = 1..15) takes the last free block; at D = 16 a needs one and none is free:
    b, admitted last, is preempted with 47 tokens of KV (3 blocks: 2 full, kept for it, and
    a partial one, freed first, which a takes). b waits to recompute 32 + 16 generated tokens;
    its whole 48 tokens (3 blocks) do not fit the 2 free, so a runs to its finish at D = 19
    and frees 4 blocks. b then finds its 2 own blocks cached and prefills the last 16 tokens.
    """
    e = engine(catalog, 6)
    p = e.perf
    a, b = Seq("a", 32, 20), Seq("b", 32, 20)
    e.add(a, 0.0)
    e.add(b, 0.0)  # a's prefill step, begun at 0, is applied: b joins the next one
    assert (a.state, b.state, e.free_blocks) == (DECODE, WAITING, 4)
    step(e)
    assert (a.state, b.state, e.free_blocks) == (DECODE, DECODE, 1)
    assert e.first_tokens == [a, b]
    check(e)
    # 15 identical steps use exactly the one free block.
    start = e.clock
    # two sequences: contexts 33 (a, D=1) and 32 (b), plus the two tokens decoded
    assert e.decode_read() == 33 + 32 + 2
    assert e.next_event() == pytest.approx(start + p.decode_span(2, 67, 15), rel=1e-12)
    step(e)
    assert (e.steps_done, e.free_blocks) == (16, 0)
    check(e)
    # D = 16: the preemption.
    assert e.next_event() == e.clock  # a mixed step: no run of identical steps fits
    assert step(e) == []
    assert (b.state, b.preemptions, a.preemptions, e.stats.preemptions) == (WAITING, 1, 0, 1)
    assert list(e.waiting) == [b] and list(e.running) == [a]
    assert (b.target, b.computed, b.blocks, e.generated(b)) == (48, 0, 0, 16)
    assert e.free_blocks == 2
    check(e)
    # b's whole prompt does not fit: a run of a's last two steps, then a finishes.
    assert e.next_event() > e.clock
    assert step(e) == [a]
    assert e.generated(a) == 20 and e.free_blocks == 6
    # b: 2 own blocks found (32 tokens), 16 recomputed on them: KV 48, pairs 16 * 40.5.
    t = e.clock
    step(e)
    assert e.clock == pytest.approx(t + p.step_time(16, 48, 648, seqs=1), rel=1e-12)
    assert (b.state, e.generated(b), e.free_blocks) == (DECODE, 17, 3)
    assert e.first_tokens == [a, b]  # b's first token came before its preemption
    check(e)
    # b's last 3 decode steps run at once: the finish planned before its preemption is stale.
    assert e.next_event() == pytest.approx(e.clock + p.decode_span(1, 48 + 1, 3), rel=1e-12)
    e.advance(float("inf"))
    assert b.finished_at == e.clock and e.generated(b) == 20
    st = e.stats
    assert (st.prompt_tokens, st.prefix_cache_queries, st.prefix_cache_hits) == (80, 112, 32)
    assert (st.generation_tokens, st.finished, st.preemptions) == (40, 2, 1)
    # steps: 1 + 1 + 15 + 1 + 2 (a's last) + 1 (b's prefill) + 3 (b's last)
    assert st.steps == 24
    assert e.free_blocks == e.total_blocks
    check(e)
    # One step at a time, the same: at D = 1 b takes the last free block, preempting no one.
    e = engine(catalog, 6, max_span_s=0.0)
    a, b = Seq("a", 32, 20), Seq("b", 32, 20)
    e.add(a, 0.0)
    e.add(b, 0.0)
    e.advance(float("inf"))
    assert (e.stats.preemptions, e.stats.steps, e.stats.prefix_cache_hits) == (1, 24, 32)
    assert a.finished_at < b.finished_at == e.clock


def test_a_waiting_request_that_cannot_join_leaves_decode_steps_to_run_at_once(catalog):
    """Decode steps are batched into runs only while no waiting request could join a step."""
    # Full on sequences: max_num_seqs reached.
    e = engine(catalog, 20, max_num_seqs=1)
    e.add(Seq(0, 16, 10), 0.0)
    step(e)
    e.add(Seq(1, 16, 10), e.clock)
    assert e.next_event() > e.clock
    # One slot left: it joins the next step.
    e = engine(catalog, 20, max_num_seqs=2, max_num_batched_tokens=2)
    e.add(Seq(0, 2, 10), 0.0)
    step(e)
    late = Seq(1, 16, 10)
    e.add(late, e.clock)  # one token of budget left beside the decode
    assert e.next_event() == e.clock
    step(e)
    assert e.num_running == 2 and late.computed == 1
    step(e)  # its prefill goes on one token a step
    assert late.computed == 2
    # No free block beside what the decode takes (before vLLM 0.18: the first chunk is enough).
    e = engine(catalog, 2, "0.11.0")
    e.add(Seq(0, 16, 40), 0.0)
    step(e)  # 1 block; the decode step D=0 takes the second
    e.add(Seq(1, 8, 10), e.clock)
    assert e.next_event() > e.clock
    e = engine(catalog, 3, "0.11.0")
    e.add(Seq(0, 16, 40), 0.0)
    step(e)
    e.add(Seq(1, 8, 10), e.clock)
    assert e.next_event() == e.clock


def test_abort_frees_a_request_in_any_state(catalog):
    e = engine(catalog, 10, max_num_batched_tokens=16)
    pre, dec, wait = Seq("p", 40, 5), Seq("d", 8, 50), Seq("w", 100, 5)
    e.add(dec, 0.0)
    step(e)  # d prefilled (1 block), decoding
    e.add(pre, 0.0)  # arrived during that step
    step(e)  # d's decode step, p's first chunk of 15 tokens (the budget less d's token)
    e.add(wait, 0.0)  # behind p, which takes the whole budget
    assert (dec.state, pre.state, wait.state) == (DECODE, PREFILL, WAITING)
    assert (pre.computed, pre.blocks, e.free_blocks) == (15, 1, 8)
    check(e)
    e.abort(wait)
    assert (wait.state, e.num_waiting) == (DONE, 0)
    e.abort(pre)
    assert (pre.state, pre.blocks, e.prefilling) == (DONE, 0, [])
    assert e.free_blocks == e.total_blocks - 1  # d's one block
    check(e)
    e.abort(dec)
    assert dec.state == DONE and e.n_decode == 0 and e.decode_context() == 0
    assert e.idle and e.free_blocks == e.total_blocks and e.next_event() is None
    check(e)
    assert e.stats.finished == 0  # aborts are not finishes


def test_an_arrival_cuts_a_run_of_decode_steps_after_the_step_in_progress(catalog):
    e = engine(catalog, 50)
    p = e.perf
    s = Seq(0, 16, 101)
    e.add(s, 0.0)
    step(e)
    start = e.clock
    assert e.next_event() > start  # a run of 100 decode steps is planned
    # An arrival at the run's start cuts nothing: no decode step has begun.
    e.add(Seq(1, 16, 2), start)
    assert (e.clock, e.generated(s)) == (start, 1)
    e.abort(e.waiting[0])
    assert e.next_event() > start
    # Two and a half steps in: the third step finishes, then the newcomer joins.
    one = p.step_time(1, 17)
    done = e.add(Seq(2, 16, 2), start + 2.5 * one)
    assert done == [] and e.generated(s) == 1 + 3
    assert e.clock == pytest.approx(start + p.decode_span(1, 17, 3), rel=1e-12)
    assert e.next_event() == e.clock
    # sync() alone does the same.
    e.advance(float("inf"))
    t = e.clock
    e.add(Seq(3, 16, 101), t)
    step(e)
    start = e.clock
    assert e.sync(start + 0.5 * one) == []
    assert e.clock == pytest.approx(start + p.step_time(1, 17), rel=1e-12)


def test_an_idle_engine_starts_at_the_arrival_a_busy_one_at_its_clock(catalog):
    e = engine(catalog, 10)
    e.add(Seq(0, 16, 1), 1.0)
    e.advance(float("inf"))
    end = e.clock
    assert end > 1.0 and e.idle
    e.add(Seq(1, 16, 1), end + 5.0)
    assert e.clock == end + 5.0
    e.advance(float("inf"))
    end = e.clock
    e.add(Seq(2, 16, 1), end - 0.5)  # a late report of an earlier arrival: time does not go back
    assert e.clock == end


def test_a_prompt_larger_than_the_cache_is_refused_with_a_reason(catalog):
    e = engine(catalog, 4, name="e1")
    e.add(Seq(0, 100, 1), 0.0)  # 7 blocks, the cache has 4 (5 with the null block: 80 tokens)
    with pytest.raises(ValueError, match=r"^e1: a request of 100 tokens can never fit the 80-"):
        e.advance(1.0)


def keyed(ids, tokens: int) -> PromptBlocks:
    """A prompt hashed in 16-token blocks, as the engine's own (one key per full block)."""
    return PromptBlocks(chain(ids), BS, tokens)


def test_a_prompt_found_cached_recomputes_only_its_last_token_block(catalog):
    e = engine(catalog, 20, max_num_batched_tokens=16)
    p = e.perf
    first = Seq(0, 48, 1, keyed([1, 2, 3], 48))
    e.add(first, 0.0)
    keys = engine_keys(keyed([1, 2, 3], 48), BS)
    assert first.keys == keys and len(keys) == 3
    # Each chunk's full blocks join the prefix cache as they are computed.
    for computed in (16, 32, 48):
        step(e)
        assert e.cached_tokens(keys) == computed
    assert first.finished_at is not None and e.free_blocks == e.total_blocks
    assert e.cached_tokens(keys) == 48  # freed, still cached
    # The same prompt again: all but the block of its last token is found (vLLM recomputes at
    # least one token); that block is computed again: KV 48, pairs 16 * (32 + 8.5).
    again = Seq(1, 48, 1, keyed([1, 2, 3], 48))
    e.add(again, e.clock)
    t = e.clock
    step(e)
    assert e.clock == pytest.approx(t + p.step_time(16, 48, 648, seqs=1), rel=1e-12)
    assert again.finished_at == e.clock
    st = e.stats
    assert (st.prefix_cache_queries, st.prefix_cache_hits, st.prompt_tokens) == (96, 32, 64)
    assert e.cached_tokens(keys) == 48 and e.free_blocks == e.total_blocks
    e.pool.check()
    # A prompt sharing the first block: one block found; 40 tokens on 16 cached.
    other = Seq(2, 40, 1, keyed([1, 7, 8], 40))
    e.add(other, e.clock)
    e.advance(float("inf"))
    assert e.stats.prefix_cache_hits == 32 + 16 and e.stats.prompt_tokens == 64 + 24
    assert e.cached_tokens(engine_keys(keyed([1, 7, 8], 40), BS)) == 32


def test_utilization_is_the_decode_steps_bandwidth_and_compute_over_the_gpus_peaks(catalog):
    e = engine(catalog, 50, max_span_s=0.0)
    assert e.utilization() == (0.0, 0.0)
    a, b, c = Seq(0, 100, 50), Seq(1, 120, 50), Seq(2, 140, 50)
    e.add(a, 0.0)
    e.add(b, 0.0)  # a prefilled in the step begun at 0
    e.add(c, 0.0)
    step(e)  # a's first decode step, b's and c's prefills
    assert e.n_decode == 3
    kv = e.decode_read()
    assert kv == (100 + 1) + 120 + 140 + 3  # the contexts, plus the 3 tokens being decoded
    mem, compute = e.utilization()
    # The same figure as the engine's own counter of HBM bytes read per busy second over
    # the next decode step, over the GPU's bandwidth.
    read0, busy0 = e.stats.read_bytes, e.stats.busy_s
    step(e)
    read, busy = e.stats.read_bytes - read0, e.stats.busy_s - busy0
    g, m = catalog.gpu("RTX-4090"), catalog.model("llama-3-8b")
    assert busy == pytest.approx(e.perf.step_time(3, kv), rel=1e-12)
    assert read == pytest.approx(e.perf.weights + kv * e.perf.kv_token_bytes, rel=1e-12)
    assert mem == pytest.approx(read / busy / (g.memory_bandwidth_gb_s * 1e9), rel=1e-9)
    # FLOPs: 2 per parameter per token, and 4 * layers * heads * head_dim per context token
    # (QK^T and AV), over the GPU's peak in the format's dtype.
    flops = 2 * m.params_active * 3 + 4 * m.num_layers * m.num_attention_heads * m.head_dim * kv
    assert compute == pytest.approx(flops / busy / g.peak_flops("bf16"), rel=1e-9)
    assert 0 < compute < mem < 1  # a decode batch of 3 is bandwidth bound


def test_advance_applies_what_ends_by_then_and_a_mixed_step_that_starts_then(catalog):
    e = engine(catalog, 50)
    s = Seq(0, 16, 101)
    e.add(s, 0.0)
    first = e.next_event()
    assert e.advance(first - 1e-9) == [] and s.state == WAITING  # starts later: not yet
    e.advance(first)  # the prefill step starts then: applied
    assert s.state == DECODE
    end = e.next_event()  # a run of 100 decode steps to the finish
    assert e.advance(end - 1e-9) == [] and e.generated(s) == 1
    assert e.advance(end) == [s] and s.finished_at == end


def test_an_abort_replans_the_run_of_decode_steps(catalog):
    """The aborted request's planned finish is stale: the run goes on to the next one."""
    e = engine(catalog, 50)
    p = e.perf
    a, b = Seq("a", 16, 11), Seq("b", 16, 41)
    e.add(a, 0.0)
    e.add(b, 0.0)
    step(e)  # a's decode step D=0, b's prefill
    assert e.next_event() == pytest.approx(e.clock + p.decode_span(2, 17 + 16 + 2, 9), rel=1e-12)
    e.abort(a)  # it would have finished first, at D = 10 (b at D = 1 + 40)
    assert e.next_event() == pytest.approx(e.clock + p.decode_span(1, 17, 40), rel=1e-12)
    assert e.advance(float("inf")) == [b] and e.generated(b) == 41
    check(e)


def test_a_prefill_chunk_without_a_free_block_preempts_its_own_request(catalog):
    """Before vLLM 0.18 a request got in on its first chunk. 4 blocks, a 16-token budget:
    a (8 tokens, 3 blocks by its 40th output token) decodes; b (64 tokens, 1 output token) is
    admitted beside it with 15 tokens, then 15 and 15 more (a block each); its fourth chunk
    needs a fifth block. b, the newest, is preempted: of its 45 tokens, 2 full blocks stay
    cached (b's prompt is hashed), and no one joins a step that preempted."""
    e = engine(catalog, 4, "0.11.0", max_num_batched_tokens=16)
    p = e.perf
    a, b = Seq("a", 8, 40), Seq("b", 64, 1, keyed([1, 2, 3, 4], 64))
    e.add(a, 0.0)
    e.add(b, 0.0)  # a's prefill, begun at 0, is applied
    for computed, free in ((15, 2), (30, 1), (45, 0)):
        step(e)
        assert (b.state, b.computed, e.free_blocks) == (PREFILL, computed, free)
        check(e)
    t = e.clock
    step(e)  # a's decode D = 3 alone: context 8 + 3, plus the token
    assert e.clock == pytest.approx(t + p.step_time(1, 12, 12, seqs=1), rel=1e-12)
    assert (b.state, b.computed, b.preemptions, e.stats.preemptions) == (WAITING, 0, 1, 1)
    assert (a.preemptions, e.free_blocks, e.stats.prompt_tokens) == (0, 3, 8 + 45)
    check(e)
    # Its 2 full blocks were cached as computed: they stay cached, free, and hold all it had
    # in full (the third, partial, was freed for anyone). It comes back on them (32 tokens
    # found, 2 of the 3 free blocks) and its next 15 tokens.
    assert e.cached_tokens(b.keys) == 32
    step(e)
    assert (b.state, b.computed, e.stats.prefix_cache_hits) == (PREFILL, 47, 32)
    e.advance(float("inf"))
    assert a.finished_at and b.finished_at and e.free_blocks == e.total_blocks
    check(e)


def test_one_prefill_at_a_time_beside_max_num_seqs(catalog):
    e = engine(catalog, 50, max_num_seqs=1, max_num_batched_tokens=16)
    a, b = Seq("a", 24, 2), Seq("b", 4, 2)
    e.add(a, 0.0)
    e.add(b, 0.0)  # a's first chunk (16 tokens) applied
    assert e.next_event() == e.clock  # a mixed step: a still prefills
    step(e)
    assert (a.computed, b.state) == (24, WAITING)  # 8 tokens of budget left, but no seat


def test_a_request_counts_the_cached_blocks_it_takes_from_the_free_ones(catalog):
    """Cached blocks sitting free are free blocks: taking them leaves fewer for anyone.

    5 blocks. x (40 tokens, 2 full blocks cached) finishes; y (unhashed) decodes on 2 or 3
    blocks; z, x's prompt again, finds 2 blocks cached and free and needs 1 more block."""
    for version in ("0.11.0", "0.32.0"):
        for y_prompt, fits in ((24, True), (40, False)):
            e = engine(catalog, 5, version)
            x = Seq("x", 40, 1, keyed([1, 2, 3], 40))
            e.add(x, 0.0)
            e.advance(float("inf"))
            assert e.free_blocks == 5 and e.cached_tokens(x.keys) == 32
            y = Seq("y", y_prompt, 30)
            e.add(y, e.clock)
            step(e)  # y takes the 2 never-used blocks first, then the oldest freed one
            z = Seq("z", 40, 1, keyed([1, 2, 3], 40))
            e.add(z, e.clock)
            assert e.free_blocks == (3 if fits else 2)
            step(e)
            if fits:  # 1 new + 2 cached = 3 free blocks
                assert z.finished_at is not None and e.stats.prefix_cache_hits == 32
            else:
                assert z.state == WAITING and e.stats.prefix_cache_hits == 0
            e.pool.check()


def test_the_whole_prompt_rule_counts_cached_blocks_taken_from_the_free_ones(catalog):
    """vLLM >= 0.18: z (64 tokens, 2 blocks cached and free) needs 4 blocks in all, 2 of them
    new: with 3 free (its first 16-token chunk would fit) it waits."""
    e = engine(catalog, 5, max_num_batched_tokens=16)
    x = Seq("x", 40, 1, keyed([1, 2, 3], 40))
    e.add(x, 0.0)
    e.advance(float("inf"))
    y = Seq("y", 24, 40)  # 63 tokens at most: 4 blocks
    e.add(y, e.clock)
    step(e)  # y prefilled: 2 blocks taken, 3 free
    step(e)  # y's first decode step takes none (context 24)
    z = Seq("z", 64, 1, keyed([1, 2, 3, 4], 64))
    e.add(z, e.clock)
    assert e.free_blocks == 3
    assert e.next_event() > e.clock  # z cannot join: y's decode steps run at once
    step(e)
    assert z.state == WAITING and e.stats.prefix_cache_hits == 0


def test_two_requests_computing_one_prompt_at_once_cache_one_copy(catalog):
    """a and b arrive together with the same uncached prompt: both compute it; a's full
    blocks join the cache, b keeps private copies, and each gives back only its own."""
    e = engine(catalog, 20)
    c = Seq("c", 16, 200)
    e.add(c, 0.0)
    step(e)
    one = e.perf.step_time(1, 17)
    a = Seq("a", 40, 3, keyed([5, 6, 7], 40))
    b = Seq("b", 40, 3, keyed([5, 6, 7], 40))
    t = e.clock + 0.5 * one
    e.add(a, t)  # cuts c's run after its step D=0
    e.add(b, t)  # the same instant: both wait for the next step
    assert e.num_waiting == 2
    step(e)
    assert e.stats.prefix_cache_hits == 0 and e.stats.prompt_tokens == 16 + 80
    # c: 2 blocks (17 tokens + the one decoding), a and b 3 each
    assert e.total_blocks - e.free_blocks == 2 + 3 + 3
    assert (len(a.held), len(b.held)) == (2, 0)
    e.advance(e.clock + 10 * one)  # a and b finish; c decodes on
    assert a.finished_at and b.finished_at and e.num_running == 1
    e.pool.check()
    assert e.total_blocks - e.free_blocks == 2 and e.cached_tokens(a.keys) == 32
    d = Seq("d", 40, 1, keyed([5, 6, 7], 40))
    e.add(d, e.clock)
    e.advance(float("inf"))
    assert e.stats.prefix_cache_hits == 32
    e.pool.check()
    assert e.free_blocks == e.total_blocks


def test_a_preempted_request_with_a_cached_prefix_finds_it_and_its_own_blocks(catalog):
    """7 blocks; a and b: 32-token hashed prompts (2 full blocks each, cached as computed),
    25 and 40 output tokens. a prefills, then decodes beside b (admitted with d0 = 1). A run
    of 16 steps (D = 1..16) takes the last 2 free blocks (b's at D = 1, a's at D = 16); at
    D = 17 b needs a block: preempted with 48 tokens, its 2 prompt blocks stay cached for
    anyone, its third full block (generated tokens) for itself. Its 49 tokens need 4 blocks,
    3 are free: it waits for a's finish at D = 24, then finds 2 + 1 blocks and computes 1
    token."""
    e = engine(catalog, 7)
    a = Seq("a", 32, 25, keyed([1, 2], 32))
    b = Seq("b", 32, 40, keyed([3, 4], 32))
    e.add(a, 0.0)
    e.add(b, 0.0)
    step(e)
    assert (b.state, b.d0, e.free_blocks) == (DECODE, 1, 2)
    step(e)
    assert (e.steps_done, e.free_blocks) == (17, 0)
    step(e)
    assert (b.state, b.target, e.free_blocks, e.stats.preemptions) == (WAITING, 49, 3, 1)
    assert e.cached_tokens(b.keys) == 32
    assert e.next_event() > e.clock  # b cannot join: a's last steps run at once
    assert step(e) == [a]
    t = e.clock
    step(e)
    # 48 tokens found: b computes its last token on them.
    assert e.clock == pytest.approx(t + e.perf.step_time(1, 49, 49, seqs=1), rel=1e-12)
    st = e.stats
    assert (st.prefix_cache_queries, st.prefix_cache_hits, st.prompt_tokens) == (113, 48, 65)
    assert (b.state, e.generated(b), e.free_blocks) == (DECODE, 18, 3)
    e.pool.check()
    assert e.advance(float("inf")) == [b]
    assert e.generated(b) == 40 and e.stats.generation_tokens == 65
    assert e.free_blocks == e.total_blocks
    assert e.cached_tokens(a.keys) == e.cached_tokens(b.keys) == 32
    e.pool.check()


def test_utilization_counts_one_gpu_of_a_tensor_parallel_group(catalog):
    """With TP 2 each GPU reads half the weights and does half the work (its KV share is in
    kv_token_bytes already)."""
    p = perf(catalog, tp=2)
    e = Engine(p, 51 * BS)
    e.add(Seq(0, 100, 50), 0.0)
    e.advance(e.clock)
    kv = e.decode_read()
    assert kv == 100 + 1
    mem, compute = e.utilization()
    g, m = catalog.gpu("RTX-4090"), catalog.model("llama-3-8b")
    step_s = p.step_time(1, kv)
    read = p.weights / 2 + kv * p.kv_token_bytes
    assert mem == pytest.approx(read / step_s / (g.memory_bandwidth_gb_s * 1e9), rel=1e-9)
    flops = (2 * m.params_active + 4 * m.num_layers * m.num_attention_heads * m.head_dim * kv) / 2
    assert compute == pytest.approx(flops / step_s / g.peak_flops("bf16"), rel=1e-9)
    # The HBM bytes counted per GPU: runs of decode steps count them as single steps do,
    # 49 decode steps each reading half the weights and the context (101 .. 149 tokens).
    e.advance(float("inf"))
    one_by_one = Engine(p, 51 * BS, max_span_s=0.0)
    one_by_one.add(Seq(0, 100, 50), 0.0)
    one_by_one.advance(float("inf"))
    want = (p.weights / 2 + 100 * p.kv_token_bytes) + sum(
        p.weights / 2 + c * p.kv_token_bytes for c in range(101, 150)
    )
    assert e.stats.read_bytes == pytest.approx(want, rel=1e-12)
    assert one_by_one.stats.read_bytes == pytest.approx(want, rel=1e-12)


def test_utilization_is_at_most_one(catalog):
    """A server measured faster than the model of its GPU (speed 5) would read more than
    the GPU's bandwidth: reported as fully used."""
    e = Engine(perf(catalog, speed=5.0), 51 * BS)
    e.add(Seq(0, 16, 50), 0.0)
    e.advance(e.clock)
    assert e.n_decode == 1
    mem, compute = e.utilization()
    assert mem == 1.0 and 0 < compute < 1


def test_kv_events_say_which_blocks_are_stored(catalog):
    e = engine(catalog, 10, kv_events=True, max_num_batched_tokens=16)
    s = Seq(0, 40, 1, keyed([1, 2, 3], 40))
    e.add(s, 0.0)
    step(e)
    assert e.pool.events == [("stored", s.keys[:1])]
    step(e)
    assert e.pool.events == [("stored", s.keys[:1]), ("stored", s.keys[1:2])]


def test_chunk_steps_cost_their_tokens_kv_attention_pairs_and_sequences(catalog):
    """Big chunks are compute bound, so the attention pairs count; a host cost per sequence
    makes the sequence count matter. d decodes (16 tokens) while L (4096 tokens) is
    prefilled in chunks of 2047 (the 2048 budget less d's token), then S (100) joins L's
    last 2 tokens."""
    p = perf(catalog, per_seq_s=0.01)
    e = Engine(p, 601 * BS)
    d, big, small = Seq("d", 16, 100), Seq("L", 4096, 2), Seq("S", 100, 2)
    e.add(d, 0.0)
    step(e)
    e.add(big, 0.0)  # both arrived during d's prefill step
    e.add(small, 0.0)
    # compute bound: more attention pairs, a longer step
    assert p.step_time(2048, 2064, 2 * 2096145, seqs=2) > p.step_time(2048, 2064, 2096145, seqs=2)
    expected = [
        # d's context 16 + its token; L's chunk on nothing: 2047 * (0 + 2048 / 2) pairs
        (2048, 17 + 2047, 17 + 2047 * 1024, 2),
        # d at 17 + 1; L's second chunk on 2047 cached: 2047 * (2047 + 1024)
        (2048, 18 + 2047 + 2047, 18 + 2047 * 3071, 2),
        # d at 18 + 1; L's last 2 on 4094: 2 * (4094 + 1.5); S's 100: 100 * 50.5
        (1 + 2 + 100, 19 + 4096 + 100, 19 + 2 * 4095.5 + 100 * 50.5, 3),
    ]
    for tokens, kv, pairs, seqs in expected:
        t = e.clock
        step(e)
        assert e.clock - t == pytest.approx(p.step_time(tokens, kv, pairs, seqs=seqs), rel=1e-9)
    assert (big.state, small.state, e.n_decode) == (DECODE, DECODE, 3)
    assert e.stats.prompt_tokens == 16 + 4096 + 100


def test_requests_finishing_in_one_step_are_returned_in_admission_order(catalog):
    e = engine(catalog, 20)
    first = Seq("first", 16, 5)
    e.add(first, 0.0)
    late = [Seq(f"s{i}", 20 + i, 4) for i in range(3)]
    for s in late:
        e.add(s, 0.0)  # arrived during first's prefill: admitted together, in this order
    step(e)
    # first finishes at D = 4 (d0 = 0), the others at D = 1 + 3: the same step
    assert e.advance(float("inf")) == [first, *late]


def test_requests_crossing_a_block_boundary_together_each_take_a_block(catalog):
    """Three 20-token prompts admitted in one step decode in lockstep: at context 32 (decode
    step D = 1 + 12) each needs a third block, in the same step."""
    for cap in (0.0, None):  # one step at a time, then in runs
        e = engine(catalog, 20, max_span_s=cap)
        x = Seq("x", 8, 30)
        e.add(x, 0.0)
        same = [Seq(f"s{i}", 20, 20) for i in range(3)]
        for s in same:
            e.add(s, 0.0)
        step(e)  # x's decode step D = 0 (context 8: its first block has room), the prefills
        assert e.free_blocks == 20 - 1 - 3 * 2
        if cap == 0.0:
            while e.steps_done < 13:
                step(e)
                check(e)
            assert e.free_blocks == 20 - 2 - 3 * 2  # x took its second block at D = 8
            step(e)
            assert e.free_blocks == 20 - 2 - 3 * 3
        else:
            # one run to the three's finish at D = 1 + 19: contexts 39 (3 blocks) and x's 28
            assert step(e) == same
            assert e.free_blocks == 20 - 2
        check(e)
        e.advance(float("inf"))
        assert e.free_blocks == e.total_blocks and e.stats.finished == 4


def test_an_aborted_request_among_those_finishing_together_hides_none_of_them(catalog):
    """Its planned finish stays in the heap between two live ones due the same step."""
    e = engine(catalog, 20)
    first = Seq("first", 16, 5)
    e.add(first, 0.0)
    late = [Seq(f"s{i}", 20 + i, 4) for i in range(3)]
    for s in late:
        e.add(s, 0.0)
    step(e)
    e.abort(late[1])
    end = e.next_event()  # one run to D = 4, where the other three finish
    assert e.advance(float("inf")) == [first, late[0], late[2]]
    assert [e.generated(s) for s in (first, late[0], late[2])] == [5, 4, 4]
    assert late[2].finished_at == end


def crowd(catalog, cap, version=None, seed=7):
    """40 requests arriving at 20/s on a 30-block cache: many preemptions and resumes."""
    rnd = random.Random(seed)
    e = engine(catalog, 30, version, max_span_s=cap)
    seqs, t = [], 0.0
    for i in range(40):
        t += rnd.expovariate(20.0)
        e.advance(t)
        check(e)
        s = Seq(i, rnd.randint(10, 120), rnd.randint(5, 120))
        seqs.append(s)
        e.add(s, t)
        check(e)
    e.advance(float("inf"))
    return e, seqs


def test_a_crowded_engine_keeps_its_books_and_runs_match_single_steps(catalog):
    for version in (None, "0.11.0"):
        (fast, a), (slow, b) = crowd(catalog, None, version), crowd(catalog, 0.0, version)
        for e, seqs in ((fast, a), (slow, b)):
            assert e.idle and e.free_blocks == e.total_blocks
            assert [e.generated(s) for s in seqs] == [s.output for s in seqs]
            assert all(s.first_token_at <= s.finished_at for s in seqs)
            assert e.stats.generation_tokens == sum(s.output for s in seqs)
            assert max(s.preemptions for s in seqs) >= 2  # some were preempted twice
            assert e.stats.preemptions == sum(s.preemptions for s in seqs)
        assert [s.finished_at for s in a] == pytest.approx([s.finished_at for s in b], rel=1e-9)
        assert fast.stats.preemptions == slow.stats.preemptions


def test_a_resumed_request_uses_its_own_blocks_only_after_the_prefix_it_held(catalog):
    """b computed its prompt beside a (same prompt, same step), so its 2 prompt blocks are
    private copies: its own run after a preemption starts at block 0. When it comes back the
    cache has a's copies of blocks 0-1: it takes those (32 tokens), and its own run, which
    starts at block 0, does not continue them: everything after is computed again."""
    e = engine(catalog, 11)
    c = Seq("c", 8, 40)
    e.add(c, 0.0)
    step(e)
    a = Seq("a", 40, 30, keyed([5, 6, 7], 40))
    b = Seq("b", 40, 30, keyed([5, 6, 7], 40))
    t = e.clock + 0.5 * e.perf.step_time(1, 9)
    e.add(a, t)  # cuts c's run after its step D = 0
    e.add(b, t)
    step(e)
    assert (len(a.held), len(b.held), e.stats.prefix_cache_hits) == (2, 0, 0)
    e.advance(float("inf"))
    assert (a.preemptions, b.preemptions, c.preemptions) == (0, 1, 0)
    assert e.stats.prefix_cache_hits == 32
    # b came back with prompt + generated tokens, all but the 32 found computed again
    assert e.stats.prompt_tokens == 8 + 40 + 40 + (b.target - 32)
    assert e.generated(b) == 30 and e.free_blocks == e.total_blocks
    e.pool.check()
