"""vLLM V1 rules the engine model follows beyond batching: the block pool's null block, the
CPU backend's block size, and admission only when a whole prompt fits (vLLM >= 0.18)."""

from __future__ import annotations

from fleetctl.model.perf import EnginePerf
from fleetctl.sim.engine import Engine, Seq


def perf(catalog, version: str | None = None) -> EnginePerf:
    g, m, f = catalog.gpu("RTX-4090"), catalog.model("llama-3-8b"), catalog.format("bf16")
    return EnginePerf(g, m, f, vllm_version=version)


def test_v1_keeps_one_block_aside_and_blocks_follow_the_block_size(catalog):
    # vLLM's BlockPool takes a "null block" from the free queue at start (v1/core/block_pool.py),
    # and the KV size it reports counts it; V0 had none.
    assert Engine(perf(catalog, "0.32.0"), 12 * 128, block_size=128).total_blocks == 11
    assert Engine(perf(catalog, "0.6.3"), 12 * 128, block_size=128).total_blocks == 12
    e = Engine(perf(catalog, "0.32.0"), 12 * 128, block_size=128)
    assert (e.blocks_for(128), e.blocks_for(129)) == (1, 2)


def run_two(catalog, version: str) -> tuple[Seq, Seq, Engine]:
    """A long request decoding, and a second whose first chunk fits the free blocks but whose
    whole prompt does not."""
    e = Engine(perf(catalog, version), 6 * 16, max_num_batched_tokens=16)  # 5 or 6 blocks
    first, second = Seq(0, 16, 40), Seq(1, 64, 4)  # 16 + 40 tokens: 4 blocks at the end
    e.add(first, 0.0)
    e.advance(0.05)  # prefilled, decoding: 2 blocks held
    e.add(second, 0.05)
    e.advance(float("inf"))
    return first, second, e


def test_a_request_is_admitted_only_when_its_whole_prompt_fits(catalog):
    first, second, e = run_two(catalog, "0.32.0")
    # The second's 64 tokens (4 blocks, 3 free) wait for the first to finish: no preemption.
    assert e.stats.preemptions == 0
    assert second.first_token_at is not None and first.finished_at is not None
    assert second.first_token_at > first.finished_at
    # Before vLLM 0.18 its first chunk was enough to get in, and the two then fought for
    # blocks: the newer one was preempted and recomputed.
    first, second, e = run_two(catalog, "0.11.0")
    assert e.stats.preemptions > 0 and second.preemptions > 0 and first.preemptions == 0
