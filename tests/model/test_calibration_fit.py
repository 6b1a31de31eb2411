"""Calibration's step fit in the performance model's terms: windows timed by the clock, the
host-bound shape (a server whose GPU work is invisible in its steps) and prefill compute."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetctl.model.calibration import (
    EngineFit,
    Key,
    Sample,
    engine_fit,
    entry_for,
    fit_step,
    window,
)
from fleetctl.model.catalog import load_catalog
from fleetctl.model.perf import EnginePerf
from fleetctl.vllm.metrics import Scrape
from tests.conftest import DATA

PROFILES = DATA / "profiles"
KEY = Key("CPU-TEST", "tiny-llama", "bf16", 1)


@pytest.fixture(scope="module")
def tiny() -> EnginePerf:
    cat = load_catalog([PROFILES])
    return EnginePerf(
        cat.gpu("CPU-TEST"), cat.model("tiny-llama"), cat.format("bf16"), 1, "bfloat16"
    )


def test_a_window_timed_by_the_clock_counts_steps_not_inter_token_gaps():
    before = Scrape(running=3, itl_sum=10.0, itl_count=1000, steps=400, step_tokens=2000, at=5.0)
    # One second later: 300 steps, 900 decode tokens and 600 prompt tokens; a preempted
    # request's wait made the inter-token latency sum grow by 6 s, not by the 1 s that passed.
    after = Scrape(running=2, itl_sum=16.0, itl_count=1900, steps=700, step_tokens=3500, at=6.0)
    s = window(before, after)
    assert s is not None
    assert s.step_s == pytest.approx(6.0 / 900)  # what the inter-token latency says
    assert s.wall_step_s == pytest.approx(1.0 / 300)  # what the clock says
    assert (s.batch, s.prefill_per_step) == (pytest.approx(3.0), pytest.approx(2.0))
    # Not busy at both ends, or not stamped: not timed.
    assert window(replace(before, running=0), after).wall_step_s == 0.0  # type: ignore[union-attr]
    assert window(replace(before, at=None), after).wall_step_s == 0.0  # type: ignore[union-attr]


def test_prefix_cache_hits_are_not_prefill_tokens():
    """Two requests finished with 3,000 prompt tokens, 1,200 of them prefix-cache hits: the
    prefill seconds were spent on the 1,800 computed, and the sample says so."""
    before = Scrape(prefill_sum=1.0, prefill_count=4, prompt_sum=5000, prompt_count=4)
    after = replace(
        before,
        prefill_sum=1.5,
        prefill_count=6,
        prompt_sum=8000,
        prompt_count=6,
    )
    s = window(replace(before, prefill_kv_tokens=4000), replace(after, prefill_kv_tokens=5800))
    assert s is not None and (s.prefill_tokens, s.requests) == (1800, 2)
    # A server without the computed-tokens histogram: its prompt tokens, all of them.
    s = window(before, after)
    assert s is not None and s.prefill_tokens == 3000


def timed(truth: EnginePerf, batches=(1, 2, 3, 4, 6), prompt_per_step=(0, 20, 60)) -> list[Sample]:
    """Windows of a server whose steps take `truth`'s time, with prompt tokens beside."""
    out = []
    for b in batches:
        for p in prompt_per_step:
            decode = truth.step_time(b, b * 200)
            # A prompt token in a mixed step costs the compute it adds (prefill_marginal).
            step = decode + (truth.prefill_marginal(p) - truth.per_seq_s if p else 0.0)
            out.append(
                Sample(
                    batch=b,
                    step_s=3 * step,  # inflated: the fit must use the clock
                    tokens=200,
                    requests=2,
                    context=200,
                    wall_step_s=step,
                    prefill_per_step=p,
                )
            )
    return out


def test_the_timed_fit_separates_fixed_per_sequence_and_prompt_costs(tiny):
    truth = replace(tiny, overhead_s=2.5e-3, per_seq_s=0.2e-3, compute_speed=0.5)
    step, note = fit_step(timed(truth))
    assert step is not None and not note
    assert step.at(4) == pytest.approx(truth.step_time(4, 800), rel=0.03)
    # The slope is the host's 0.2 ms and the compute each decode adds (at half speed).
    assert step.per_seq_s == pytest.approx(
        truth.step_time(4, 800) - truth.step_time(3, 600), rel=0.1
    )
    assert step.per_prefill_token_s == pytest.approx(
        truth.prefill_marginal(40) / 40 - 0.2e-3 / 40, rel=0.15
    )


def test_a_host_bound_server_gets_its_step_costs_and_prefill_compute(tiny):
    # The tiny model's GPU work is microseconds: steps are all host cost. A speed factor
    # would have to be 10x off to explain them, so the line itself is taken.
    truth = replace(tiny, overhead_s=2.5e-3, per_seq_s=0.2e-3, compute_speed=0.5)
    entry = entry_for(KEY, ["http://cpu:8000"], timed(truth), [1536], "now", perf=tiny)
    fit = engine_fit(entry, tiny)
    assert fit is not None and fit.speed is None
    assert fit.overhead_s == pytest.approx(2.5e-3, rel=0.1)
    assert fit.per_seq_s == pytest.approx(0.2e-3, rel=0.15)
    assert fit.compute_speed == pytest.approx(0.5, rel=0.15)
    calibrated = fit.apply(tiny)
    for b in (1, 4):
        assert calibrated.step_time(b, b * 200) == pytest.approx(
            truth.step_time(b, b * 200), rel=0.05
        )
    assert calibrated.prefill_time(200) == pytest.approx(truth.prefill_time(200), rel=0.1)
    assert "steps 2.5" in fit.text() and "prefill compute 0.5" in fit.text()


def test_a_gpu_bound_server_still_gets_a_speed(catalog):
    gpu = EnginePerf(catalog.gpu("RTX-4090"), catalog.model("llama-3-8b"), catalog.format("bf16"))
    slow = replace(gpu, speed=0.7)
    samples = [
        Sample(batch=b, step_s=slow.step_time(b, b * 512), tokens=400, requests=4, context=512)
        for b in (2, 4, 8, 12)
    ]
    key = Key("RTX-4090", "llama-3-8b", "bf16", 1)
    fit = engine_fit(entry_for(key, ["http://a:8000"], samples, [], "now", perf=gpu), gpu)
    assert fit is not None and fit.overhead_s is None and fit.per_seq_s is None
    assert fit.speed == pytest.approx(0.7, rel=0.05)
    assert EngineFit().apply(gpu) == gpu


def test_prefill_chunks_in_the_inter_token_latency_are_not_taken_for_a_slow_gpu(catalog):
    # Without vLLM's step counter (the emulator's page), the mean inter-token latency carries
    # the prefill chunks of the steps it spans. Read as decode steps alone, a GPU at its
    # model's speed came out 0.11-0.18x in a replay; the prompt tokens counted over each window
    # now take their share.
    gpu = EnginePerf(
        catalog.gpu("A100-SXM4-80GB"), catalog.model("llama-3-8b"), catalog.format("bf16")
    )
    samples = []
    for b in (4, 8, 16, 24):
        for chunk in (0, 256, 1024):
            itl = gpu.step_time(
                b + chunk, b * 1024 + chunk, b * 1024 + chunk * chunk / 2, seqs=b + 1
            )
            prompt = chunk * 400 / b  # prompt tokens over the window's 400 decode tokens
            before = Scrape(
                running=b, itl_sum=0.0, itl_count=0, prompt_tokens=0.0, prompt_cached=0.0
            )
            after = Scrape(
                running=b,
                itl_sum=itl * 400,
                itl_count=400,
                prompt_tokens=prompt,
                prompt_cached=0.0,
                prefill_sum=4 * gpu.prefill_time(1024) * 1.5,
                prefill_count=4,
                prefill_kv_tokens=4 * 1024,
                prompt_sum=4 * 1024,
                prompt_count=4,
                generation_sum=4 * 256,
                generation_count=4,
            )
            s = window(before, after)
            assert s is not None and s.prefill_per_step == pytest.approx(chunk)
            samples.append(s)
    key = Key("A100-SXM4-80GB", "llama-3-8b", "bf16", 1)
    fit = engine_fit(entry_for(key, ["http://a:8000"], samples, [], "now", perf=gpu), gpu)
    assert fit is not None and fit.speed == pytest.approx(1.0, rel=0.15)
