"""LoRA in the engine model: GPU slots (--max-loras) limit a batch's adapters as vLLM's
scheduler does, the least recently used idle slot is reused, loads and the rank's kernels
cost the times model/lora.py gives, and a slower card feels them more."""

from __future__ import annotations

import pytest

from fleetctl.model.lora import LoraPerf
from fleetctl.model.perf import EnginePerf
from fleetctl.sim.engine import WAITING, Engine, Seq


def perf(catalog, gpu: str = "A100-SXM4-80GB") -> EnginePerf:
    return EnginePerf(catalog.gpu(gpu), catalog.model("llama-3-8b"), catalog.format("bf16"))


def lora_engine(catalog, max_loras: int, cpu: int = 0, gpu: str = "A100-SXM4-80GB") -> Engine:
    p = perf(catalog, gpu)
    return Engine(p, 100_000, lora=LoraPerf(p, 16), max_loras=max_loras, max_cpu_loras=cpu)


def seq(adapter: str | None, prompt: int = 100, output: int = 20, rank: int = 16) -> Seq:
    s = Seq(adapter or "base", prompt, output)
    s.adapter, s.rank = adapter, rank
    return s


def run(e: Engine, seqs: list[Seq], at: float = 0.0) -> None:
    for s in seqs:
        e.add(s, at)
    e.advance(1e9)


def test_a_batch_holds_at_most_max_loras_adapters_and_the_others_keep_their_place(catalog):
    e = lora_engine(catalog, max_loras=1)
    e.add_lora("a", 16)
    e.add_lora("b", 16)
    a, b, base, a2 = seq("a"), seq("b"), seq(None), seq("a")
    for s in (a, b, base, a2):
        e.add(s, 0.0)
    e.advance(e.next_event() or 0.0)  # the first step
    # b would be a second adapter: skipped; the base request and a's second one go past it.
    assert b.state == WAITING and list(e.waiting) == [b]
    assert {base.state, a2.state, a.state} != {WAITING}
    assert e.lora_running == {"a": 2}
    e.advance(1e9)
    # b starts only once both of a's requests have finished (its slot then frees).
    assert b.first_token_at is not None and a.finished_at is not None
    assert b.first_token_at > max(a.finished_at, a2.finished_at)
    assert e.stats.lora_loads == 2  # a into the slot, then b in place of a


def test_the_least_recently_used_idle_slot_is_reused_and_a_warm_adapter_loads_nothing(catalog):
    e = lora_engine(catalog, max_loras=2, cpu=3)
    for a in ("a", "b", "c"):
        e.add_lora(a, 16)
    run(e, [seq("a")])
    run(e, [seq("b")], e.clock)
    assert list(e.gpu_loras) == ["a", "b"]
    run(e, [seq("a")], e.clock)  # warm: a moves to the most recent end
    assert e.stats.lora_loads == 2 and list(e.gpu_loras) == ["b", "a"]
    run(e, [seq("c")], e.clock)  # b is the least recently used: c takes its slot
    assert list(e.gpu_loras) == ["a", "c"] and e.stats.lora_loads == 3
    assert e.stats.lora_disk_loads == 0  # all three were in the CPU cache


def test_an_adapter_out_of_the_cpu_cache_is_read_from_disk(catalog):
    e = lora_engine(catalog, max_loras=1, cpu=2)
    for a in ("a", "b", "c"):  # c's load evicts a from the CPU cache
        e.add_lora(a, 16)
    assert list(e.cpu_loras) == ["b", "c"]
    first, second = seq("a"), seq("c")  # a's read evicts b, the least recent; c stays
    run(e, [first])
    run(e, [second], e.clock)
    lora = e.lora
    assert lora is not None
    assert e.stats.lora_disk_loads == 1 and e.stats.lora_loads == 2
    assert e.stats.lora_load_s == pytest.approx(lora.load_s(16, False) + lora.load_s(16, True))
    # The disk read shows in the first token: a's first token waits for it.
    assert lora.load_s(16, False) > 0.3
    assert first.first_token_at - 0.0 > lora.load_s(16, False)


def test_a_cold_adapters_first_token_pays_its_load_and_a_warm_one_does_not(catalog):
    e = lora_engine(catalog, max_loras=1)
    e.add_lora("a", 16)
    cold = seq("a")
    run(e, [cold])
    start = e.clock
    warm = seq("a")
    run(e, [warm], start)
    lora = e.lora
    assert lora is not None
    cold_ttft = cold.first_token_at
    warm_ttft = warm.first_token_at - start
    assert cold_ttft - warm_ttft == pytest.approx(lora.load_s(16, True), rel=1e-6)


def test_a_step_with_adapters_costs_more_by_their_number_and_a_4090_feels_it_more(catalog):
    def decode_s(gpu: str, adapters: int) -> float:
        e = lora_engine(catalog, max_loras=4, gpu=gpu)
        names = [f"x{i}" for i in range(adapters)]
        for n in names:
            e.add_lora(n, 16)
        seqs = [seq(names[i % adapters] if adapters else None, 100, 200) for i in range(8)]
        run(e, seqs)
        return e.clock

    for gpu in ("A100-SXM4-80GB", "RTX-4090"):
        assert decode_s(gpu, 0) < decode_s(gpu, 1) < decode_s(gpu, 4)
    a100 = decode_s("A100-SXM4-80GB", 1) - decode_s("A100-SXM4-80GB", 0)
    rtx = decode_s("RTX-4090", 1) - decode_s("RTX-4090", 0)
    assert rtx > 1.5 * a100  # the kernels are memory-bound: half the bandwidth, twice the time


def test_the_rank_and_the_card_set_the_load_time(catalog):
    small, large = LoraPerf(perf(catalog), 8), LoraPerf(perf(catalog), 64)
    assert small.adapter_bytes(64) == 8 * small.adapter_bytes(8)
    assert large.load_s(64, True) > small.load_s(8, True)
    assert large.load_s(64, False) > large.load_s(64, True)  # a disk read is slower than PCIe
    # A rank-64 slot's kernels read 8 times a rank-8 one's weights each step.
    assert large.step_s(1, 0) > small.step_s(1, 0)
