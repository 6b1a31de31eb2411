"""The vLLM release rules the model follows (benchmarks/accuracy/PROFILING.md has their source)."""

from __future__ import annotations

import pytest

from fleetctl.model.catalog import load_catalog
from fleetctl.model.perf import EAGER_LAYER_S, EnginePerf, kv_budget, vllm_batch_defaults
from fleetctl.vllm.release import TARGET, parse_version, release


def test_the_target_release_is_the_newest_flag_list_fleetctl_knows():
    assert load_catalog().target_vllm_version == TARGET


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("0.6.3.post1", (0, 6, 3)), ("v0.10.1.1", (0, 10, 1)), ("0.32", (0, 32, 0))],
)
def test_release_numbers(text, parsed):
    assert parse_version(text) == parsed


def test_defaults_follow_the_release():
    cat = load_catalog()
    a100, h100, rtx = cat.gpu("A100-SXM4-80GB"), cat.gpu("H100-SXM-80GB"), cat.gpu("RTX-4090")
    # V0 without chunked prefill batches a whole max-length prompt; above 32K it chunks.
    assert vllm_batch_defaults(h100, "0.6.3", 8192) == (8192, 256)
    assert vllm_batch_defaults(rtx, "0.6.3", 4096) == (4096, 256)
    assert vllm_batch_defaults(rtx, "0.6.3", 65536) == (512, 256)
    assert vllm_batch_defaults(rtx, "0.6.6", 65536) == (2048, 256)
    # V1: A100s were large GPUs only in 0.8.0-0.9.0.
    assert vllm_batch_defaults(a100, "0.8.5") == (8192, 1024)
    assert vllm_batch_defaults(a100, "0.9.2") == (2048, 256)
    assert vllm_batch_defaults(h100) == (8192, 1024)
    assert release("0.20.0").default_utilization == 0.90
    assert release().default_utilization == 0.92


def test_memory_rules_by_release():
    cat = load_catalog()
    gpu, model, fmt = cat.gpu("H100-SXM-80GB"), cat.model("llama-3.1-8b"), cat.format("bf16")

    def budget(version, **kw):
        return kv_budget(gpu, model, fmt, 1, 0.9, max_model_len=32768, vllm_version=version, **kw)

    # CUDA graphs are subtracted before sizing the KV cache from 0.21 only.
    assert budget("0.19.0").cuda_graphs == 0 and budget("0.22.0").cuda_graphs > 0
    assert budget("0.22.0", enforce_eager=True).cuda_graphs == 0
    # V0 profiles a whole max-length prompt without chunked prefill: a far larger peak.
    assert budget("0.6.3").activation > 2 * budget("0.19.0").activation
    # Tensor-parallel buffers counted until 0.11; the CUDA context in 0.6.4 and 0.8.0-0.9.0.
    tp2 = kv_budget(gpu, model, fmt, 2, 0.9, vllm_version="0.10.2")
    assert tp2.non_torch > kv_budget(gpu, model, fmt, 2, 0.9, vllm_version="0.11.0").non_torch
    assert budget("0.6.4").non_torch > budget("0.6.3").non_torch


def test_v0_steps_cost_more_than_v1_and_eager_more_still():
    cat = load_catalog()
    gpu, model, fmt = cat.gpu("A100-SXM4-80GB"), cat.model("llama-3-8b"), cat.format("bf16")
    v0, v1 = EnginePerf(gpu, model, fmt, vllm_version="0.6.3"), EnginePerf(gpu, model, fmt)
    eager = EnginePerf(gpu, model, fmt, enforce_eager=True)
    assert v0.decode_tok_s(1) < v1.decode_tok_s(1) and eager.decode_tok_s(1) < v1.decode_tok_s(1)
    # The closed-form decode span agrees with step-by-step sums, overhead included.
    steps = [v0.step_time(4, 4 * 100 + 4 * i) for i in range(50)]
    assert v0.decode_span(4, 400, 50) == pytest.approx(sum(steps), rel=1e-9)


def test_eager_launches_overlap_the_gpu_work():
    # The host launches a layer's kernels while the GPU runs the layer before: a step takes the
    # longer of the two. A small model on a fast GPU waits on its launches; a large one on a
    # slow GPU hides them.
    cat = load_catalog()
    fmt = cat.format("bf16")
    for gpu, model, hidden in (("H100-SXM-80GB", "llama-3-8b", False), ("L4", "qwen2.5-7b", True)):
        g, m = cat.gpu(gpu), cat.model(model)
        graphs, eager = EnginePerf(g, m, fmt), EnginePerf(g, m, fmt, enforce_eager=True)
        gpu_work = graphs.step_time(1, 500) - graphs.step_overhead
        launches = m.num_layers * EAGER_LAYER_S
        want = max(gpu_work, launches) + graphs.step_overhead
        assert eager.step_time(1, 500) == pytest.approx(want)
        assert (eager.step_time(1, 500) == pytest.approx(graphs.step_time(1, 500))) is hidden
        # The closed form follows the envelope where the growing KV read overtakes the launches.
        steps = [eager.step_time(128, 128 * 100 + 128 * i) for i in range(3000)]
        assert eager.decode_span(128, 128 * 100, 3000) == pytest.approx(sum(steps), rel=1e-9)
        if not hidden:  # the span starts on the launches and ends on the memory roof
            assert steps[0] == pytest.approx(launches + graphs.step_overhead)
            assert steps[-1] > steps[0]


def test_a_measured_speed_scales_the_gpu_work_not_the_fixed_cost():
    cat = load_catalog()
    gpu, model, fmt = cat.gpu("RTX-4090"), cat.model("llama-3-8b"), cat.format("bf16")
    base, slow = EnginePerf(gpu, model, fmt), EnginePerf(gpu, model, fmt, speed=0.5)
    for tokens, kv in ((1, 1000), (2048, 0)):
        work = base.step_time(tokens, kv) - base.step_overhead
        assert slow.step_time(tokens, kv) - slow.step_overhead == pytest.approx(2 * work)


def test_releases_outside_what_was_read_are_refused_with_why(cli):
    """estimate --vllm-version takes only releases whose rules were read (0.4 to 0.33.x):
    an older V0 sized its cache by other rules, a newer one may have changed them."""
    from fleetctl.vllm.release import unmodelled

    assert unmodelled("0.4.0") is None and unmodelled("0.33.9") is None
    assert unmodelled("0.6.3.post1") is None
    assert "predates the rules fleetctl read (0.4.3 to 0.33.0)" in (unmodelled("0.3.3") or "")
    assert "newer than the newest release" in (unmodelled("0.34.0") or "")
    args = ["estimate", "--gpu", "A100-SXM4-80GB", "--model", "llama-3-8b", "--format", "bf16"]
    r = cli(*args, "--vllm-version", "0.2.5", "--no-calibration")
    assert r.code == 2 and "vLLM 0.2.5 is not modelled" in r.err
    assert "give a release from 0.4.0 to 0.33.x" in r.err
    assert cli(*args, "--vllm-version", "0.5.5", "--no-calibration").code == 0


def test_awq_ran_its_own_kernel_before_marlin_took_it_over(catalog):
    """vLLM converts AWQ checkpoints to Marlin from 0.5.3 (vllm#6612); before, the AWQ GEMM
    kernel ran, slower (the format's plain_kernel_efficiency), and the flag was plain awq."""
    from fleetctl.model.perf import EnginePerf

    gpu, model, awq = (
        catalog.gpu("A100-SXM4-80GB"),
        catalog.model("llama-3-8b"),
        catalog.format("awq-int4"),
    )
    old, new = (
        EnginePerf(gpu, model, awq, vllm_version="0.5.2"),
        EnginePerf(gpu, model, awq, vllm_version="0.5.3"),
    )
    assert awq.quantization_flag(gpu, "0.5.2") == "awq"
    assert awq.quantization_flag(gpu, "0.5.3") == "awq_marlin"
    assert awq.quantization_flag(gpu) == "awq_marlin"  # fleetctl's target
    assert awq.kernel_efficiency_on("ampere", "0.5.2") == 0.6
    assert awq.kernel_efficiency_on("ampere", "0.5.3") == 0.9
    assert old.decode_tok_s(1) < 0.85 * new.decode_tok_s(1)  # the weights read 1.5x slower
    # Turing never had Marlin: the same kernel either side of 0.5.3.
    assert awq.kernel_efficiency_on("turing", "0.5.2") == awq.kernel_efficiency_on("turing")
    gptq = catalog.format("gptq-int4")
    assert gptq.quantization_flag(gpu, "0.4.1") == "gptq"
    assert gptq.quantization_flag(gpu, "0.4.2") == "gptq_marlin"
