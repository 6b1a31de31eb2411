"""The shared performance model reproduces the seed's numbers and behaves like a roofline."""

from __future__ import annotations

import pytest

from fleetctl.perf import (
    EnginePerf,
    kv_budget,
    kv_bytes_per_token,
    max_sequences,
    vllm_batch_defaults,
    weights_bytes,
)


@pytest.fixture
def llama8(catalog):
    return catalog.model("llama-3-8b"), catalog.format("bf16")


def test_llama3_8b_bf16_is_16_gb(llama8):
    model, bf16 = llama8
    assert weights_bytes(model, bf16) == pytest.approx(16.06e9, rel=0.005)


def test_seed_kv_budgets_7gb_vs_63gb_about_9x(catalog, llama8):
    # The seed: "leaving about 7 GB for KV cache" on a 4090 against "approximately 63 GB" on an
    # A100 80GB. Those match vLLM giving the engine 95% of the GPU (see inventory/seed-*.yaml).
    model, bf16 = llama8
    rtx = kv_budget(catalog.gpu("RTX-4090"), model, bf16, gpu_memory_utilization=0.95)
    a100 = kv_budget(catalog.gpu("A100-SXM4-80GB"), model, bf16, gpu_memory_utilization=0.95)
    assert 6.5e9 <= rtx.kv_total <= 7.5e9
    assert 61e9 <= a100.kv_total <= 65e9
    assert 8.5 <= a100.kv_total / rtx.kv_total <= 9.5
    # Weights take "roughly 67 percent of the 24 GB" of the 4090.
    assert rtx.weights / 24e9 == pytest.approx(0.67, abs=0.01)


def test_seed_decode_speeds(catalog, llama8):
    model, bf16 = llama8
    rtx = catalog.gpu("RTX-4090")
    bound = rtx.memory_bandwidth_gb_s * 1e9 / weights_bytes(model, bf16)
    assert bound == pytest.approx(62, abs=1.5)  # "about 62 tokens per second" bound
    assert EnginePerf(rtx, model, bf16).decode_tok_s(1, 128) == pytest.approx(47, abs=1.5)
    a100 = EnginePerf(catalog.gpu("A100-SXM4-80GB"), model, bf16)
    assert a100.decode_tok_s(1, 128) == pytest.approx(105, abs=2)


def test_kv_bytes_per_token(catalog):
    m = catalog.model("llama-3-8b")
    assert kv_bytes_per_token(m) == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_bytes_per_token(m, 1) == 65536  # fp8 KV cache halves it
    assert kv_bytes_per_token(m, 2, tp=2) == 65536  # each GPU holds half the KV heads
    # More GPUs than KV heads: vLLM replicates heads so every GPU holds one.
    assert kv_bytes_per_token(m, 2, tp=16) == 2 * 32 * 1 * 128 * 2


def test_fp8_kv_cache_doubles_the_tokens_of_one_kv_budget(catalog):
    # The budget in bytes is the same (weights and reserves do not change); an fp8 cache holds
    # twice the tokens in it, to the block.
    g, m, bf16 = catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3-8b"), catalog.format("bf16")
    auto, fp8 = kv_budget(g, m, bf16), kv_budget(g, m, bf16, kv_cache_dtype="fp8")
    assert fp8.kv_per_gpu == auto.kv_per_gpu
    assert fp8.kv_tokens == pytest.approx(2 * auto.kv_tokens, abs=16)
    assert fp8.kv_tokens == fp8.kv_per_gpu // 65536 // 16 * 16  # 64 KiB a token, whole blocks
    for dtype in ("fp8_e4m3", "fp8_e5m2"):
        assert kv_budget(g, m, bf16, kv_cache_dtype=dtype).kv_tokens == fp8.kv_tokens
    # The engine reads half the KV bytes per token, so long-context decode is faster.
    e_auto, e_fp8 = EnginePerf(g, m, bf16), EnginePerf(g, m, bf16, kv_cache_dtype="fp8")
    assert (e_auto.kv_token_bytes, e_fp8.kv_token_bytes) == (131072, 65536)
    assert e_fp8.step_time(64, 64 * 8000) < e_auto.step_time(64, 64 * 8000)


def test_tensor_parallel_steps_pay_two_all_reduces_per_layer(catalog):
    # A batch-1 decode is memory-bound: each GPU reads half the weights and half the KV
    # heads, then every layer all-reduces twice: a fixed latency (25 us on PCIe, 8 us on
    # NVLink) and 2 x hidden x 2 bytes through a ring (PCIe 4: 25 GB/s; NVLink: half of 900).
    m, f = catalog.model("llama-3-8b"), catalog.format("bf16")
    for gpu, latency, link in (("RTX-4090", 25e-6, 25e9), ("H100-SXM-80GB", 8e-6, 450e9)):
        g = catalog.gpu(gpu)
        two = EnginePerf(g, m, f, tp=2)
        memory = weights_bytes(m, f) / 2 / two.weight_bandwidth
        memory += 512 * two.kv_token_bytes / two.bandwidth
        comm = m.num_layers * (2 * latency + 2 * m.hidden_size * 2 * 1.0 / link)
        assert two.step_time(1, 512) == pytest.approx(memory + comm + two.step_overhead, rel=1e-9)
        assert EnginePerf(g, m, f).step_time(1, 512) > two.step_time(1, 512)  # still faster


def test_quantized_weights_keep_embeddings_in_16_bits(catalog):
    m13 = catalog.model("llama-2-13b")
    gptq = weights_bytes(m13, catalog.format("gptq-int4"))
    # The seed: "Llama-3 13B (INT4 GPTQ, approximately 7 GB)".
    assert gptq == pytest.approx(7.2e9, rel=0.03)
    assert gptq > (m13.params_total * 0.5195)  # embeddings are not 4-bit


def test_70b_bf16_needs_two_a100s(catalog):
    m70, bf16 = catalog.model("llama-3-70b"), catalog.format("bf16")
    assert weights_bytes(m70, bf16) == pytest.approx(141e9, rel=0.005)
    a100 = catalog.gpu("A100-SXM4-80GB")
    assert kv_budget(a100, m70, bf16, tp=1).kv_tokens == 0
    assert kv_budget(a100, m70, bf16, tp=2).kv_tokens > 8192 * 4


def test_int4_kernels_favour_ampere_over_ada(catalog):
    # The seed's kernel observation is data (profiles/formats/gptq-int4.yaml), and shows up here:
    # INT4 gains more over BF16 on an A100 than on a 4090.
    m = catalog.model("llama-3-8b")
    bf16, gptq = catalog.format("bf16"), catalog.format("gptq-int4")
    gains = {}
    for gpu in ("A100-SXM4-80GB", "RTX-4090"):
        g = catalog.gpu(gpu)
        gains[gpu] = EnginePerf(g, m, gptq).decode_tok_s(1) / EnginePerf(g, m, bf16).decode_tok_s(1)
    assert gains["A100-SXM4-80GB"] > gains["RTX-4090"] * 1.15


def test_roofline_regimes(catalog, llama8):
    model, bf16 = llama8
    a100 = EnginePerf(catalog.gpu("A100-SXM4-80GB"), model, bf16)
    rtx = EnginePerf(catalog.gpu("RTX-4090"), model, bf16)
    assert a100.bound_regime(1, 128) == "bandwidth"
    # At a large batch of short sequences the A100 runs out of compute first; the 4090 has more
    # compute per byte of bandwidth, so it stays bandwidth-bound to a larger batch.
    crossover = {}
    for name, e in (("a100", a100), ("rtx", rtx)):
        crossover[name] = next(b for b in range(1, 1024) if e.bound_regime(b, 128) == "compute")
    assert crossover["a100"] < crossover["rtx"]
    # Throughput grows with batch but per-sequence speed falls.
    assert a100.decode_tok_s(64) > a100.decode_tok_s(8) > a100.decode_tok_s(1)
    assert a100.decode_tok_s(64) / 64 < a100.decode_tok_s(1)


def test_prefill_is_compute_bound_and_superlinear(catalog, llama8):
    model, bf16 = llama8
    e = EnginePerf(catalog.gpu("A100-SXM4-80GB"), model, bf16)
    t1, t4 = e.prefill_time(2048), e.prefill_time(8192)
    assert 4.0 < t4 / t1 < 5.0  # attention makes it slightly worse than linear
    assert e.bound_regime(2048) == "compute"


def test_moe_reads_active_experts_only(catalog):
    mx, bf16 = catalog.model("mixtral-8x7b"), catalog.format("bf16")
    e = EnginePerf(catalog.gpu("H100-SXM-80GB"), mx, bf16, tp=2)
    one = e.weight_read_bytes(1)
    assert one == pytest.approx(mx.params_active * 2, rel=0.01)  # top-2 of 8 experts
    assert e.weight_read_bytes(64) == pytest.approx(e.weights, rel=0.001)  # all experts hit


def test_tensor_parallel_costs_communication(catalog):
    m, bf16 = catalog.model("llama-3-8b"), catalog.format("bf16")
    nvlink = catalog.gpu("A100-SXM4-80GB")
    pcie = catalog.gpu("RTX-4090")
    for g in (nvlink, pcie):
        one, two = EnginePerf(g, m, bf16, 1), EnginePerf(g, m, bf16, 2)
        assert 1.0 < two.decode_tok_s(1) / one.decode_tok_s(1) < 2.0
    # The same card over NVLink and over PCIe: the link alone makes the difference.
    over_pcie = nvlink.model_copy(update={"interconnect": "pcie", "pcie_gen": 4})
    speedup = {
        g.interconnect: EnginePerf(g, m, bf16, 2).decode_tok_s(1)
        / EnginePerf(g, m, bf16, 1).decode_tok_s(1)
        for g in (nvlink, over_pcie)
    }
    assert speedup["nvlink"] > speedup["pcie"]


def test_max_sequences_counts_whole_blocks():
    assert max_sequences(16 * 100, 16) == 100
    assert max_sequences(16 * 100, 17) == 50  # 17 tokens take 2 blocks
    assert max_sequences(0, 8192) == 0


def test_vllm_batch_defaults_follow_vllm(catalog):
    assert vllm_batch_defaults(catalog.gpu("H100-SXM-80GB")) == (8192, 1024)
    assert vllm_batch_defaults(catalog.gpu("A100-SXM4-80GB")) == (2048, 256)
    assert vllm_batch_defaults(catalog.gpu("RTX-4090")) == (2048, 256)


def test_capacity_is_kv_limited_on_small_gpus(catalog, llama8):
    model, bf16 = llama8
    out = {}
    for name in ("A100-SXM4-80GB", "RTX-4090"):
        g = catalog.gpu(name)
        b = kv_budget(g, model, bf16)
        out[name] = EnginePerf(g, model, bf16).capacity_rps(4000, 500, b.kv_tokens, 256)
    # Long prompts: the 4090 holds few sequences, so it falls further behind than bandwidth alone.
    bw_ratio = 2039 * 0.83 / (1008 * 0.75)
    assert out["A100-SXM4-80GB"] / out["RTX-4090"] > bw_ratio
