"""One /metrics page read once: routing's gauges and calibration's counters from the same pass.

Sample: tests/data/vllm-0.32.0-cpu-metrics.txt, a real vLLM 0.32.0 (CPU) server's page after
five requests (captured for ../shared/captures).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetctl.vllm_metrics import parse_metrics

PAGE = (Path(__file__).resolve().parent / "data" / "vllm-0.32.0-cpu-metrics.txt").read_text()


def test_a_real_page_gives_routing_and_calibration_their_figures():
    m = parse_metrics(PAGE)
    # Routing's gauges and counters.
    assert (m.running, m.waiting, m.kv_usage, m.preemptions) == (0.0, 0.0, 0.0, 0.0)
    assert m.generation_tokens == 59.0
    assert m.kv_tokens == 2_097_152  # 16384 blocks x 128 tokens: its kv_cache_size_tokens
    assert m.gpu_memory_utilization == pytest.approx(0.92)
    # Calibration's histogram sums and counts, and counters.
    assert (m.itl_count, m.steps, m.step_tokens, m.prompt_tokens) == (54.0, 59.0, 86.0, 27.0)
    assert (m.prefill_count, m.ttft_count) == (5.0, 5.0)
    assert m.ttft_sum == pytest.approx(0.1211, abs=1e-4)


def test_engines_add_up_except_the_kv_usage_which_is_the_fullest():
    page = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 3.0
vllm:num_requests_running{engine="1"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.2
vllm:kv_cache_usage_perc{engine="1"} 0.7
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0
"""
    m = parse_metrics(page)
    assert (m.running, m.kv_usage, m.kv_tokens) == (6.0, 0.7, 3200)


def test_families_it_does_not_want_are_skipped_and_a_page_without_types_is_read_whole():
    # A sample under another family's TYPE line is not one of ours (the format puts a family's
    # samples after its own TYPE line), so the hop past it is safe.
    page = "# TYPE other_family gauge\nother_family 1\n# TYPE vllm:num_requests_waiting gauge\n"
    assert parse_metrics(page + "vllm:num_requests_waiting 4\n").waiting == 4.0
    bare = "vllm:num_requests_waiting 2\nvllm:num_preemptions_total 5\n"
    m = parse_metrics(bare)
    assert (m.waiting, m.preemptions) == (2.0, 5.0)
    # Counters typed with or without their _total suffix (client libraries differ).
    for family in ("vllm:num_preemptions", "vllm:num_preemptions_total"):
        typed = f"# TYPE {family} counter\nvllm:num_preemptions_total 7\n"
        assert parse_metrics(typed).preemptions == 7.0
